"""Re-exports loaded on first use (PEP 562), for the packages whose `__init__` re-exports many names: importing the
package (for `decodekit --help`, or `decodekit.api.errors` alone) then does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module `__getattr__` and `__dir__`: a name of `exports` (name to module) is imported from its
    module on first use and kept in `namespace` (the package's globals), so later lookups are plain."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
