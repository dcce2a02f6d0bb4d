"""Property and unit tests for the pure-Python KV block allocator (`decodekit.execution.blocks.BlockAllocator`).

`ShadowPool` runs an allocator next to a model of its sequences and of the pool's contents: every slot holds what a
real model would have written there, namely the token prefix up to and including that position (the K/V at position
p depends on tokens 0..p). Copy-on-write copies are applied like `PagedKVCache.copy_blocks` (gather every source,
then scatter), and the shadow survives freeing, exactly as GPU memory does. So a sharing bug, a lost copy or a stale
prefix-cache entry shows up as a sequence, or a new prompt served from the cache, reading a slot that does not hold
its own prefix. A hypothesis state machine drives it with random operations; two targeted properties drive the
narrow lifecycles (diverge after sharing, roll back a prompt computed twice) that random search reaches rarely.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from decodekit.execution.blocks import BlockAllocator, OutOfBlocksError

# A tiny alphabet so random prompts share prefixes (and hit the prefix cache) often.
TOKENS = st.lists(st.integers(0, 2), max_size=10)
SHORT = st.lists(st.integers(0, 2), max_size=3)
MAX_LIVE = 4  # few live sequences: they share, fork and free each other's sharers far more often


def _snapshot(alloc: BlockAllocator) -> dict:
    """Everything the allocator holds, to check that a failed operation changed nothing."""
    return copy.deepcopy(alloc.__dict__)


def _kv(tokens: list[int], position: int) -> tuple[int, ...]:
    """What the model writes at `position`: it depends on every token up to and including it."""
    return tuple(tokens[: position + 1])


class ShadowPool:
    """A BlockAllocator plus a model of its sequences and of the K/V each pool slot holds; asserts as it goes."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.bs = block_size
        self.tokens: dict[int, list[int]] = {}  # live sequence -> its token ids
        self.computed: dict[int, int] = {}  # live sequence -> how many leading positions hold its K/V
        self.dropped: dict[int, int] = {}  # live sequence -> leading blocks released behind its sliding window
        self.content: dict[int, list[tuple[int, ...] | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.history: list[list[int]] = []  # recent token lists, to probe the cache with and to reuse as prompts
        self._next_id = 0

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def remember(self, tokens: list[int]) -> None:
        self.history = [*self.history[-19:], list(tokens)]

    # ---- operations --------------------------------------------------------------------------------------
    def allocate(self, seq: int, tokens: list[int]) -> int | None:
        """Allocate like the scheduler's admission; None if the pool is too small (checked to change nothing)."""
        matched = self.alloc.match_prefix(tokens)
        if not self.alloc.can_allocate(tokens):  # the prediction is exact: it fails, and changes nothing
            before = _snapshot(self.alloc)
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate(seq, tokens)
            assert _snapshot(self.alloc) == before, "a failed allocate changed the allocator"
            return None
        cached = self.alloc.allocate(seq, tokens)
        # match_prefix leaves at least one token to compute, and allocate serves exactly those blocks
        assert cached == len(matched) * self.bs
        assert cached <= max(0, len(tokens) - 1)
        table = self.alloc.block_table(seq)
        assert table[: len(matched)] == matched
        assert len(table) == self.alloc.blocks_needed(len(tokens))
        # The reused blocks really hold this prompt's K/V (no stale or foreign prefix is served) ...
        for p in range(cached):
            assert self.content[table[p // self.bs]][p % self.bs] == _kv(tokens, p), "stale prefix served"
        # ... and every block the prompt still has to write is exclusive (the scheduler writes it directly).
        for i in range(cached // self.bs, len(table)):
            assert self.alloc.ref_counts[table[i]] == 1
        self.tokens[seq] = list(tokens)
        self.computed[seq] = cached
        self.dropped[seq] = 0
        self.remember(tokens)
        return cached

    def step(self, ends: dict[int, int], mark: bool = True) -> None:
        """One engine step: ensure_slots for each sequence up to its end, apply the copy-on-write copies, write
        the K/V, then (like `Engine._forward`) publish what is computed."""
        writes = []
        for seq, end in ends.items():
            start = self.computed[seq]
            assert start < end <= len(self.tokens[seq])
            old_table = list(self.alloc.block_table(seq))
            old_refs = list(self.alloc.ref_counts)
            copies_before = len(self.alloc.pending_copies)
            if self.alloc.blocks_to_write(seq, start, end) > self.alloc.num_free_blocks:
                before = _snapshot(self.alloc)
                with pytest.raises(OutOfBlocksError):
                    self.alloc.ensure_slots(seq, start, end)
                assert _snapshot(self.alloc) == before, "a failed ensure_slots changed the allocator"
                continue
            self.alloc.ensure_slots(seq, start, end)
            table = self.alloc.block_table(seq)
            assert self.alloc.num_slots(seq) >= end
            # Every block this write touches is now exclusive to the sequence.
            for i in range(start // self.bs, (end - 1) // self.bs + 1):
                assert self.alloc.ref_counts[table[i]] == 1, "a write would reach a shared block"
            # The copies queued are exactly the shared blocks in range, as (previously shared block, new block).
            copied = [
                i for i in range(start // self.bs, min((end - 1) // self.bs + 1, len(old_table)))
                if old_refs[old_table[i]] > 1
            ]
            assert self.alloc.pending_copies[copies_before:] == [(old_table[i], table[i]) for i in copied]
            assert all(table[i] == old_table[i] for i in range(len(old_table)) if i not in copied)
            writes.append((seq, start, end))
        copies = self.alloc.take_pending_copies()
        assert self.alloc.take_pending_copies() == []
        gathered = [list(self.content[src]) for src, _ in copies]  # PagedKVCache.copy_blocks: gather, scatter
        for (_, dst), data in zip(copies, gathered):
            self.content[dst] = data
        for seq, start, end in writes:
            table = self.alloc.block_table(seq)
            for p in range(start, end):
                self.content[table[p // self.bs]][p % self.bs] = _kv(self.tokens[seq], p)
            self.computed[seq] = end
            if mark:
                self.alloc.mark_computed(seq, self.tokens[seq], end)

    def compute_all(self, *seqs: int) -> None:
        self.step({s: len(self.tokens[s]) for s in seqs if len(self.tokens[s]) > self.computed[s]})

    def extend(self, seq: int, tokens: list[int]) -> None:
        """Append tokens (sampled, or draft) that still have to be computed."""
        self.tokens[seq] += tokens
        self.remember(self.tokens[seq])

    def fork(self, parent: int, child: int) -> None:
        free_before = self.alloc.num_free_blocks
        self.alloc.fork(parent, child)
        assert self.alloc.num_free_blocks == free_before, "fork must not copy anything"
        assert self.alloc.block_table(child) == self.alloc.block_table(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.dropped[child] = self.dropped[parent]

    def truncate(self, seq: int, n: int, replacement: list[int]) -> None:
        """Roll back to `n` tokens, then append the replacement tokens still to be computed (rejected draft
        tokens and the corrected one, or a beam rewrite)."""
        slots_before = self.alloc.num_slots(seq)
        if n < self.dropped[seq] * self.bs:  # into the blocks released behind the window: refused, nothing changed
            before = _snapshot(self.alloc)
            with pytest.raises(ValueError, match="sliding window"):
                self.alloc.truncate(seq, n)
            assert _snapshot(self.alloc) == before, "a refused truncate changed the allocator"
            return
        self.alloc.truncate(seq, n)
        assert self.alloc.num_slots(seq) == min(slots_before, self.alloc.blocks_needed(n) * self.bs)
        self.tokens[seq] = self.tokens[seq][:n] + replacement
        self.computed[seq] = min(self.computed[seq], n)
        self.remember(self.tokens[seq])

    def drop_behind(self, seq: int, position: int) -> None:
        """Release the blocks wholly before `position` (a sliding window moved past them)."""
        free_before = self.alloc.num_free_blocks
        table_before = list(self.alloc.block_table(seq))
        hashed = len(self.alloc._tables[seq].hashes)
        released = self.alloc.drop_behind(seq, position)
        table = self.alloc.block_table(seq)
        expected = max(self.dropped[seq], min(max(0, position) // self.bs, len(table_before), hashed))
        assert released == expected - self.dropped[seq]
        assert len(table) == len(table_before), "the table keeps its length"
        assert table[:expected] == [self.alloc.dropped_block] * expected
        assert table[expected:] == table_before[expected:]
        newly_free = sum(1 for b in table_before[self.dropped[seq] : expected] if self.alloc.ref_counts[b] == 0)
        assert self.alloc.num_free_blocks == free_before + newly_free
        self.dropped[seq] = expected

    def free(self, seq: int) -> None:
        self.alloc.free(seq)
        assert not self.alloc.has(seq)
        del self.tokens[seq], self.computed[seq], self.dropped[seq]

    # ---- checks ------------------------------------------------------------------------------------------
    def check_no_leaks(self) -> None:
        """Free + owned blocks == all blocks, and each ref count is the number of tables holding the block."""
        alloc = self.alloc
        refs = [0] * alloc.num_blocks
        for seq in self.tokens:
            assert alloc.has(seq)
            table = alloc.block_table(seq)
            assert table[: self.dropped[seq]] == [alloc.dropped_block] * self.dropped[seq]
            for block in table[self.dropped[seq] :]:
                refs[block] += 1
        assert alloc.ref_counts == refs
        assert alloc.num_free_blocks + sum(1 for r in alloc.ref_counts if r > 0) == alloc.num_blocks

    def check_views(self) -> None:
        """A write by one sequence (or its fork, or a later owner of a freed block) is never seen by another."""
        for seq, tokens in self.tokens.items():
            table = self.alloc.block_table(seq)
            assert len(table) * self.bs >= self.computed[seq]
            for p in range(self.dropped[seq] * self.bs, self.computed[seq]):
                assert self.content[table[p // self.bs]][p % self.bs] == _kv(tokens, p), (
                    f"seq {seq} position {p} was overwritten")

    def check_prefix_cache(self) -> None:
        """Whatever a prompt would match in the cache really holds that prompt's K/V. Probed with recent token
        lists, and with the tokens each block's last slot says it holds plus every block-aligned suffix of those
        (a block wrongly published as the start of a chain is matched by the suffix that starts with it)."""
        probes = [*self.history, *self.tokens.values()]
        for slots in self.content.values():
            if slots[-1] is not None:
                held = list(slots[-1])
                probes += [[*held[k:], 0] for k in range(0, len(held), self.bs)]
        for tokens in probes:
            for i, block in enumerate(self.alloc.match_prefix(tokens)):
                for off in range(self.bs):
                    assert self.content[block][off] == _kv(tokens, i * self.bs + off), (
                        "a published block holds stale K/V")

    def check(self) -> None:
        self.check_no_leaks()
        self.check_views()
        self.check_prefix_cache()

    def free_all(self) -> None:
        for seq in list(self.tokens):
            self.free(seq)
        assert self.alloc.num_free_blocks == self.alloc.num_blocks
        assert not any(self.alloc.ref_counts)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / write (ensure_slots, copy-on-write, mark_computed) / fork / truncate / free / release behind
    a sliding window."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.pool = ShadowPool(num_blocks, block_size)

    def _live(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.pool.tokens)))

    @precondition(lambda self: len(self.pool.tokens) < MAX_LIVE)
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        # Mostly reuse (a prefix or extension of) a recent token list, to exercise the prefix cache.
        if self.pool.history and data.draw(st.sampled_from([True, True, False])):
            base = data.draw(st.sampled_from(self.pool.history))
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
            tokens = base[:cut] + data.draw(SHORT)
        else:
            tokens = data.draw(TOKENS)
        self.pool.allocate(self.pool.new_id(), tokens)

    @precondition(lambda self: self.pool.tokens)
    @rule(data=st.data())
    def write_step(self, data: st.DataObject) -> None:
        """Append tokens to some sequences, then compute a batch of them (ensure_slots, copies, writes)."""
        pool = self.pool
        live = sorted(pool.tokens)
        for seq in data.draw(st.lists(st.sampled_from(live), unique=True)):
            pool.extend(seq, data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=5)))
        pending = [s for s in live if len(pool.tokens[s]) > pool.computed[s]]
        if not pending:
            return
        ends = {}
        for seq in data.draw(st.lists(st.sampled_from(pending), min_size=1, unique=True)):
            remaining = len(pool.tokens[seq]) - pool.computed[seq]
            ends[seq] = pool.computed[seq] + data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)))
        # The engine publishes right after every forward; sometimes delay it (equal prompts then get computed
        # twice, in separate blocks).
        pool.step(ends, mark=data.draw(st.sampled_from([True, True, True, False])))

    @precondition(lambda self: 0 < len(self.pool.tokens) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        self.pool.fork(self._live(data), self.pool.new_id())

    @precondition(lambda self: self.pool.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq = self._live(data)
        n = data.draw(st.one_of(st.integers(0, self.pool.computed[seq]), st.integers(0, len(self.pool.tokens[seq]))))
        self.pool.truncate(seq, n, data.draw(SHORT))

    @precondition(lambda self: self.pool.tokens)
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        seq = self._live(data)
        self.pool.alloc.mark_computed(seq, self.pool.tokens[seq], self.pool.computed[seq])

    @precondition(lambda self: self.pool.tokens)
    @rule(data=st.data())
    def drop_behind(self, data: st.DataObject) -> None:
        seq = self._live(data)
        self.pool.drop_behind(seq, self.pool.computed[seq] - data.draw(st.integers(0, 6)))

    @precondition(lambda self: self.pool.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.pool.free(self._live(data))

    @invariant()
    def no_leaks_and_ref_counts_match_tables(self) -> None:
        self.pool.check_no_leaks()

    @invariant()
    def every_sequence_reads_only_what_it_wrote(self) -> None:
        self.pool.check_views()

    @invariant()
    def the_prefix_cache_serves_only_valid_blocks(self) -> None:
        self.pool.check_prefix_cache()

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.pool.free_all()


def test_allocator_state_machine_has_no_leaks_no_shared_writes_and_no_stale_prefixes():
    run_state_machine_as_test(
        AllocatorMachine, settings=settings(max_examples=200, stateful_step_count=40, deadline=None)
    )


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 2), min_size=2, max_size=12), block_size=st.integers(2, 4),
       by_fork=st.booleans(), release=st.sampled_from(["sharer", "diverger", "none"]), data=st.data())
def test_diverging_from_a_shared_published_prefix_never_corrupts_the_sharer_or_the_cache(
    prompt, block_size, by_fork, release, data
):
    """Share a computed prompt (fork, or a second request served from the prefix cache), roll one sharer back
    into the shared region and rewrite it, possibly after the other sharer let go: nobody's K/V and no cached
    prefix changes underneath its readers."""
    pool = ShadowPool(64, block_size)
    first, second = pool.new_id(), pool.new_id()
    pool.allocate(first, prompt)
    pool.compute_all(first)
    if by_fork:
        pool.fork(first, second)
    else:
        pool.allocate(second, prompt + data.draw(SHORT))
        pool.compute_all(second)
    n = data.draw(st.integers(0, len(prompt)))
    pool.truncate(second, n, data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=6)))
    pool.check()
    if release != "none":
        pool.free(first if release == "sharer" else second)
        pool.check()
    for seq in list(pool.tokens):
        pool.compute_all(seq)
    pool.check()
    for tokens in list(pool.history):
        seq = pool.new_id()
        pool.allocate(seq, [*tokens, 0])  # asserts that every block served from the cache holds these tokens
        pool.check()
        pool.free(seq)
    pool.free_all()


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12), block_size=st.integers(1, 4),
       data=st.data())
def test_rolling_back_a_prompt_that_was_computed_twice_keeps_the_prefix_hash_chain(prompt, block_size, data):
    """Two requests with the same prompt admitted in the same step compute it in separate blocks (only one copy is
    published). Rolling one back and rewriting it must publish the new blocks under the right chain: a prompt
    that starts with the rewritten tokens must not be served K/V computed after the old prefix."""
    pool = ShadowPool(64, block_size)
    first, second = pool.new_id(), pool.new_id()
    pool.allocate(first, prompt)
    pool.allocate(second, prompt)
    pool.compute_all(first, second)
    n = data.draw(st.integers(0, len(prompt)))
    pool.truncate(data.draw(st.sampled_from([first, second])), n, data.draw(st.lists(st.integers(0, 2), max_size=8)))
    for seq in list(pool.tokens):
        pool.compute_all(seq)
    pool.check()
    pool.free_all()
    pool.check()


# ---- prefix sharing ------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), min_size=1, max_size=40), block_size=st.integers(1, 8))
def test_same_prompt_after_mark_computed_shares_all_full_blocks_but_the_last_token(tokens, block_size):
    alloc = BlockAllocator(64, block_size)
    assert alloc.allocate(1, tokens) == 0
    alloc.mark_computed(1, tokens, len(tokens))
    shareable = (len(tokens) - 1) // block_size  # the block with the last token is always recomputed
    cached = alloc.allocate(2, tokens)
    assert cached == shareable * block_size < len(tokens)
    assert alloc.block_table(2)[:shareable] == alloc.block_table(1)[:shareable]
    assert set(alloc.block_table(2)[shareable:]).isdisjoint(alloc.block_table(1))
    for block in alloc.block_table(1)[:shareable]:
        assert alloc.ref_counts[block] == 2


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), max_size=40), block_size=st.integers(1, 8))
def test_match_prefix_never_returns_the_block_of_the_last_token(tokens, block_size):
    alloc = BlockAllocator(64, block_size)
    alloc.allocate(1, tokens)
    alloc.mark_computed(1, tokens, len(tokens))
    matched = alloc.match_prefix(tokens)
    assert len(matched) * block_size <= max(0, len(tokens) - 1)
    assert len(matched) == max(0, (len(tokens) - 1) // block_size)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), min_size=2, max_size=40), block_size=st.integers(1, 8),
       data=st.data())
def test_prompt_with_a_different_first_block_shares_nothing(tokens, block_size, data):
    alloc = BlockAllocator(96, block_size)  # room for two unshared 40-token prompts at block size 1
    alloc.allocate(1, tokens)
    alloc.mark_computed(1, tokens, len(tokens))
    other = list(tokens)
    i = data.draw(st.integers(0, min(block_size, len(tokens)) - 1))
    other[i] += 1000
    assert alloc.match_prefix(other) == []
    assert alloc.allocate(2, other) == 0
    assert set(alloc.block_table(2)).isdisjoint(alloc.block_table(1))


def test_prefix_is_only_published_after_mark_computed():
    alloc = BlockAllocator(8, 2)
    prompt = [1, 2, 3, 4, 5]
    alloc.allocate(1, prompt)
    assert alloc.match_prefix(prompt) == []
    alloc.mark_computed(1, prompt, 2)
    assert alloc.match_prefix(prompt) == alloc.block_table(1)[:1]
    alloc.mark_computed(1, prompt, 5)
    assert alloc.match_prefix(prompt) == alloc.block_table(1)[:2]


def test_freed_prompt_stays_cached_until_its_blocks_are_reused():
    alloc = BlockAllocator(4, 2)
    prompt = [1, 2, 3, 4, 5]
    alloc.allocate(1, prompt)
    alloc.mark_computed(1, prompt, 5)
    table = list(alloc.block_table(1))
    alloc.free(1)
    assert alloc.num_free_blocks == 4
    assert alloc.allocate(2, prompt) == 4 and alloc.block_table(2)[:2] == table[:2]
    alloc.free(2)
    alloc.allocate(3, [9] * 8)  # takes every block: the cached prompt is evicted
    alloc.free(3)
    assert alloc.match_prefix(prompt) == []


def test_truncating_into_a_published_block_unpublishes_it():
    alloc = BlockAllocator(8, 4)
    prompt = list(range(10, 19))  # 9 tokens: blocks 0 and 1 are full
    alloc.allocate(1, prompt)
    alloc.mark_computed(1, prompt, 9)
    assert len(alloc.match_prefix(prompt)) == 2
    alloc.truncate(1, 6)  # position 6.. of block 1 will be rewritten
    assert alloc.match_prefix(prompt) == alloc.block_table(1)[:1]
    alloc.allocate(2, prompt)
    assert alloc.block_table(2)[1] != alloc.block_table(1)[1], "a later identical prompt reused stale content"


def test_truncate_while_shared_then_write_after_sibling_frees_unpublishes_the_block():
    # Regression: truncate skipped unpublishing because the block was shared; once the sibling let go, the write
    # went into the still-published block in place, and a later identical prompt was served the new content.
    alloc = BlockAllocator(8, 4)
    prompt = list(range(10, 18))
    alloc.allocate(1, prompt)
    alloc.mark_computed(1, prompt, 8)
    alloc.fork(1, 2)
    alloc.truncate(1, 5)
    alloc.free(2)
    block = alloc.block_table(1)[1]
    alloc.ensure_slots(1, 5, 6)  # exclusive now, so written in place
    assert alloc.take_pending_copies() == []
    assert alloc.block_table(1)[1] == block
    assert block not in alloc.match_prefix([*prompt, 0])


def test_truncate_keeps_the_prefix_hash_chain_of_a_block_published_by_another_sequence():
    # Regression: after a truncate, the chain hash was looked up from the published block; when the same prompt
    # had been computed twice only one copy was published, so the chain restarted at None and the next block was
    # published as if it were a *first* block -- a different prompt starting with those tokens then reused K/V
    # computed after another prefix.
    alloc = BlockAllocator(8, 4)
    prompt = list(range(10, 18))
    alloc.allocate(1, prompt)
    alloc.allocate(2, prompt)  # nothing published yet: computed twice, in separate blocks
    alloc.mark_computed(1, prompt, 8)
    alloc.mark_computed(2, prompt, 8)
    alloc.truncate(2, 5)
    rewritten = [*prompt[:5], 7, 7, 7]
    alloc.ensure_slots(2, 5, 8)
    alloc.mark_computed(2, rewritten, 8)
    assert alloc.match_prefix([*rewritten[4:8], 1]) == []
    assert alloc.match_prefix([*rewritten, 1]) == [alloc.block_table(1)[0], alloc.block_table(2)[1]]


# ---- copy-on-write and fork ------------------------------------------------------------------------------------
def test_fork_shares_blocks_and_first_write_copies_only_the_written_block():
    alloc = BlockAllocator(8, 4)
    alloc.allocate(1, list(range(6)))  # blocks: [full, half]
    parent = list(alloc.block_table(1))
    alloc.fork(1, 2)
    assert alloc.block_table(2) == parent and all(alloc.ref_counts[b] == 2 for b in parent)
    alloc.ensure_slots(2, 6, 7)
    child = alloc.block_table(2)
    assert child[0] == parent[0] and child[1] != parent[1]
    assert alloc.take_pending_copies() == [(parent[1], child[1])]
    assert alloc.take_pending_copies() == []
    assert alloc.ref_counts[parent[1]] == 1 and alloc.ref_counts[child[1]] == 1
    alloc.ensure_slots(1, 6, 7)  # the parent is the only owner now: writes in place
    assert alloc.block_table(1) == parent and alloc.take_pending_copies() == []


def test_freeing_a_sequence_drops_its_unapplied_copies():
    alloc = BlockAllocator(8, 4)
    alloc.allocate(1, list(range(6)))
    alloc.fork(1, 2)
    alloc.ensure_slots(2, 6, 7)
    assert len(alloc.pending_copies) == 1
    alloc.free(2)  # e.g. preempted before the step ran: the copy target is free again
    assert alloc.take_pending_copies() == []


def test_ensure_slots_appends_blocks_when_growing():
    alloc = BlockAllocator(8, 4)
    alloc.allocate(1, [1, 2, 3, 4])
    assert alloc.blocks_to_write(1, 4, 9) == 2
    alloc.ensure_slots(1, 4, 9)
    assert alloc.num_slots(1) == 12 and alloc.num_free_blocks == 5
    table = alloc.block_table(1)
    assert [alloc.slot(1, p) for p in (0, 3, 4, 8)] == [table[0] * 4, table[0] * 4 + 3, table[1] * 4, table[2] * 4]


# ---- running out -------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 6), block_size=st.integers(1, 4),
       prompts=st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=6))
def test_out_of_blocks_on_allocate_leaves_the_allocator_unchanged(num_blocks, block_size, prompts):
    alloc = BlockAllocator(num_blocks, block_size)
    for i, prompt in enumerate(prompts):
        can = alloc.can_allocate(prompt)
        before = _snapshot(alloc)
        try:
            alloc.allocate(i, prompt)
        except OutOfBlocksError:
            assert not can
            assert _snapshot(alloc) == before
        else:
            assert can
            alloc.mark_computed(i, prompt, len(prompt))


def test_out_of_blocks_on_copy_on_write_leaves_the_allocator_unchanged():
    alloc = BlockAllocator(2, 4)
    alloc.allocate(1, [1, 2, 3, 4, 5])  # both blocks
    alloc.fork(1, 2)
    before = _snapshot(alloc)
    assert alloc.blocks_to_write(2, 4, 6) == 1 > alloc.num_free_blocks
    with pytest.raises(OutOfBlocksError):
        alloc.ensure_slots(2, 4, 6)
    assert _snapshot(alloc) == before


def test_allocate_rejects_a_sequence_id_in_use_and_bad_sizes():
    alloc = BlockAllocator(4, 2)
    alloc.allocate(1, [1])
    with pytest.raises(ValueError):
        alloc.allocate(1, [1])
    with pytest.raises(ValueError):
        alloc.fork(1, 1)
    with pytest.raises(ValueError):
        BlockAllocator(0, 2)
    with pytest.raises(ValueError):
        BlockAllocator(2, 0)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), max_size=8), block_size=st.integers(1, 8))
def test_freeing_everything_returns_every_block(lengths, block_size):
    alloc = BlockAllocator(64, block_size)
    ids = []
    for i, n in enumerate(lengths):
        if alloc.can_allocate([i] * n):
            alloc.allocate(i, [i] * n)
            ids.append(i)
    for i in ids[::2]:
        alloc.fork(i, 1000 + i)
        ids.append(1000 + i)
    assume(ids)
    for i in ids:
        alloc.free(i)
    assert alloc.num_free_blocks == 64 and not any(alloc.ref_counts)
