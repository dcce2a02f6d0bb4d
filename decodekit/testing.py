"""Moved to `decodekit.api.testing` (the conformance kit for plugin authors); this import path stays for code
written against earlier docs."""

from decodekit.api.testing import *  # noqa: F403  (every public name of the kit, as its own __all__ lists them)
from decodekit.api.testing import __all__ as __all__
