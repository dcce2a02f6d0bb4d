"""A depth-bounded suffix trie over token sequences with occurrence counts: the structure behind the `suffix`
proposer (SuffixDecoding, arXiv 2411.04975).

Every substring of at most `max_depth` tokens of the added sequences is a path from the root; a node counts the
places its substring ends. The longest suffix of a context that occurs earlier with a continuation is found by
walking the context's last tokens from the root (`match`), and the continuation the counts make most likely is read
off greedily from there (`continuation`). Sequences can be added and removed (the counts are decremented and empty
nodes pruned), so a bounded cache of recent outputs evicts by request, and a growing sequence is extended token by
token in O(max_depth) (`TrieCursor`) instead of re-added.

A request's own tokens are one growing sequence, whose trie would take up to `max_depth` new nodes per token (text
rarely repeats beyond a few tokens): `SequenceIndex` finds the same matches and continuations from the positions of
each token instead, at O(1) per appended token and a vectorized search per draft.

Torch-free (the index uses numpy), so its properties are checked with hypothesis against a brute-force search.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np


@dataclass(eq=False, slots=True)  # slots: a trie holds up to max_depth nodes per token
class Node:
    """One substring: how many times it ends in the added sequences, and its one-token extensions."""

    count: int = 0
    children: dict[int, Node] = field(default_factory=dict)


@dataclass
class Match:
    """Where a context's longest continued suffix leads: its length and its node."""

    length: int
    node: Node


class SuffixTrie:
    """The substrings of at most `max_depth` tokens of the sequences added, with occurrence counts.

    Example:
        >>> trie = SuffixTrie(8)
        >>> trie.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
        >>> trie.match([5, 1, 2]).length, trie.continuation(trie.match([5, 1, 2]), 2, 0.0)
        (2, ([3, 1], [0.6666666666666666, 0.6666666666666666]))
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"`max_depth` must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 0  # nodes besides the root: what the trie holds in memory

    def add(self, tokens: Iterable[int]) -> None:
        """Count every substring (of at most `max_depth` tokens) of `tokens`."""
        cursor = TrieCursor(self)
        for token in tokens:
            cursor.append(token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)` (the same tokens, added before): decrement their substrings, prune what reaches 0."""
        # last position first: an occurrence's extensions end after it, so they are taken off before it, and no
        # node ever counts fewer than its children (a node reaching 0 has no children left to lose)
        for end in range(len(tokens), 0, -1):
            window = tokens[max(0, end - self.max_depth) : end]
            for start in range(len(window)):
                self._decrement(window[start:])

    def _decrement(self, path: Sequence[int]) -> None:
        node = self.root
        for token in path[:-1]:
            node = node.children[token]
        last = node.children[path[-1]]
        last.count -= 1
        if last.count == 0:  # its children end where it ends, so they are empty too
            del node.children[path[-1]]
            self.num_nodes -= 1

    def match(self, context: Sequence[int], longest: int | None = None) -> Match | None:
        """The longest suffix of `context` (at most `max_depth - 1` tokens, so one more fits below it, and at most
        `longest`) that occurs in the trie with at least one continuation, or None when not even its last token
        does."""
        longest = min(len(context), self.max_depth - 1, self.max_depth if longest is None else longest)
        for length in range(longest, 0, -1):
            node: Node | None = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token) if node is not None else None
                if node is None:
                    break
            if node is not None and node.children:
                return Match(length, node)
        return None

    @staticmethod
    def continuation(match: Match, limit: int, min_prob: float) -> tuple[list[int], list[float]]:
        """Up to `limit` tokens after `match`, each the most frequent continuation of the path so far, while the
        product of their conditional frequencies stays at least `min_prob`; returns the tokens and those
        cumulative probabilities (each token's estimated chance that the whole draft up to it is right)."""
        tokens: list[int] = []
        probs: list[float] = []
        node, prob = match.node, 1.0
        while len(tokens) < limit and node.children:
            total = sum(child.count for child in node.children.values())
            # ties go to the smaller token id, so a proposal never depends on dict order
            token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
            prob *= child.count / total
            if prob < min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            node = child
        return tokens, probs

    def follow(self, context: Sequence[int], limit: Callable[[int], int],
               min_prob: float) -> tuple[list[int], list[float]]:
        """The draft after `context` (`follow`)."""
        return follow(self, context, limit, min_prob)


class TrieCursor:
    """Appends tokens to one growing sequence of a trie: keeps the nodes of the sequence's last `max_depth - 1`
    suffixes, so each token costs `max_depth` child lookups."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        # the nodes of the suffixes that end at the last token and can still grow: lengths 1, 2, ... max_depth - 1
        self.active: list[Node] = []
        self.length = 0

    def append(self, token: int) -> None:
        """Count the substrings that end at `token`, appended to the sequence."""
        trie = self.trie
        extended: list[Node] = []
        for node in (trie.root, *self.active):  # the suffix of length l before the token gives length l + 1
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
                trie.num_nodes += 1
            child.count += 1
            extended.append(child)
        self.active = extended[: trie.max_depth - 1]
        self.length += 1


SEPARATOR = -1
"""Ends a sequence in a `SequenceIndex` of several (no token id is negative)."""


class _Matched(Protocol):
    """A match's length (`Match`, `IndexMatch`)."""

    length: int


_M = TypeVar("_M", bound=_Matched)


class _Searched(Protocol[_M]):
    """What `follow` searches: a `SuffixTrie` (its matches are `Match`es) or a `SequenceIndex` (`IndexMatch`es)."""

    max_depth: int

    def match(self, context: Sequence[int], longest: int | None = None) -> _M | None: ...

    def continuation(self, match: _M, limit: int, min_prob: float) -> tuple[list[int], list[float]]: ...


def follow(index: _Searched[_M], context: Sequence[int], limit: Callable[[int], int],
           min_prob: float) -> tuple[list[int], list[float]]:
    """The draft after `context` in `index` (a trie or a sequence's index): the most frequent continuation of
    `context`'s longest matched suffix, at most `limit(match length)` tokens (`continuation`); nothing without a
    match. Where the index's depth cut that continuation short (a match of `max_depth - 1` tokens leaves room for
    one), the continuation of the longest shorter suffix with room for the whole limit is taken instead if it scores
    more (the sum of its cumulative frequencies: its expected accepted tokens), as SuffixDecoding scores the drafts
    of each match length: in a long copy every longest match is depth-bound, and the longest alone drafted one token
    a step there (the bundled model's copy prompts: 16 one-token steps in a row)."""
    match = index.match(context)
    if match is None:
        return [], []
    length = match.length
    want = limit(length)
    tokens, probs = index.continuation(match, want, min_prob)
    room = index.max_depth - length  # the longest continuation the depth lets this match have
    shorter = index.max_depth - want  # the longest match with room for `want` tokens
    if len(tokens) < want and len(tokens) == room and 1 <= shorter < length:
        other = index.match(context, longest=shorter)
        assert other is not None  # a suffix of a continued match is continued too
        more, more_probs = index.continuation(other, limit(other.length), min_prob)
        if sum(more_probs) > sum(probs):
            return more, more_probs
    return tokens, probs


@dataclass
class IndexMatch:
    """Where a context's longest continued suffix occurs in a `SequenceIndex`: its length and the positions of its
    last token in each occurrence that a token follows."""

    length: int
    ends: np.ndarray


class SequenceIndex:
    """One growing sequence's substrings of at most `max_depth` tokens, found from the positions of each token: the
    same `match` and `continuation` as a `SuffixTrie` holding that sequence, at O(1) per appended token (a trie
    adds up to `max_depth` nodes per token) and a vectorized search over the last token's occurrences per draft.

    Example:
        >>> index = SequenceIndex(8)
        >>> index.extend([1, 2, 3, 1, 2, 4, 1, 2, 3])
        >>> index.match([5, 1, 2]).length, index.continuation(index.match([5, 1, 2]), 2, 0.0)
        (2, ([3, 1], [0.6666666666666666, 0.6666666666666666]))
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"`max_depth` must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.length = 0
        self.first = 0  # positions before it are forgotten (`RecentOutputs` evicts this way)
        self._tokens = np.zeros(256, dtype=np.int64)  # grown by doubling; the first `length` are the sequence
        self._positions: dict[int, list[int]] = {}  # token -> where it occurs, in order

    def extend(self, tokens: Iterable[int]) -> None:
        """Append `tokens` to the sequence (`SEPARATOR` ends a sequence: nothing matches or continues across it)."""
        for token in tokens:
            if self.length == len(self._tokens):
                self._tokens = np.concatenate([self._tokens, np.zeros_like(self._tokens)])
            self._tokens[self.length] = token
            if token != SEPARATOR:
                self._positions.setdefault(token, []).append(self.length)
            self.length += 1

    def match(self, context: Sequence[int], longest: int | None = None) -> IndexMatch | None:
        """The longest suffix of `context` (at most `max_depth - 1` tokens, and at most `longest`) that occurs in the
        sequence followed by a token, or None when not even its last token does (`SuffixTrie.match`)."""
        if not context or self.max_depth < 2:
            return None
        seen = self._positions.get(context[-1])
        if not seen:
            return None
        ends = np.asarray(seen, dtype=np.int64)
        ends = ends[(ends >= self.first) & (ends < self.length - 1)]
        ends = ends[self._tokens[ends + 1] != SEPARATOR]  # a token follows
        if not ends.size:
            return None
        longest = min(len(context), self.max_depth - 1, self.max_depth if longest is None else longest)
        length = 1
        while length < longest:  # a longer suffix's occurrences are among the shorter one's
            starts = ends - length
            ends_in = ends[starts >= 0]
            kept = ends_in[self._tokens[ends_in - length] == context[-1 - length]]
            if not kept.size:
                break
            ends, length = kept, length + 1
        return IndexMatch(length, ends)

    def continuation(self, match: IndexMatch, limit: int, min_prob: float) -> tuple[list[int], list[float]]:
        """Up to `limit` tokens after `match`, each the most frequent next token of the path so far (ties to the
        smaller id), while the product of their frequencies stays at least `min_prob` (`SuffixTrie.continuation`):
        the tokens and those cumulative probabilities."""
        tokens: list[int] = []
        probs: list[float] = []
        ends, depth, prob = match.ends, match.length, 1.0
        while len(tokens) < limit and depth < self.max_depth:  # a trie holds no path longer than max_depth
            following = ends + 1
            following = following[following < self.length]
            following = following[self._tokens[following] != SEPARATOR]
            if not following.size:
                break
            nexts = self._tokens[following]
            values, counts = np.unique(nexts, return_counts=True)  # sorted: the first of the most is the smallest
            best = int(np.argmax(counts))
            prob *= int(counts[best]) / following.size
            if prob < min_prob:
                break
            token = int(values[best])
            tokens.append(token)
            probs.append(prob)
            ends, depth = following[nexts == token], depth + 1
        return tokens, probs

    def follow(self, context: Sequence[int], limit: Callable[[int], int],
               min_prob: float) -> tuple[list[int], list[float]]:
        """The draft after `context` (`follow`)."""
        return follow(self, context, limit, min_prob)


class RecentOutputs(SequenceIndex):
    """Recent outputs, oldest evicted first: their tokens in one `SequenceIndex`, each output ended by `SEPARATOR`,
    so no match or continuation crosses from one to the next. The same matches and continuations as a `SuffixTrie`
    to which each output was added (and from which each evicted one was removed), without its up to `max_depth`
    new nodes per token: those allocations made Python's garbage collector sweep the whole process during a
    request's release (once 238 ms of a 2-second batch-8 run).

    Example:
        >>> recent = RecentOutputs(8)
        >>> recent.add([1, 2, 3]); recent.add([1, 2, 4]); recent.add([1, 2, 4])
        >>> recent.continuation(recent.match([1, 2]), 1, 0.0)
        ([4], [0.6666666666666666])
        >>> recent.remove_oldest(), recent.continuation(recent.match([1, 2]), 1, 0.0)
        (3, ([4], [1.0]))
    """

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self._spans: deque[tuple[int, int]] = deque()  # (start, tokens) of each output kept, oldest first

    def add(self, tokens: Sequence[int]) -> None:
        """Keep one more output."""
        self._spans.append((self.length, len(tokens)))
        self.extend([*tokens, SEPARATOR])

    def remove_oldest(self) -> int:
        """Forget the oldest output kept; returns its length (0 when none is kept)."""
        if not self._spans:
            return 0
        _, count = self._spans.popleft()
        self.first = self._spans[0][0] if self._spans else self.length
        if self.first > 4096 and 2 * self.first > self.length:  # the forgotten half goes: amortized O(1) a token
            self._compact()
        return count

    def _compact(self) -> None:
        """Rebuild from the outputs still kept (positions shift by `first`)."""
        kept, shift = self._tokens[self.first : self.length].tolist(), self.first
        spans = deque((start - shift, count) for start, count in self._spans)
        SequenceIndex.__init__(self, self.max_depth)
        self.extend(kept)
        self._spans = spans
