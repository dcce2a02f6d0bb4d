"""Moved to `decodekit.api.constraints`; this import path stays for code written against earlier docs."""

from decodekit.api.constraints import *  # noqa: F403  (every public name, as its own __all__ lists them)
from decodekit.api.constraints import __all__ as __all__
