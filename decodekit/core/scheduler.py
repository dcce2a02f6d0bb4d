"""The continuous batcher: which sequences run this step, how many tokens each, and who yields memory.

The scheduler owns where each sequence is: its status (waiting, running, finished), how many of its tokens are in
the KV cache (`num_computed_tokens`) and its blocks (through the `BlockAllocator`, which only it writes). Other
modules ask it: `advance` after a forward, `rollback` after a rejected draft, `fork`, `finish_sequence`.

Every step: running requests first (decodes and the rest of their prefill, oldest first), then waiting requests
are admitted while the token budget, the sequence limit and the free KV blocks allow. A prompt longer than the
budget is prefilled in chunks over several steps, mixed with other requests' decodes. When a running sequence
needs a block and none is free, the newest (or lowest-priority) running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later (prefix caching usually makes that cheap).

Candidates (`StepContext.score_candidates`): a sequence that scores several sibling next tokens at once is run as
one hidden probe per candidate, a sequence that shares its blocks copy-on-write and has the candidate as its one
pending token. The probes are scheduled together (all or none) in place of the sequence; when the strategy accepts
one, the sequence takes over that probe's blocks (its key and value are kept, not recomputed) and the others are
freed. Anything that ends, frees or preempts the sequence drops its probes.

Draft trees (`seq.draft_branches`) use the same probes, one per branch, each with its branch as its draft: all
are scheduled (all or none) in place of the sequence, and when the strategy accepts a branch the sequence adopts
that probe's blocks and rolls them back to the accepted prefix (`accept_branch`). A tree whose rows do not fit in
the step's token budget is verified as its first branch alone (`drafts.flatten`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from decodekit.api.sequence import Request, Sequence, SequenceStatus
from decodekit.core import drafts
from decodekit.execution import BlockAllocator


@dataclass
class ScheduledSequence:
    """One sequence's work this step: compute `num_tokens` tokens starting at its `num_computed_tokens`."""

    seq: Sequence
    num_tokens: int
    completes: bool = False  # the chunk reaches the sequence's last token, so its logits are needed

    def __post_init__(self) -> None:
        seq = self.seq
        self.completes = self.num_tokens == seq.num_pending


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one step."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to run this step."""
        return not self.scheduled


def needs_prompt_logits(request: Request) -> bool:
    """Whether the request still needs logits at its prompt positions (`prompt_logprobs` not yet recorded)."""
    wanted = request.params.prompt_logprobs is not None
    return wanted and (request.prompt_logprobs is None or len(request.prompt_logprobs) < len(request.prompt_token_ids))


def needs_every_hidden_state(request: Request) -> bool:
    """Whether the request's strategy needs the hidden state of every position
    (`Strategy.needs_every_hidden_state`): then its prompt is computed in full, never served from the prefix
    cache (cached positions have no hidden states)."""
    plan = request.plan
    if plan is None or not wants_hidden_states(request):
        return False
    needs = getattr(plan.strategy, "needs_every_hidden_state", None)
    return bool(needs(plan.strategy_options)) if callable(needs) else True


def wants_hidden_states(request: Request) -> bool:
    """Whether the request's strategy reads hidden states (`Strategy.reads_hidden_states`, by default its
    `hidden_states`): then the forward keeps the last hidden state of every position it computes."""
    plan = request.plan
    if plan is None:
        return False
    reads = getattr(plan.strategy, "reads_hidden_states", None)
    if callable(reads):
        return bool(reads(plan.strategy_options))
    return bool(getattr(plan.strategy, "hidden_states", False))


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Scheduler:
    """FCFS or priority continuous batching over a `BlockAllocator`.

    Args:
        allocator: the KV block allocator (the scheduler is the only module that changes it).
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: the per-step token budget (decodes + prefill chunks).
        policy: "fcfs" (arrival order) or "priority" (lower `priority` value first, then arrival).
        window: where every layer of the model attends only its last `window` keys (`kv_cache.uniform_window`), the
            blocks behind each running sequence's window are released as it advances; None keeps them all.
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", window: int | None = None) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"`policy` must be 'fcfs' or 'priority', got {policy!r}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.window = window
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.probes: dict[Sequence, list[Sequence]] = {}  # a sequence's candidate probes, in candidate order
        self.probe_parent: dict[Sequence, Sequence] = {}

    def _key(self, request: Request) -> tuple[float, float]:
        return (request.priority if self.policy == "priority" else 0, request.arrival_time)

    def add(self, request: Request) -> None:
        """Queue a request (its sequences must be WAITING)."""
        self.waiting.append(request)
        self.waiting.sort(key=self._key)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (abort, error or finish)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        for seq in request.sequences:
            self.free_sequence(seq)

    def free_sequence(self, seq: Sequence) -> None:
        """Release one sequence's blocks (it finished, or its request is done), and its candidates' (or its draft
        tree's probes)."""
        if seq.candidate_token_ids or seq in self.probes:
            self.drop_candidates(seq)
        if self.allocator.has(seq.seq_id):
            self.allocator.free(seq.seq_id)

    # ---- candidates ----------------------------------------------------------------------------------------
    def add_candidates(self, seq: Sequence, token_ids: list[int]) -> None:
        """Score `token_ids` side by side as `seq`'s next token in the next forward: one probe per candidate, sharing
        `seq`'s blocks (every token of `seq` must be computed)."""
        self.drop_candidates(seq)
        probes = []
        for token in token_ids:
            probe = Sequence(seq.request, [*seq.token_ids, token], seq.num_prompt_tokens,
                             status=SequenceStatus.RUNNING, num_computed_tokens=seq.num_computed_tokens)
            self.allocator.fork(seq.seq_id, probe.seq_id)
            probes.append(probe)
            self.probe_parent[probe] = seq
        self.probes[seq] = probes
        seq.candidate_token_ids = list(token_ids)

    def drop_candidates(self, seq: Sequence) -> None:
        """Forget `seq`'s candidates and free their probes."""
        for probe in self.probes.pop(seq, ()):
            del self.probe_parent[probe]
            if self.allocator.has(probe.seq_id):
                self.allocator.free(probe.seq_id)
        seq.candidate_token_ids = []

    def accept_candidate(self, seq: Sequence, index: int) -> None:
        """`seq` keeps its `index`-th candidate's key and value: it takes over that probe's blocks (the token itself
        is appended by the step context); the other probes are freed."""
        self._adopt_probe(seq, index)

    def _adopt_probe(self, seq: Sequence, index: int) -> None:
        """`seq` takes over probe `index`'s blocks and computed tokens; its other probes are freed."""
        probes = self.probes[seq]
        chosen = probes[index]
        if chosen.num_pending != 0:
            raise ValueError("candidates and draft-tree branches can be accepted only after the forward that scored "
                             "them")
        del self.probe_parent[chosen]
        self.probes[seq] = [p for p in probes if p is not chosen]
        self.drop_candidates(seq)
        self.allocator.adopt(seq.seq_id, chosen.seq_id)
        seq.num_computed_tokens = chosen.num_computed_tokens

    def accept_branch(self, seq: Sequence, index: int, num_valid: int) -> None:
        """`seq` keeps branch `index` of its draft tree: it takes over that branch's probe's blocks, cut back to its
        first `num_valid` tokens (the rejected tail of the branch is released); the other probes are freed."""
        self._adopt_probe(seq, index)
        self.rollback(seq, num_valid)

    def _add_branch_probes(self, seq: Sequence) -> None:
        """One probe per branch of `seq`'s draft tree, each a fork of `seq` with that branch as its draft."""
        probes = []
        for branch in seq.draft_branches:
            probe = Sequence(seq.request, list(seq.token_ids), seq.num_prompt_tokens, status=SequenceStatus.RUNNING,
                             num_computed_tokens=seq.num_computed_tokens, draft_token_ids=list(branch))
            self.allocator.fork(seq.seq_id, probe.seq_id)
            probes.append(probe)
            self.probe_parent[probe] = seq
        self.probes[seq] = probes

    def scored_parents(self, seqs: list[Sequence]) -> list[Sequence]:
        """`seqs` with each run of a sequence's candidate probes replaced by that sequence (once)."""
        out: list[Sequence] = []
        for seq in seqs:
            parent = self.probe_parent.get(seq)
            if parent is None:
                out.append(seq)
            elif not out or out[-1] is not parent:
                out.append(parent)
        return out

    def _schedule_probes(self, request: Request, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule all of `seq`'s probes (a candidate's one token each, or a branch's tokens) or none; return the
        tokens used."""
        probes = self.probes[seq]
        if sum(p.num_pending for p in probes) > budget:
            return 0
        start = seq.num_computed_tokens
        while sum(self.allocator.blocks_to_write(p.seq_id, start, start + p.num_pending) for p in probes) \
                > self.allocator.num_free_blocks:
            victim = self._victim()
            self._preempt(victim, out)
            if victim is request:
                return 0
        for probe in probes:
            self.allocator.ensure_slots(probe.seq_id, start, start + probe.num_pending)
            out.scheduled.append(ScheduledSequence(probe, probe.num_pending))
        return sum(p.num_pending for p in probes)

    def finish_sequence(self, seq: Sequence) -> None:
        """Mark a sequence finished and release its blocks."""
        seq.status = SequenceStatus.FINISHED
        self.free_sequence(seq)

    def advance(self, seq: Sequence, num_tokens: int) -> None:
        """After a forward: `num_tokens` more of the sequence's tokens are in the cache (full blocks get published
        for prefix caching; draft positions never are)."""
        seq.num_computed_tokens += num_tokens
        committed = min(seq.num_computed_tokens, len(seq.token_ids))
        self.allocator.mark_computed(seq.seq_id, seq.token_ids, committed)
        if self.window is not None:
            # The next query sits at `committed` or later (a rollback never goes behind the committed tokens) and
            # sees keys from `committed - window + 1` on; one key more is kept as a margin.
            self.allocator.drop_behind(seq.seq_id, committed - self.window)

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Only the first `num_valid` tokens' keys and values are right (the rest were rejected drafts)."""
        seq.num_computed_tokens = num_valid
        self.allocator.truncate(seq.seq_id, num_valid)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a copy of `parent`'s tokens) shares `parent`'s blocks copy-on-write and its place."""
        child.status = parent.status
        child.num_computed_tokens = parent.num_computed_tokens
        if self.allocator.has(parent.seq_id):
            self.allocator.fork(parent.seq_id, child.seq_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        for seq in request.sequences:
            if not seq.finished:
                self.free_sequence(seq)  # candidates too: the strategy picks them again from the recomputed row
                seq.status = SequenceStatus.WAITING
                seq.num_computed_tokens = 0
                drafts.clear(seq)
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the front of its class: under FCFS it is older than everything waiting; under the priority
        # policy it must not jump ahead of a waiting request with a better (lower) priority value.
        self.waiting.insert(0, request)
        self.waiting.sort(key=self._key)
        out.preempted.append(request)

    def _victim(self) -> Request:
        return max(self.running, key=self._key)

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in sorted(self.running, key=self._key):
            # preempted earlier in this loop (`_preempt` lists it; a membership test of `running` would cost
            # O(requests) each, a millisecond a step at 256 running requests)
            if out.preempted and request in out.preempted:
                continue
            for seq in request.sequences:
                if seq.candidate_token_ids and not seq.finished:
                    budget -= self._schedule_probes(request, seq, budget, out)
                    if out.preempted and request in out.preempted:
                        break
                    continue
                if seq.finished or budget == 0:
                    continue
                drafts.flatten(seq, budget)
                if seq.draft_branches:
                    if seq not in self.probes:
                        self._add_branch_probes(seq)
                    budget -= self._schedule_probes(request, seq, budget, out)
                    if out.preempted and request in out.preempted:
                        break
                    continue
                if not self.allocator.has(seq.seq_id) and not self._attach_follower(request, seq):
                    continue
                if seq.num_pending == 0:
                    continue
                drafts.trim(seq, budget)
                n = min(seq.num_pending, budget)
                start = seq.num_computed_tokens
                while self.allocator.blocks_to_write(seq.seq_id, start, start + n) > self.allocator.num_free_blocks:
                    victim = self._victim()
                    self._preempt(victim, out)
                    if victim is request:
                        break
                if out.preempted and request in out.preempted:
                    break
                self.allocator.ensure_slots(seq.seq_id, start, start + n)
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        if out.preempted:
            # Anything preempted this step was already scheduled-for, or would thrash: retry it next step.
            out.scheduled = [s for s in out.scheduled if s.seq.request in self.running]
            return out
        # Admission is limited by the sequences that are running, scheduled this step or not.
        running_seqs = sum(max(r.max_sequences, sum(1 for s in r.sequences if not s.finished)) for r in self.running)
        self._admit(out, budget, running_seqs)
        return out

    def _blocks_shared(self, seqs: list[Sequence]) -> int:
        """The blocks `seqs` need with the full blocks of each one's common prefix with the first counted once."""
        first = seqs[0].token_ids
        total = self.allocator.blocks_needed(len(first))
        for seq in seqs[1:]:
            total += self.allocator.blocks_needed(len(seq.token_ids)) - _common_prefix(first, seq.token_ids) \
                // self.allocator.block_size
        return total

    def _attach_follower(self, request: Request, seq: Sequence) -> bool:
        """Give a follower of a re-admitted request (see `_admit`) its blocks, once a sibling that holds blocks has
        computed their common prefix: it then starts from that sibling's published blocks. False while it waits
        (the prefix is still being computed, or the pool has no room yet)."""
        leader = next((s for s in request.sequences if s is not seq and not s.finished
                       and self.allocator.has(s.seq_id)), None)
        if leader is not None:
            shared = min(_common_prefix(leader.token_ids, seq.token_ids), len(seq.token_ids) - 1)
            if leader.num_computed_tokens < shared // self.allocator.block_size * self.allocator.block_size:
                return False
        if not self.allocator.can_allocate(seq.token_ids):
            return False
        seq.num_computed_tokens = self.allocator.allocate(seq.seq_id, seq.token_ids)
        return True

    def _admit(self, out: SchedulerOutput, budget: int, num_seqs: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            seqs = [s for s in request.sequences if not s.finished]
            width = max(len(seqs), request.max_sequences)
            # One sequence may reuse cached prefix blocks. Several (a preempted `n` > 1 or beam request back for
            # recompute) share their common prefix: the first is allocated now, the others once it has computed
            # that prefix (`_attach_follower`), from the prefix cache, so the prefix is counted once.
            reuse = not needs_prompt_logits(request) and not needs_every_hidden_state(request)
            needed = (self._blocks_shared(seqs) if reuse
                      else sum(self.allocator.blocks_needed(len(s.token_ids)) for s in seqs))
            error = None
            if width > self.max_num_seqs:
                error = (f"request has {width} sequences but at most {self.max_num_seqs} run at once; "
                         "raise max_num_seqs or lower n")
            elif needed > self.allocator.num_blocks:
                error = (
                    f"request needs {needed} KV blocks but the cache has only {self.allocator.num_blocks}; "
                    "raise the KV cache memory or shorten the prompt"
                )
            if error is not None:  # it could never run: fail it rather than block the queue forever
                self.waiting.pop(0)
                request.error = error
                out.failed.append(request)
                continue
            if num_seqs + width > self.max_num_seqs:
                break
            fits = (self.allocator.can_allocate(seqs[0].token_ids, reuse_prefix=reuse) if len(seqs) == 1 or reuse
                    else needed <= self.allocator.num_free_blocks)
            if not fits:
                break
            self.waiting.pop(0)
            self.running.append(request)
            num_seqs += width
            first_admission = request.metrics.first_scheduled_time is None
            if first_admission:
                request.metrics.first_scheduled_time = time.perf_counter()
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                if reuse and seq is not seqs[0]:
                    seq.num_computed_tokens = 0  # a follower: blocks once the first has computed their prefix
                    continue
                cached = self.allocator.allocate(seq.seq_id, seq.token_ids, reuse_prefix=reuse)
                seq.num_computed_tokens = cached
                if seq is request.sequences[0] and first_admission:
                    request.metrics.num_cached_prompt_tokens = cached
                n = min(seq.num_uncomputed, budget)
                if n > 0:
                    out.scheduled.append(ScheduledSequence(seq, n))
                    budget -= n
