"""The engine: the step loop over its stages, and the requests' entry points (add, abort, step).

One step: propose -> schedule -> forward -> process -> select -> stop -> emit. Each stage lives in its own module
(`decodekit.core.stages`, the scheduler in `decodekit.core.scheduler`) and hands its output to the next; the
engine only wires them up and runs them in order.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any

import pluggy
import torch

from decodekit.api.components import ComponentInfo
from decodekit.api.config import EngineConfig
from decodekit.api.models import LoadedModel
from decodekit.api.params import SamplingParams
from decodekit.api.proposer import ProposerModel
from decodekit.api.sequence import Request, RequestOutput, Sequence
from decodekit.api.step_cost import StepCost, StepTiming
from decodekit.core.decode_runs import RUN_TIME_DECAY, DecodeRunPlan, plan_decode_run
from decodekit.core.hooks import LifecycleHooks
from decodekit.core.logprobs import record_prompt_logprobs
from decodekit.core.plan import Components
from decodekit.core.registry import Registry
from decodekit.core.requests import RequestLifecycle
from decodekit.core.scheduler import Scheduler
from decodekit.core.stages import Failure
from decodekit.core.stages.emit import OutputEmitter
from decodekit.core.stages.forward import ForwardStage
from decodekit.core.stages.process import Processing
from decodekit.core.stages.propose import propose
from decodekit.core.stages.select import select
from decodekit.core.stages.stop import StopStage
from decodekit.core.step_context import CandidateOrigin, EngineStepContext, StepRecord
from decodekit.execution import ExecutionPlan, ModelExecutor, RunDraws, RunInterrupt, cached_step_cost, plan_execution

log = logging.getLogger("decodekit.engine")


class Engine:
    """A continuous-batching engine over one model. Not thread-safe: one thread calls `add_request`/`step`.

    Args:
        loaded: the model and tokenizer (see `decodekit.models.load_model`).
        config: limits and memory.
        registry: processors, stopping criteria, strategies and proposers from the plugins.
        plugin_manager: for lifecycle hooks (each call guarded: `decodekit.core.hooks`).
        draft: a draft model for speculative decoding (same tokenizer as the target).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, registry: Registry,
                 plugin_manager: pluggy.PluginManager, draft: LoadedModel | None = None) -> None:
        # how the model (and its draft) runs, decided once: everything below reads this plan
        self.plan: ExecutionPlan = plan_execution(loaded, config, draft)
        config = self.plan.config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.registry = registry
        self.hooks = LifecycleHooks(plugin_manager, self)
        geometry = self.plan.geometry
        self.max_model_len = self.plan.max_model_len
        # a self-draft (the same module) still reads the module's weights when it is built
        self.model = ModelExecutor(loaded, self.plan, self.plan.kv_pool_blocks(),
                                   release_sources=draft is None or draft.model is not loaded.model)
        self.allocator, self.kv_cache = self.model.allocator, self.model.kv_cache
        window = self.plan.window
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, window=window)
        # One sequence must fit the pool, or it would fail mid-generation with its output lost: the context is
        # capped to what the KV cache holds (vLLM refuses to start instead), unless the blocks behind a sliding window
        # are released as it grows.
        pool_tokens = self.allocator.num_blocks * config.block_size
        self.context_limit: str | None = None
        if self.max_model_len > pool_tokens and (window is None or window + 2 * config.block_size > pool_tokens):
            log.warning("max_model_len %d capped to %d tokens, what the KV cache holds (kv_cache_memory %d bytes); "
                        "raise kv_cache_memory for longer contexts", self.max_model_len, pool_tokens,
                        config.kv_cache_memory)
            self.max_model_len = pool_tokens
            self.context_limit = "what the KV cache holds; raise kv_cache_memory for longer contexts"
        self.eos_token_ids = _eos_token_ids(loaded)
        self.vocab_size = geometry.vocab_size
        self.draft = draft
        self.draft_config = self.plan.draft.config if self.plan.draft is not None else None
        self._step_costs: dict[int, StepCost] = {}  # id(executor) -> its measured step cost (`_step_cost`)
        self.components = Components(registry, ComponentInfo(
            loaded.tokenizer, self.vocab_size, self.eos_token_ids, loaded.device, loaded.name, draft,
            open_model=self._open_model, target=loaded, step_cost=self._step_cost))
        self.processing = Processing(self.eos_token_ids, loaded.device, loaded.tokenizer)
        self.forward = ForwardStage(self.model, self.scheduler,
                                    lambda request, start, rows: record_prompt_logprobs(request, start, rows,
                                                                                        self.tokenizer))
        self.stop = StopStage(self.scheduler, self.eos_token_ids, self.max_model_len)
        self.emitter = OutputEmitter(self.tokenizer, self._on_final)
        self.lifecycle = RequestLifecycle(self.tokenizer, self.components, self.scheduler, self.stop, self.emitter,
                                          self.max_model_len, self.vocab_size, loaded.device, self.context_limit)
        self.requests = self.lifecycle.requests
        self.step_count = 0
        self.decode_run_tokens = 0
        """Tokens that came from native decode runs (`decodekit.core.decode_runs`) so far."""
        self.run_token_seconds: float | None = None
        """What a decode run's token took lately (a running mean), which sizes the next run (`timed_run_steps`)."""
        self.run_interrupt = RunInterrupt()
        """Raised by a front-end on another thread when it has a request or an abort for the engine: the native run
        in progress ends after its current token, so they are taken within a token (`AsyncLLM`)."""
        # per sequence with candidates, the row they were chosen from (`StepContext.score_candidates`)
        self.candidate_origins: weakref.WeakKeyDictionary[Sequence, CandidateOrigin] = weakref.WeakKeyDictionary()
        torch.manual_seed(config.seed)
        log.info("engine: %s, %s, %d KV blocks of %d tokens (%.0f MiB), max_model_len %d, %s forward",
                 loaded.name, str(loaded.dtype).removeprefix("torch."), self.allocator.num_blocks,
                 config.block_size, self.kv_cache.pool.numel() * self.kv_cache.pool.element_size() / 2**20,
                 self.max_model_len, self.model.forward_name)
        self.hooks.engine_started()

    def _open_model(self, loaded: LoadedModel) -> ModelExecutor:
        # A proposer's own model: a KV pool with as many blocks as the engine's, run as its plan says (the draft's
        # own, made with the engine's; another model's under the engine's options).
        plan = self.plan.draft if loaded is self.draft and self.plan.draft is not None else \
            self.plan.for_model(loaded)
        executor = ModelExecutor(loaded, plan, self.allocator.num_blocks,
                                 release_sources=loaded.model is not self.loaded.model)
        # the target's own model in another format (a self-draft) takes the target's keys and values of the tokens
        # the target computed instead of computing them again (`ModelExecutor.adopt_target_kv`)
        target_pool, pool = self.kv_cache.pool.shape, executor.kv_cache.pool.shape
        if loaded.model is self.loaded.model and self.plan.tensor_parallel == 1 and plan.tensor_parallel == 1 \
                and target_pool[:2] == pool[:2] and target_pool[4:] == pool[4:]:
            executor.kv_source = self._target_kv
        return executor

    def _target_kv(self, seq_id: int) -> ModelExecutor | None:
        """The target, where it holds sequence `seq_id` (a self-draft's `kv_source`)."""
        return self.model if self.allocator.has(seq_id) else None

    def step_cost(self) -> StepCost | None:
        """The target model's forward time by rows on this machine (what speculation's cost model reads), measured
        now if this engine has not yet (read from the disk cache when a run on this machine measured it before);
        None while the KV pool has no blocks to spare for measuring. Speculative strategies ask for it at their
        first step; call it first to keep the measurement (a few seconds) out of a timed run."""
        return self._step_cost()

    def _step_cost(self, model: ProposerModel | None = None) -> StepCost | None:
        # measured at the first call (engines that never speculate pay nothing), then kept; the disk cache makes a
        # later engine on this machine read it
        executor = self.model if model is None else model
        if not isinstance(executor, ModelExecutor):
            raise TypeError(f"step_cost measures the target or a model `open_model` gave, got {type(model).__name__}")
        cost = self._step_costs.get(id(executor))
        if cost is None:
            name = self.loaded.name if executor is self.model else f"{self.loaded.name} draft {executor.forward_name}"
            cost = cached_step_cost(executor, name)
            if cost is not None:
                self._step_costs[id(executor)] = cost
        return cost

    def _on_final(self, request: Request, output: RequestOutput) -> None:
        self.hooks.request_finished(request, output)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | Mapping[str, Any], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, add_special_tokens: bool = True,
                    final_only: bool = False) -> Request:
        """Queue a prompt (text, token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`). A bad
        request is finished with an error at the next step. With `final_only`, `step` returns only its final output
        (vLLM's `RequestOutputKind.FINAL_ONLY`): at hundreds of running requests, the per-step deltas nobody reads
        are a tenth of a step's host time.

        Text is tokenized with the tokenizer's special tokens (e.g. BOS) unless `add_special_tokens` is False,
        as for a prompt already rendered by a chat template.
        """
        request = self.lifecycle.add(prompt, params or SamplingParams(), request_id, priority, add_special_tokens)
        request.final_only = final_only
        if not request.finished:
            error = self.hooks.request_added(request)
            if error is not None:
                self.lifecycle.fail(request, error)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its output finishes with reason "abort". Returns False if it is unknown or done."""
        return self.lifecycle.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (or has an output not yet returned by `step`)."""
        return self.scheduler.has_work() or self.emitter.has_pending()

    # ---- the step loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs (deltas and finished requests) it produced."""
        record = StepRecord()
        ctx = EngineStepContext(self.scheduler, self.processing, record, self.stop.finish_sequence,
                                self.lifecycle.set_results, self.eos_token_ids, self.max_model_len, self.vocab_size,
                                self.candidate_origins)  # type: ignore[arg-type]
        run = plan_decode_run(self.scheduler, self.config, self.eos_token_ids, self.max_model_len,
                              token_seconds=self.run_token_seconds) if self.model.runs_decode else None
        if run is not None and self._decode_run(run, ctx):
            return self._finish_step(record)
        self._fail(propose(self.scheduler.running, ctx))
        self._fail(self.processing.take_faults())  # a proposer's processors failed for these
        run = plan_decode_run(self.scheduler, self.config, self.eos_token_ids, self.max_model_len, proposed=True,
                              token_seconds=self.run_token_seconds) if self.model.runs_decode else None
        # nothing drafted: the strategy lets it run natively
        if run is not None and self._decode_run(run, ctx, proposed=True):
            return self._finish_step(record)
        started = time.perf_counter()  # the step's verification: schedule, forward, process (`StepTiming`)
        sched = self.scheduler.schedule()
        self._fail([(request, request.error or "failed") for request in sched.failed])
        scored, failures = self.forward.run(sched)
        self._fail(failures)
        if scored is not None:
            processed = self.processing.run(scored)
            # the processed rows are on the host or synchronized by the process stage's checks: the time is real
            ctx.step_timing = StepTiming(
                sum(s.num_tokens for s in sched.scheduled), time.perf_counter() - started,
                all(s.completes and s.num_tokens <= s.seq.num_scored_positions for s in sched.scheduled))
            self._fail(select(scored, processed, ctx, self.tokenizer))
        return self._finish_step(record)

    def _finish_step(self, record: StepRecord) -> list[RequestOutput]:
        """The stop and emit stages over what the step appended (`record`); its outputs."""
        if record.appended:
            done, failures = self.stop.run(record)
            self._fail(failures)
            for request in done:
                self.lifecycle.complete(request)
        outputs = self.emitter.emit(record)
        self.step_count += 1
        self.hooks.step_finished(outputs)
        return outputs

    def _decode_run(self, run: DecodeRunPlan, ctx: EngineStepContext, proposed: bool = False) -> bool:
        """Make `run` (`decodekit.core.decode_runs`): its tokens appended to its sequence as this step's; False
        where nothing was run (no blocks free for its positions, or the pools are not ones the kernels read: the step
        then runs as usual). A failed run fails its request. A run taken after proposing (`proposed`) tells its
        strategy what it took (`Strategy.ran_natively`)."""
        seq = run.seq
        start = seq.num_computed_tokens
        if self.allocator.blocks_to_write(seq.seq_id, start, start + run.steps) > self.allocator.num_free_blocks:
            return False
        self.allocator.ensure_slots(seq.seq_id, start, start + run.steps)
        started = time.perf_counter()
        try:
            draws = None if run.rule is None else \
                RunDraws(run.rule, torch.rand(run.steps, dtype=torch.float64))  # unseeded: the global generator
            tokens = self.model.decode_run(seq.token_ids[-1], start, self.allocator.block_table(seq.seq_id),
                                           run.steps, run.stop_ids, self.allocator.take_pending_copies(), draws,
                                           self.run_interrupt)
        except Exception as exc:
            log.exception("decode run failed")
            self._fail([(run.request, f"model forward failed: {exc!r}")])
            return True
        if tokens is None:
            return False
        seconds = (time.perf_counter() - started) / max(len(tokens), 1)
        self.run_token_seconds = seconds if self.run_token_seconds is None else \
            RUN_TIME_DECAY * self.run_token_seconds + (1 - RUN_TIME_DECAY) * seconds
        # the pending token's keys and values and every new token's but the last are in the cache now
        self.scheduler.advance(seq, len(tokens))
        for token in tokens:
            ctx.append_token(seq, token)
        self.decode_run_tokens += len(tokens)
        if proposed and run.request.plan is not None:
            run.request.plan.strategy.ran_natively(run.request, len(tokens), time.perf_counter() - started)
        return True

    def close(self) -> None:
        """Stop the worker processes of a model split over ranks (`tensor_parallel_size`); nothing otherwise."""
        self.model.close()

    def _fail(self, failures: list[Failure]) -> None:
        for request, error in failures:
            self.lifecycle.fail(request, error)

    def stats(self) -> dict[str, Any]:
        """Queue depth, running requests, KV usage and preemptions right now."""
        used = self.allocator.num_blocks - self.allocator.num_free_blocks
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "kv_blocks_used": used,
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_usage": used / self.allocator.num_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.step_count,
        }


def _eos_token_ids(loaded: LoadedModel) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(loaded.model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(loaded.tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    return tuple(dict.fromkeys(int(i) for i in ids))
