"""decodekit: a plugin-based decoding-strategy framework for LLMs (paged KV cache, continuous batching, pluggy).

The package is three layers (docs/architecture.md): `decodekit.api` (the plugin contracts, depending on nothing
above), `decodekit.core` (the engine, under the front-ends) and the front-ends (`LLM`/`AsyncLLM`, recipes, the
CLI, the benchmarks). This module re-exports what users and plugin authors import most.
"""

from __future__ import annotations

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
from decodekit.core.config import EngineConfig
from decodekit.llm import LLM, AsyncLLM

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
