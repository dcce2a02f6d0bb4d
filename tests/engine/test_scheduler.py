"""Property and unit tests for the continuous batcher (`decodekit.core.scheduler.Scheduler`), without a model.

`Sim` plays the engine's part (see `Engine.add_request` / `Engine.step`): each step it calls `schedule()`, applies the
allocator's copy-on-write copies, "computes" every scheduled chunk (advancing `num_computed_tokens`, publishing
prefix blocks with `mark_computed`), appends a token to each sequence whose chunk `completes`, and finishes a
request once it has generated `max_tokens`. The next token is a deterministic function of the whole sequence
(like greedy decoding), so a lost, duplicated or recomputed-differently token is visible. Like the allocator
tests, it keeps a shadow of the KV pool (each slot holds the token prefix up to its position) and checks before
every chunk that the context the chunk attends to really is the sequence's own.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Request, Sequence, SequenceStatus
from decodekit.core.scheduler import ScheduledSequence, Scheduler
from decodekit.execution.blocks import BlockAllocator


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float = 0.0, n: int = 1) -> Request:
    """A request with `n` sequences over the prompt, as `Engine.add_request` builds it."""
    request = Request(request_id, None, list(prompt), SamplingParams(max_tokens=max_tokens), priority,
                      arrival_time=arrival)
    for _ in range(n):
        request.sequences.append(Sequence(request, list(prompt), len(prompt)))
    return request


def next_token(token_ids: list[int]) -> int:
    """The 'model': a deterministic function of the whole sequence, over a tiny vocabulary (prefixes repeat)."""
    return hash(tuple(token_ids)) % 3


class Sim:
    """A scheduler over a small allocator, driven like the engine, checking the contract at every step."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 8, budget: int = 64,
                 policy: str = "fcfs") -> None:
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.sched = Scheduler(self.alloc, max_num_seqs, budget, policy)
        self.bs = block_size
        self.content: dict[int, list[tuple[int, ...] | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.requests: list[Request] = []
        self.finished: list[Request] = []
        self.failed: list[Request] = []
        self.admission_order: list[str] = []
        self.steps = 0
        self.outputs: list = []

    def add(self, request: Request) -> Request:
        self.requests.append(request)
        self.sched.add(request)
        return request

    def _key(self, request: Request) -> tuple[float, float]:
        return (request.priority if self.sched.policy == "priority" else 0, request.arrival_time)

    def _running_seqs(self) -> int:
        return sum(1 for r in self.sched.running for s in r.sequences if not s.finished)

    def step(self):
        sched, alloc = self.sched, self.alloc
        before_waiting = list(sched.waiting)
        before_running = list(sched.running)
        tokens_before = {s.seq_id: list(s.token_ids) for r in self.requests for s in r.sequences}
        out = sched.schedule()
        self.steps += 1
        self.outputs.append(out)

        # ---- the step's work respects the limits ---------------------------------------------------------
        assert sum(s.num_tokens for s in out.scheduled) <= sched.max_num_batched_tokens, "token budget exceeded"
        assert all(s.num_tokens >= 1 for s in out.scheduled)
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled), "a sequence scheduled twice"
        assert len(out.scheduled) <= sched.max_num_seqs
        assert self._running_seqs() <= sched.max_num_seqs
        assert out.scheduled or not sched.running or out.preempted, "running requests but nothing to do"

        # ---- preempted requests: blocks freed, recomputed from scratch, generated tokens kept ----------------
        for request in out.preempted:
            assert request not in sched.running and request in sched.waiting
            assert request.metrics.num_preemptions >= 1
            for seq in request.sequences:
                assert seq.token_ids == tokens_before[seq.seq_id], "preemption lost generated tokens"
                if not seq.finished:
                    assert seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING
                    assert not alloc.has(seq.seq_id)

        # ---- requests that can never run fail, with a reason ----------------------------------------------
        for request in out.failed:
            assert isinstance(request.error, str) and request.error
            seqs = [s for s in request.sequences if not s.finished]
            too_big = sum(alloc.blocks_needed(len(s.token_ids)) for s in seqs) > alloc.num_blocks
            assert too_big or len(seqs) > sched.max_num_seqs, f"a request that fits failed: {request.error}"
            assert request not in sched.waiting and request not in sched.running
            sched.remove(request)  # as Engine._finish_request_with_error does
            for seq in request.sequences:
                seq.status = SequenceStatus.FINISHED
            self.failed.append(request)

        # ---- admission follows the policy: the queue stays ordered, nobody is admitted past a better key ----
        keys = [self._key(r) for r in sched.waiting]
        assert keys == sorted(keys), "the waiting queue is out of policy order"
        admitted = [r for r in sched.running if r not in before_running]
        assert all(r in before_waiting for r in admitted)
        for request in admitted:
            self.admission_order.append(request.request_id)
            assert all(self._key(request) <= self._key(w) for w in sched.waiting), "admitted past a better key"

        # ---- the forward pass: copies, then each chunk reads its own context and writes its slots ----------
        copies = alloc.take_pending_copies()
        gathered = [list(self.content[src]) for src, _ in copies]
        for (_, dst), data in zip(copies, gathered):
            self.content[dst] = data
        for item in out.scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_tokens
            assert seq.request in sched.running and seq.status is SequenceStatus.RUNNING and not seq.finished
            assert item.completes == (start + n == len(seq.token_ids))
            assert alloc.num_slots(seq.seq_id) >= start + n
            table = alloc.block_table(seq.seq_id)
            for i in range(start // self.bs, (start + n - 1) // self.bs + 1):
                assert alloc.ref_counts[table[i]] == 1, "a chunk would write into a shared block"
            for p in range(start):
                assert self.content[table[p // self.bs]][p % self.bs] == tuple(seq.token_ids[: p + 1]), (
                    f"request {seq.request.request_id} attends to K/V that is not its own at position {p}")
            for p in range(start, start + n):
                self.content[table[p // self.bs]][p % self.bs] = tuple(seq.token_ids[: p + 1])
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            alloc.mark_computed(item.seq.seq_id, item.seq.token_ids, item.seq.num_computed_tokens)

        # ---- sampling and stopping ---------------------------------------------------------------------------
        for item in out.scheduled:
            seq = item.seq
            if item.completes:
                seq.token_ids.append(next_token(seq.token_ids))
                if seq.num_generated >= seq.request.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    sched.free_sequence(seq)
        for request in {id(s.seq.request): s.seq.request for s in out.scheduled}.values():
            if all(s.finished for s in request.sequences) and request in sched.running:
                sched.remove(request)
                self.finished.append(request)
        return out

    def run(self, arrivals: list[tuple[int, Request]] | None = None, max_steps: int = 2000) -> None:
        """Step until every request has finished or failed; arrivals are (step, request)."""
        pending = sorted(arrivals or [], key=lambda a: a[0])
        while pending or self.sched.has_work():
            while pending and pending[0][0] <= self.steps:
                self.add(pending.pop(0)[1])
            self.step()
            assert self.steps < max_steps, "no progress: starvation or deadlock"

    def assert_clean(self) -> None:
        """No leaks: every block is free again and no sequence holds a table."""
        assert self.alloc.num_free_blocks == self.alloc.num_blocks
        assert not any(self.alloc.ref_counts)
        assert not any(self.alloc.has(s.seq_id) for r in self.requests for s in r.sequences)
        assert not self.sched.waiting and not self.sched.running


# ---- the whole life cycle, random workloads --------------------------------------------------------------------
REQUEST = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=12),  # prompt
    st.integers(1, 6),  # max_tokens
    st.integers(0, 3),  # priority
    st.integers(1, 2),  # sequences
    st.integers(0, 6),  # arrival step
)


@settings(max_examples=250, deadline=None)
@given(num_blocks=st.integers(2, 16), block_size=st.integers(1, 4), max_num_seqs=st.integers(1, 4),
       budget=st.integers(1, 16), policy=st.sampled_from(["fcfs", "priority"]),
       specs=st.lists(REQUEST, min_size=1, max_size=6))
def test_every_request_finishes_or_fails_for_a_reason_within_budget_and_without_leaks(
    num_blocks, block_size, max_num_seqs, budget, policy, specs
):
    sim = Sim(num_blocks, block_size, max_num_seqs, budget, policy)
    arrivals = [
        (step, make_request(f"r{i}", prompt, max_tokens, priority, arrival=float(i), n=n))
        for i, (prompt, max_tokens, priority, n, step) in enumerate(specs)
    ]
    sim.run(arrivals)
    target(float(sim.sched.num_preemptions), label="preemptions")
    sim.assert_clean()
    assert len(sim.finished) + len(sim.failed) == len(arrivals)
    for request in sim.requests:
        fits = len(request.sequences) <= max_num_seqs and len(request.sequences) * sim.alloc.blocks_needed(
            len(request.prompt_token_ids) + request.params.max_tokens - 1) <= num_blocks
        if fits:  # it can always be given its peak memory, so it must not fail (nor starve)
            assert request in sim.finished, f"{request.request_id} fits the cache but failed: {request.error}"
        if request in sim.finished:
            for seq in request.sequences:
                # exactly max_tokens, each the model's token for its prefix: none lost or redone differently
                assert seq.num_generated == request.params.max_tokens
                for k in range(seq.num_prompt_tokens, len(seq.token_ids)):
                    assert seq.token_ids[k] == next_token(seq.token_ids[:k])


@settings(max_examples=150, deadline=None)
@given(priorities=st.lists(st.integers(0, 5), min_size=2, max_size=8), block_size=st.integers(1, 4))
def test_priority_policy_admits_lower_priority_values_first_then_arrival_order(priorities, block_size):
    sim = Sim(64, block_size, max_num_seqs=1, budget=8, policy="priority")
    for i, priority in enumerate(priorities):
        sim.add(make_request(f"r{i}", [1, 2, 3], max_tokens=2, priority=priority, arrival=float(i)))
    sim.run()
    expected = sorted(range(len(priorities)), key=lambda i: (priorities[i], i))
    assert sim.admission_order == [f"r{i}" for i in expected]
    sim.assert_clean()


@settings(max_examples=150, deadline=None)
@given(num_requests=st.integers(2, 6), block_size=st.integers(1, 4), max_tokens=st.integers(1, 6))
def test_fcfs_admits_in_arrival_order_even_when_a_later_one_would_fit(num_requests, block_size, max_tokens):
    sim = Sim(8, block_size, max_num_seqs=1, budget=8)
    for i in reversed(range(num_requests)):  # queued out of order; arrival time decides
        sim.add(make_request(f"r{i}", [i % 3] * (1 + i), max_tokens=max_tokens, arrival=float(i)))
    sim.run()
    assert sim.admission_order == [f"r{i}" for i in range(num_requests)]
    sim.assert_clean()


# ---- chunked prefill and budget ---------------------------------------------------------------------------------
def test_prompt_longer_than_the_budget_is_prefilled_in_chunks_and_completes_only_on_the_last_chunk():
    sim = Sim(16, 4, budget=5)
    request = sim.add(make_request("a", list(range(12)), max_tokens=1))
    chunks = []
    while sim.sched.has_work():
        out = sim.step()
        chunks += [(s.num_tokens, s.completes) for s in out.scheduled]
    assert chunks == [(5, False), (5, False), (2, True)]
    assert request.sequences[0].num_generated == 1
    sim.assert_clean()


def test_decodes_of_running_requests_are_scheduled_before_new_prefills_share_the_budget():
    sim = Sim(32, 4, budget=6)
    first = sim.add(make_request("a", [1, 2, 3], max_tokens=8, arrival=0.0))
    sim.step()  # a's prefill (3 tokens) completes
    second = sim.add(make_request("b", list(range(10)), max_tokens=1, arrival=1.0))
    out = sim.step()
    assert [(s.seq.request, s.num_tokens) for s in out.scheduled] == [(first, 1), (second, 5)]
    sim.run()
    sim.assert_clean()


def test_max_num_seqs_limits_how_many_requests_run_at_once():
    sim = Sim(32, 4, max_num_seqs=2, budget=64)
    for i in range(4):
        sim.add(make_request(f"r{i}", [i, i], max_tokens=3, arrival=float(i)))
    out = sim.step()
    assert [s.seq.request.request_id for s in out.scheduled] == ["r0", "r1"]
    sim.run()
    assert sim.admission_order == ["r0", "r1", "r2", "r3"]
    sim.assert_clean()


# ---- preemption ------------------------------------------------------------------------------------------------------
def test_out_of_blocks_preempts_the_newest_request_which_is_recomputed_from_scratch_keeping_its_tokens():
    # 4 blocks of 2: each request needs 2 blocks for its prompt, and a third once it has decoded a token.
    sim = Sim(4, 2, budget=64)
    old = sim.add(make_request("old", [1, 2, 0], max_tokens=4, arrival=0.0))
    new = sim.add(make_request("new", [2, 1, 1], max_tokens=4, arrival=1.0))
    sim.step()  # both prefilled; each appended its first token (4 tokens, 2 blocks each: pool full)
    sim.step()  # both decode position 3 (still in block 1); each now has 5 tokens
    out = sim.step()  # old needs a third block: new is preempted
    assert out.preempted == [new] and sim.sched.waiting == [new]
    assert [s.seq.request for s in out.scheduled] == [old]
    seq = new.sequences[0]
    assert seq.num_computed_tokens == 0 and seq.num_generated == 2 and not sim.alloc.has(seq.seq_id)
    assert new.metrics.num_preemptions == 1 and sim.sched.num_preemptions == 1
    sim.run()
    assert sim.finished == [old, new]
    assert seq.num_generated == 4
    sim.assert_clean()


def test_the_newest_request_preempts_itself_when_it_needs_a_block_and_resumes_after_older_ones_finish():
    sim = Sim(3, 2, budget=64)
    older = sim.add(make_request("a", [1, 2, 0], max_tokens=2, arrival=0.0))  # 2 blocks, all it ever needs
    newer = sim.add(make_request("b", [2, 1], max_tokens=3, arrival=1.0))  # 1 block, a second at position 2
    sim.step()
    out = sim.step()  # b needs a block, none is free, and b is the newest: b yields, a keeps running
    assert out.preempted == [newer] and [s.seq.request for s in out.scheduled] == [older]
    sim.run()
    assert sim.finished == [older, newer] and newer.sequences[0].num_generated == 3
    sim.assert_clean()


def test_preempted_low_priority_request_does_not_jump_ahead_of_a_waiting_high_priority_one():
    # Regression: preemption put the victim at the head of the queue regardless of the policy.
    sim = Sim(4, 4, budget=64, policy="priority")
    sim.add(make_request("high", list(range(7)), max_tokens=8, priority=0, arrival=0.0))  # 2 blocks
    low = sim.add(make_request("low", [1, 2, 3], max_tokens=8, priority=5, arrival=1.0))  # 1 block
    sim.step()
    urgent = sim.add(make_request("urgent", [9] * 8, max_tokens=1, priority=0, arrival=2.0))  # 2 blocks: waits
    preempted = []
    while low not in preempted:
        preempted += sim.step().preempted
    assert sim.sched.waiting == [urgent, low]
    sim.run()
    readmitted_low = max(i for i, r in enumerate(sim.admission_order) if r == "low")
    assert sim.admission_order.index("urgent") < readmitted_low
    sim.assert_clean()


# ---- requests that can never run -------------------------------------------------------------------------------
def test_request_larger_than_the_whole_cache_fails_with_an_error_and_others_still_run():
    sim = Sim(3, 2, budget=64)
    huge = sim.add(make_request("huge", list(range(7)), arrival=0.0))  # 4 blocks > 3
    small = sim.add(make_request("small", [1], max_tokens=2, arrival=1.0))
    out = sim.step()
    assert out.failed == [huge] and "KV blocks" in huge.error
    assert [s.seq.request for s in out.scheduled] == [small]
    sim.run()
    assert sim.finished == [small]
    sim.assert_clean()


def test_request_that_outgrows_the_cache_while_decoding_fails_instead_of_looping():
    sim = Sim(2, 2, budget=64)
    request = sim.add(make_request("a", [1, 2, 0], max_tokens=10))  # fits at first; 5 tokens need 3 blocks
    sim.run(max_steps=50)
    assert sim.failed == [request] and "KV blocks" in request.error
    assert request.sequences[0].num_generated == 2
    sim.assert_clean()


def test_request_with_more_sequences_than_max_num_seqs_fails_instead_of_blocking_the_queue():
    # Regression: it was never admitted and never failed, so it and everything behind it waited forever.
    sim = Sim(16, 4, max_num_seqs=1, budget=64)
    wide = sim.add(make_request("wide", [1, 2], n=2, arrival=0.0))
    narrow = sim.add(make_request("narrow", [1, 2], arrival=1.0))
    sim.run(max_steps=50)
    assert sim.failed == [wide] and "max_num_seqs" in wide.error
    assert sim.finished == [narrow]
    sim.assert_clean()


# ---- prefix cache, removal, construction ---------------------------------------------------------------------
def test_a_repeated_prompt_is_admitted_with_its_cached_blocks_already_computed():
    sim = Sim(16, 4, budget=64)
    prompt = list(range(10))
    sim.add(make_request("a", prompt, max_tokens=1, arrival=0.0))
    sim.run()
    again = sim.add(make_request("b", prompt, max_tokens=1, arrival=1.0))
    out = sim.step()
    assert again.metrics.num_cached_prompt_tokens == 8
    assert [(s.seq.request, s.num_tokens) for s in out.scheduled] == [(again, 2)]
    sim.run()
    sim.assert_clean()


def test_remove_frees_the_blocks_of_a_running_and_of_a_waiting_request():
    sim = Sim(4, 4, max_num_seqs=1, budget=64)
    running = sim.add(make_request("a", list(range(6)), max_tokens=5, arrival=0.0))
    waiting = sim.add(make_request("b", [1], arrival=1.0))
    sim.step()
    assert sim.alloc.num_free_blocks == 2
    sim.sched.remove(running)
    sim.sched.remove(waiting)
    assert not sim.sched.has_work()
    sim.assert_clean()


def test_scheduled_sequence_completes_only_when_the_chunk_reaches_the_last_token():
    request = make_request("a", [1, 2, 3, 4])
    seq = request.sequences[0]
    assert not ScheduledSequence(seq, 3).completes
    assert ScheduledSequence(seq, 4).completes
    seq.num_computed_tokens = 2
    assert ScheduledSequence(seq, 2).completes


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        Scheduler(BlockAllocator(4, 4), 4, 16, policy="lifo")
