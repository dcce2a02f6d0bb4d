"""What a plugin's tests need, in one import, in-process and without downloads:

    >>> from decodekit.testing import check_processor, check_strategy, tiny_llm

The package's parts, one module each:

- the processor kit: `processor_inputs` (hypothesis strategies of a processor's inputs: `logits_tensors`,
  `histories`, `cases`, `batch_views`), `processor_checks` (one check per rule of the processor contract,
  `ALL_CHECKS`) and `processor_kit` (`check_processor`, which runs them on many drawn cases); it needs no engine;
- the engine kits, for the plugins that run inside the engine, each on real sequences in a fresh tiny engine
  (`engine_harness`): `stopping_kit` (`check_stopping_criterion`), `proposer_kit` (`check_proposer`) and
  `strategy_kit` (`check_strategy`), each returning a `KitReport` of what it exercised; and the tool-call format
  kit (`tool_format_kit`: `check_tool_format`), which checks a format's constraint and reading back on a tiny engine;
  the reasoning-format kit (`reasoning_format_kit`: `check_reasoning_format`): markers, split, budget on an engine;
- the ready-made parts (`parts`): `tiny_llm` (an `LLM` on a tiny random model with your plugin registered),
  `plugin_manager`, `apply_processors` (named processors run on logits as the engine runs them), and the tiny model
  and tokenizer (`tiny_model`, `tiny_tokenizer`, `TINY_VOCAB_SIZE`, `TINY_EOS_TOKEN_ID`).

Every kit raises `ConformanceError` (`errors`; an `AssertionError`) naming the rule broken. Import the names below
from `decodekit.testing`, the path the docs teach; the modules are the package's own layout. This package needs
hypothesis (decodekit's `dev` extra).
"""

from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit.testing.engine_harness import KitReport
from decodekit.testing.errors import ConformanceError
from decodekit.testing.parts import TINY_EOS_TOKEN_ID, TINY_VOCAB_SIZE, apply_processors, plugin_manager, tiny_llm
from decodekit.testing.processor_checks import (
    ALL_CHECKS,
    OTHER_DTYPES,
    check_argmax_invariant,
    check_batched_equals_row_by_row,
    check_deterministic,
    check_input_not_mutated,
    check_keeps_a_finite_logit,
    check_masks_kept,
    check_no_nan,
    check_shape_and_dtype,
    check_state_not_changed,
    check_uses_row_generators,
)
from decodekit.testing.processor_inputs import DEFAULT_VOCAB, Case, batch_views, cases, histories, logits_tensors
from decodekit.testing.processor_kit import check_processor
from decodekit.testing.proposer_kit import check_proposer
from decodekit.testing.reasoning_format_kit import check_reasoning_format
from decodekit.testing.stopping_kit import check_stopping_criterion
from decodekit.testing.strategy_kit import check_strategy
from decodekit.testing.tool_format_kit import check_tool_format, constraint_admits

__all__ = [
    "ALL_CHECKS",
    "DEFAULT_VOCAB",
    "OTHER_DTYPES",
    "TINY_EOS_TOKEN_ID",
    "TINY_VOCAB_SIZE",
    "Case",
    "ConformanceError",
    "KitReport",
    "apply_processors",
    "batch_views",
    "cases",
    "check_argmax_invariant",
    "check_batched_equals_row_by_row",
    "check_deterministic",
    "check_input_not_mutated",
    "check_keeps_a_finite_logit",
    "check_masks_kept",
    "check_no_nan",
    "check_processor",
    "check_proposer",
    "check_reasoning_format",
    "check_shape_and_dtype",
    "check_state_not_changed",
    "check_stopping_criterion",
    "check_strategy",
    "check_tool_format",
    "check_uses_row_generators",
    "constraint_admits",
    "histories",
    "logits_tensors",
    "plugin_manager",
    "tiny_llm",
    "tiny_model",
    "tiny_tokenizer",
]
