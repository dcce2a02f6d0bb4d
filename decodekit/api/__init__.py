"""decodekit's public plugin API: every contract a plugin implements or receives, in one place.

This package depends on nothing else of decodekit's (the layering test in `tests/house/test_layering.py` holds it to
that), so a plugin that imports only `decodekit.api` (and the names `decodekit` re-exports) keeps working however
the engine underneath is rearranged.

- `hookspecs`: every hook, the `hookimpl` marker and the step protocol;
- `processors`: `LogitsProcessor`, `BatchView`, `Stage`, `apply_processors`;
- `stopping`: `StoppingCriterion`, `StopDecision`;
- `strategy`: `Strategy`, `StepContext`, `StrategyResult`;
- `proposer`: `Proposer` (speculative decoding's drafters) and `ProposerModel`, the KV cache and forward a
  proposer may open for its own model; `draft_tree`: `DraftTree` and `TreeShape`, the drafts a proposer with
  `supports_tree` returns;
- `constraints`: the structured-output backend interface (`bitmask`: the token masks backends fill);
- `sequence`: `Request`, `Sequence` and the outputs, as plugins see them; `stash`: typed per-plugin state;
- `components`: `ComponentInfo`, what `setup` receives; `models`: the model-loader contract;
- `params`, `errors`, `sampling` (`select_tokens`).

The kits that test plugins against these contracts are `decodekit.testing` (a front-end: its engine kits run a tiny
engine).

The names below are loaded on first use (PEP 562): importing `decodekit.api.errors` alone does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from decodekit.api.lazy import lazy_exports

if TYPE_CHECKING:
    from decodekit.api.components import ComponentInfo
    from decodekit.api.errors import DecodeKitError, PluginError, ProcessorError
    from decodekit.api.hookspecs import hookimpl
    from decodekit.api.models import LoadedModel, ModelLoader, StoredWeight
    from decodekit.api.params import ComponentSpec, SamplingParams
    from decodekit.api.processors import BatchView, LogitsProcessor, Stage, apply_processors
    from decodekit.api.proposer import Proposer
    from decodekit.api.sampling import select_tokens
    from decodekit.api.sequence import CompletionOutput, Request, RequestMetrics, RequestOutput, Sequence
    from decodekit.api.stopping import StopDecision, StoppingCriterion
    from decodekit.api.strategy import StepContext, Strategy, StrategyResult

_EXPORTS = {
    "ComponentInfo": "decodekit.api.components",
    "DecodeKitError": "decodekit.api.errors",
    "PluginError": "decodekit.api.errors",
    "ProcessorError": "decodekit.api.errors",
    "hookimpl": "decodekit.api.hookspecs",
    "LoadedModel": "decodekit.api.models",
    "ModelLoader": "decodekit.api.models",
    "StoredWeight": "decodekit.api.models",
    "ComponentSpec": "decodekit.api.params",
    "SamplingParams": "decodekit.api.params",
    "BatchView": "decodekit.api.processors",
    "LogitsProcessor": "decodekit.api.processors",
    "Stage": "decodekit.api.processors",
    "apply_processors": "decodekit.api.processors",
    "Proposer": "decodekit.api.proposer",
    "select_tokens": "decodekit.api.sampling",
    "CompletionOutput": "decodekit.api.sequence",
    "Request": "decodekit.api.sequence",
    "RequestMetrics": "decodekit.api.sequence",
    "RequestOutput": "decodekit.api.sequence",
    "Sequence": "decodekit.api.sequence",
    "StopDecision": "decodekit.api.stopping",
    "StoppingCriterion": "decodekit.api.stopping",
    "StepContext": "decodekit.api.strategy",
    "Strategy": "decodekit.api.strategy",
    "StrategyResult": "decodekit.api.strategy",
}

__all__ = [
    "BatchView",
    "CompletionOutput",
    "ComponentInfo",
    "ComponentSpec",
    "DecodeKitError",
    "LoadedModel",
    "LogitsProcessor",
    "ModelLoader",
    "PluginError",
    "ProcessorError",
    "Proposer",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Sequence",
    "Stage",
    "StepContext",
    "StopDecision",
    "StoppingCriterion",
    "StoredWeight",
    "Strategy",
    "StrategyResult",
    "apply_processors",
    "hookimpl",
    "select_tokens",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
