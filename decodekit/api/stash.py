"""Typed per-plugin state on sequences and requests (pytest's `Stash`): a key object carries its value's type.

Example:
    >>> SPEC_K = StashKey[int]()           # at module level, once
    >>> seq.stash[SPEC_K] = 4               # mypy checks the value's type
    >>> k = seq.stash.get(SPEC_K, 4)        # an int

Keys are objects, not strings, so two plugins cannot collide on a name, and the type of each entry is known to
the type checker. A forked sequence gets a shallow copy of its parent's stash.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")
D = TypeVar("D")


class StashKey(Generic[T]):
    """A key for a `Stash`; create one per piece of state, at module level: `MY_KEY = StashKey[MyState]()`."""

    __slots__ = ()


class Stash:
    """A mapping from `StashKey[T]` to values of type `T`."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __getitem__(self, key: StashKey[T]) -> T:
        return cast(T, self._data[key])

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __delitem__(self, key: StashKey[Any]) -> None:
        del self._data[key]

    def __contains__(self, key: StashKey[Any]) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: StashKey[T], default: D) -> T | D:
        """The value under `key`, or `default`."""
        return cast(T, self._data[key]) if key in self._data else default

    def setdefault(self, key: StashKey[T], default: T) -> T:
        """The value under `key`, storing `default` there first if there is none."""
        return cast(T, self._data.setdefault(key, default))

    def pop(self, key: StashKey[T], default: D) -> T | D:
        """Remove and return the value under `key`, or `default`."""
        return cast(T, self._data.pop(key, default))

    def copy(self) -> Stash:
        """A shallow copy (what a forked sequence gets)."""
        out = Stash()
        out._data = dict(self._data)
        return out
