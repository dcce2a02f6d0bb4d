"""What a plugin's tests need, in one import: the conformance kit for processors (`decodekit.api.testing`: hypothesis
strategies and the checks every processor must pass), the kits for the plugins that run inside the engine
(`decodekit.kits`: `check_stopping_criterion`, `check_proposer`, `check_strategy`), and the ready-made parts
(`decodekit.plugin_testing`: a tiny model, tokenizer and `LLM` with your plugin registered, and named processors run
on logits). This import path also keeps working for code written against earlier docs, which found the kit here."""

from decodekit.api.testing import *  # noqa: F403  (every public name of the kit, as its own __all__ lists them)
from decodekit.api.testing import __all__ as _kit_names
from decodekit.kits import *  # noqa: F403
from decodekit.kits import __all__ as _engine_kit_names
from decodekit.plugin_testing import *  # noqa: F403
from decodekit.plugin_testing import __all__ as _parts_names

__all__ = [*_kit_names, *_engine_kit_names, *_parts_names]
