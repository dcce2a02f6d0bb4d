"""decodekit: a plugin-based decoding-strategy framework for LLMs (paged KV cache, continuous batching, pluggy)."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("decodekit")
"""Marker for plugin hook implementations: ``@decodekit.hookimpl``."""

# ruff: noqa: E402  (hookimpl must exist before the plugins that import it)
from decodekit.config import EngineConfig
from decodekit.core.sampler import select_tokens
from decodekit.core.sequence import CompletionOutput, RequestMetrics, RequestOutput
from decodekit.errors import DecodeKitError
from decodekit.llm import LLM, AsyncLLM
from decodekit.params import SamplingParams
from decodekit.processors import BatchView, LogitsProcessor
from decodekit.stopping import StopDecision, StoppingCriterion
from decodekit.strategy import Strategy

__all__ = [
    "LLM",
    "AsyncLLM",
    "BatchView",
    "CompletionOutput",
    "DecodeKitError",
    "EngineConfig",
    "LogitsProcessor",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StopDecision",
    "StoppingCriterion",
    "Strategy",
    "hookimpl",
    "select_tokens",
]
