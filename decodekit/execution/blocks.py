"""The pure-Python KV block allocator: block ids, reference counts, copy-on-write fork and prefix hashes.

It never touches a tensor, so hypothesis can drive it through thousands of operations per second. Each sequence
owns a block table (a list of block ids); slot `i` of a sequence lives in block `table[i // block_size]` at offset
`i % block_size`. Blocks are shared by reference count: `fork` copies a table and increments counts; the first
write into a shared block copies it (copy-on-write) and reports the copy so the KV cache can move the tensors.

Prefix caching: once every token of a block has been computed, the block is hashed by (hash of the previous
block, its tokens) and published; a new sequence whose prompt starts with the same tokens reuses the published
blocks instead of recomputing them. A freed block keeps its hash (its KV is still valid) until it is reused for
something else, so a finished request's prompt stays cached while memory allows.

Sliding windows: where every layer of the model attends only the last `window` keys, the blocks wholly behind a
sequence's window are released while it runs (`drop_behind`, as vLLM does). Their table entries then read
`dropped_block`, an id past the pool's blocks that the KV cache maps to its scratch block: the attention never reads
a key there (the window masks or skips it), and the table keeps its length, so slot arithmetic stays the same.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from decodekit.api.errors import DecodeKitError


def block_hash(previous: int | None, tokens: Sequence[int]) -> int:
    """The prefix key of a block: a 128-bit BLAKE2 digest chained over the previous block's key.

    Python's `hash()` of a tuple of ints is deterministic, so colliding prompts can be crafted to read another
    prompt's KV; a cryptographic digest makes that infeasible.
    """
    prev = b"" if previous is None else previous.to_bytes(16, "little")
    data = prev + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


class OutOfBlocksError(DecodeKitError):
    """Raised when an operation needs more free KV blocks than the pool has; the scheduler preempts instead."""


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    # The prefix (chain) hash of each leading fully-computed block. Kept per table rather than looked up from the
    # published blocks: a block computed twice is published only once, so its hash may belong to another block.
    hashes: list[int] = field(default_factory=list)
    # how many leading blocks were released behind a sliding window (`BlockAllocator.drop_behind`)
    num_dropped: int = 0

    @property
    def num_hashed(self) -> int:
        return len(self.hashes)

    @property
    def last_hash(self) -> int | None:
        return self.hashes[-1] if self.hashes else None


class BlockAllocator:
    """Hands out fixed-size KV blocks to sequences; tracks sharing, copy-on-write and prefix hashes.

    Args:
        num_blocks: total blocks in the pool.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # Free blocks, reused least-recently-freed first, so a freed prefix stays cached as long as possible.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self._tables: dict[int, _Table] = {}
        self.pending_copies: list[tuple[int, int]] = []
        # what a released block behind a sliding window reads in its table (`drop_behind`): the KV cache's scratch
        # block, one past the blocks handed out
        self.dropped_block = num_blocks

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (some may still hold a reusable cached prefix)."""
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        """The block ids of a sequence, in order (a copy-free view; do not mutate)."""
        return self._tables[seq_id].blocks

    def has(self, seq_id: int) -> bool:
        """Whether the sequence currently owns a block table."""
        return seq_id in self._tables

    def num_slots(self, seq_id: int) -> int:
        """Token slots currently reserved for the sequence."""
        return len(self._tables[seq_id].blocks) * self.block_size

    def slot(self, seq_id: int, position: int) -> int:
        """The flat slot index of token `position` of the sequence."""
        table = self._tables[seq_id].blocks
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- allocation ----------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if not self._free:
            raise OutOfBlocksError("no free KV blocks")
        block, _ = self._free.popitem(last=False)
        old_hash = self._block_to_hash.pop(block, None)
        if old_hash is not None and self._hash_to_block.get(old_hash) == block:
            del self._hash_to_block[old_hash]
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if self.pending_copies:
                # A queued copy into a block nobody owns any more is stale; if the block were reused before the
                # copies are applied, it would race (same dst twice in one batched copy) with the new owner's.
                self.pending_copies = [c for c in self.pending_copies if c[1] != block]

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The published blocks that hold a prefix of `token_ids` (at most all but the last token)."""
        return self._match(token_ids)[0]

    def _match(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        blocks: list[int] = []
        hashes: list[int] = []
        prev: int | None = None
        bs = self.block_size
        # Leave at least one token to compute: the engine needs the logits at the last prompt position.
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(prev, token_ids[i * bs : (i + 1) * bs])
            block = self._hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            prev = h
        return blocks, hashes

    def can_allocate(self, token_ids: Sequence[int], extra_blocks: int = 0, reuse_prefix: bool = True) -> bool:
        """Whether `allocate(token_ids)` would succeed while keeping `extra_blocks` blocks free."""
        cached = self.match_prefix(token_ids) if reuse_prefix else []
        reused_free = sum(1 for b in cached if self.ref_counts[b] == 0)
        needed = self.blocks_needed(len(token_ids)) - len(cached)
        return needed + reused_free + extra_blocks <= self.num_free_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int], reuse_prefix: bool = True) -> int:
        """Give a new sequence blocks for `token_ids`, reusing cached prefix blocks (unless `reuse_prefix` is False:
        a request that needs every prompt position's logits computes them all).

        Returns:
            How many leading tokens are already computed (served from the prefix cache).

        Raises:
            OutOfBlocksError: not enough free blocks (nothing is changed).
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not self.can_allocate(token_ids, reuse_prefix=reuse_prefix):
            raise OutOfBlocksError(f"sequence {seq_id} needs more KV blocks than are free")
        cached, hashes = self._match(token_ids) if reuse_prefix else ([], [])
        for block in cached:
            self._acquire(block)
        table = _Table(list(cached), hashes)
        self._tables[seq_id] = table
        for _ in range(self.blocks_needed(len(token_ids)) - len(cached)):
            table.blocks.append(self._take_free_block())
        return len(cached) * self.block_size

    def ensure_slots(self, seq_id: int, start: int, end: int) -> None:
        """Make positions [start, end) writable by the sequence: add blocks, copy shared ones (copy-on-write).

        Copies are queued in `pending_copies` as (src_block, dst_block) for the KV cache to apply before the
        forward pass that writes. Raises OutOfBlocksError (with nothing changed) if the pool cannot supply them.
        """
        table = self._tables[seq_id]
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        if first < table.num_dropped:
            raise ValueError(f"sequence {seq_id} cannot write position {start}: its block was released behind its "
                             "sliding window")
        new_blocks = max(0, last + 1 - len(table.blocks))
        shared = [i for i in range(first, min(last + 1, len(table.blocks))) if self.ref_counts[table.blocks[i]] > 1]
        if new_blocks + len(shared) > len(self._free):
            raise OutOfBlocksError(f"sequence {seq_id} needs {new_blocks + len(shared)} more KV blocks")
        for i in range(first, min(last + 1, len(table.blocks))):
            if self.ref_counts[table.blocks[i]] == 1:
                # Written in place: if it is published (e.g. truncated into while shared, and the sharer has
                # since let go), its cached content is about to change, so it must stop being served.
                self._unpublish(table.blocks[i])
        for i in shared:
            src = table.blocks[i]
            dst = self._take_free_block()
            self._release(src)
            table.blocks[i] = dst
            self.pending_copies.append((src, dst))
        for _ in range(new_blocks):
            table.blocks.append(self._take_free_block())

    def blocks_to_write(self, seq_id: int, start: int, end: int) -> int:
        """How many free blocks `ensure_slots(seq_id, start, end)` would take."""
        table = self._tables[seq_id]
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        if first < table.num_dropped:
            raise ValueError(f"sequence {seq_id} cannot write position {start}: its block was released behind its "
                             "sliding window")
        new_blocks = max(0, last + 1 - len(table.blocks))
        return new_blocks + sum(
            1 for i in range(first, min(last + 1, len(table.blocks))) if self.ref_counts[table.blocks[i]] > 1
        )

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` the parent's blocks, shared (no copy until one of them writes)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        parent = self._tables[parent_id]
        for block in parent.blocks[parent.num_dropped :]:
            self._acquire(block)
        self._tables[child_id] = _Table(list(parent.blocks), list(parent.hashes), parent.num_dropped)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the slots of the first `num_tokens` tokens (rollback); surplus blocks are released."""
        table = self._tables[seq_id]
        keep = self.blocks_needed(num_tokens)
        if num_tokens < table.num_dropped * self.block_size:
            raise ValueError(f"sequence {seq_id} cannot be cut to {num_tokens} tokens: its first "
                             f"{table.num_dropped} blocks were released behind its sliding window")
        for block in table.blocks[keep:]:
            self._release(block)
        del table.blocks[keep:]
        full = num_tokens // self.block_size
        if table.num_hashed > full:
            # A published block that will be rewritten must stop being served as a cached prefix (a shared one
            # keeps its content: the write copies it first, or `ensure_slots` unpublishes it once unshared).
            for block in table.blocks[full : table.num_hashed]:
                if self.ref_counts[block] == 1:
                    self._unpublish(block)
            del table.hashes[full:]

    def _unpublish(self, block: int) -> None:
        h = self._block_to_hash.pop(block, None)
        if h is not None and self._hash_to_block.get(h) == block:
            del self._hash_to_block[h]

    def adopt(self, seq_id: int, donor_id: int) -> None:
        """`seq_id` takes over `donor_id`'s blocks and prefix hashes (a candidate it accepted: the donor forked from
        it and computed one more token); its own are released, and the donor has no table any more."""
        donor = self._tables.pop(donor_id)
        self.free(seq_id)
        self._tables[seq_id] = donor

    def free(self, seq_id: int) -> None:
        """Release all of a sequence's blocks (cached prefixes stay reusable until their block is reused)."""
        table = self._tables.pop(seq_id)
        for block in reversed(table.blocks[table.num_dropped :]):
            self._release(block)

    def drop_behind(self, seq_id: int, position: int) -> int:
        """Release the sequence's blocks that hold only positions before `position` (no later query of a
        sliding-window model reaches them). Their hashes stay with the freed blocks, so the prefix stays cached until
        they are reused. Returns how many blocks were released."""
        table = self._tables[seq_id]
        # never past a block that is not yet hashed: mark_computed reads the blocks behind its own frontier
        last = min(max(0, position) // self.block_size, len(table.blocks), table.num_hashed)
        released = last - table.num_dropped
        for i in range(table.num_dropped, last):
            self._release(table.blocks[i])
            table.blocks[i] = self.dropped_block
        table.num_dropped = max(table.num_dropped, last)
        return max(0, released)

    def mark_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish the prefix hashes of the blocks whose tokens are now all computed."""
        table = self._tables[seq_id]
        bs = self.block_size
        for i in range(table.num_hashed, min(num_computed // bs, len(table.blocks))):
            h = block_hash(table.last_hash, token_ids[i * bs : (i + 1) * bs])
            block = table.blocks[i]
            if h not in self._hash_to_block and block not in self._block_to_hash:
                self._hash_to_block[h] = block
                self._block_to_hash[block] = h
            table.hashes.append(h)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the copy-on-write copies queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies
