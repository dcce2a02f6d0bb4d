"""The typed stash: keys are objects (two plugins never collide), values keep their types, forks get a copy."""

from __future__ import annotations

from decodekit.api.stash import Stash, StashKey


def test_two_keys_never_collide_and_get_setdefault_pop_behave_like_a_mapping():
    first, second = StashKey[int](), StashKey[int]()
    stash = Stash()
    stash[first] = 1
    assert first in stash and second not in stash and len(stash) == 1
    assert stash.get(second, None) is None and stash.setdefault(second, 7) == 7 and stash[second] == 7
    assert stash.pop(first, 0) == 1 and first not in stash and stash.pop(first, 0) == 0


def test_a_copy_is_independent_at_the_top_level():
    key, nested = StashKey[int](), StashKey[list[int]]()
    parent = Stash()
    parent[key], parent[nested] = 1, [1]
    child = parent.copy()
    child[key] = 2
    del child[nested]
    assert parent[key] == 1 and parent[nested] == [1] and nested not in child
