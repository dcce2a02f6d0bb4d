"""decodekit: a plugin-based decoding-strategy framework for LLMs (paged KV cache, continuous batching, pluggy).

The package is three layers (docs/architecture.md): `decodekit.api` (the plugin contracts, depending on nothing
above), `decodekit.core` (the engine, under the front-ends) and the front-ends (`LLM`/`AsyncLLM`, recipes, the
CLI, the benchmarks). This module re-exports what users and plugin authors import most.

The re-exports are loaded on first use (PEP 562), so `import decodekit.cli` (and `decodekit --help`) does not pay
for torch and transformers; `from decodekit import LLM, SamplingParams` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from decodekit.api.cpu import cap_torch_isa
from decodekit.api.lazy import lazy_exports

# Before anything imports torch: `DECODEKIT_CPU_ISA` caps torch's and oneDNN's kernels too (`api.cpu`).
cap_torch_isa()

if TYPE_CHECKING:
    from decodekit.api.config import EngineConfig
    from decodekit.api.errors import DecodeKitError
    from decodekit.api.hf_adapter import HFProcessorAdapter, hf_logits_processor, hf_processor
    from decodekit.api.hookspecs import hookimpl
    from decodekit.api.params import SamplingParams
    from decodekit.api.processors import BatchView, LogitsProcessor
    from decodekit.api.proposer import Proposer
    from decodekit.api.sampling import select_tokens
    from decodekit.api.sequence import CompletionOutput, RequestMetrics, RequestOutput
    from decodekit.api.stopping import StopDecision, StoppingCriterion
    from decodekit.api.strategy import StepContext, Strategy, StrategyResult
    from decodekit.llm import LLM, AsyncLLM

_EXPORTS = {
    "DecodeKitError": "decodekit.api.errors",
    "HFProcessorAdapter": "decodekit.api.hf_adapter",
    "hf_logits_processor": "decodekit.api.hf_adapter",
    "hf_processor": "decodekit.api.hf_adapter",
    "hookimpl": "decodekit.api.hookspecs",
    "SamplingParams": "decodekit.api.params",
    "BatchView": "decodekit.api.processors",
    "LogitsProcessor": "decodekit.api.processors",
    "Proposer": "decodekit.api.proposer",
    "select_tokens": "decodekit.api.sampling",
    "CompletionOutput": "decodekit.api.sequence",
    "RequestMetrics": "decodekit.api.sequence",
    "RequestOutput": "decodekit.api.sequence",
    "StopDecision": "decodekit.api.stopping",
    "StoppingCriterion": "decodekit.api.stopping",
    "StepContext": "decodekit.api.strategy",
    "Strategy": "decodekit.api.strategy",
    "StrategyResult": "decodekit.api.strategy",
    "EngineConfig": "decodekit.api.config",
    "LLM": "decodekit.llm",
    "AsyncLLM": "decodekit.llm",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "BatchView",
    "CompletionOutput",
    "DecodeKitError",
    "EngineConfig",
    "HFProcessorAdapter",
    "LogitsProcessor",
    "Proposer",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepContext",
    "StopDecision",
    "StoppingCriterion",
    "Strategy",
    "StrategyResult",
    "hf_logits_processor",
    "hf_processor",
    "hookimpl",
    "select_tokens",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
