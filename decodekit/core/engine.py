"""The engine and its step loop: schedule -> forward -> process logits -> select -> stop -> emit."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import pluggy
import torch

from decodekit.config import EngineConfig
from decodekit.core.blocks import BlockAllocator
from decodekit.core.detokenizer import IncrementalDetokenizer
from decodekit.core.kv_cache import PagedKVCache
from decodekit.core.runner import ForwardItem, ModelRunner, build_runner, model_geometry
from decodekit.core.scheduler import Scheduler, SchedulerOutput
from decodekit.core.sequence import CompletionOutput, Request, RequestOutput, Sequence, SequenceStatus
from decodekit.errors import ConfigError, DecodeKitError, RequestError
from decodekit.models import LoadedModel
from decodekit.params import SamplingParams
from decodekit.plan import ComponentInfo, Components
from decodekit.processors import BatchView, apply_processors
from decodekit.registry import Registry
from decodekit.strategy import Strategy, StrategyResult

log = logging.getLogger("decodekit.engine")


class Engine:
    """A continuous-batching engine over one model. Not thread-safe: one thread calls `add_request`/`step`.

    Args:
        loaded: the model and tokenizer (see `decodekit.models.load_model`).
        config: limits and memory.
        registry: processors, stopping criteria and strategies from the plugins.
        plugin_manager: for lifecycle hooks.
        draft: a draft model for speculative decoding (same tokenizer as the target).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, registry: Registry,
                 plugin_manager: pluggy.PluginManager, draft: LoadedModel | None = None) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.registry = registry
        self.hooks = plugin_manager.hook
        geometry = model_geometry(loaded.model)
        self.max_model_len = min(config.max_model_len or geometry.max_model_len, geometry.max_model_len)
        per_block = PagedKVCache.bytes_per_token(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                                                 loaded.dtype) * config.block_size
        num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 2:
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory} bytes holds fewer than 2 blocks of "
                              f"{per_block} bytes; raise it")
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.kv_cache = PagedKVCache(geometry.num_layers, num_blocks, config.block_size, geometry.num_kv_heads,
                                     geometry.head_dim, loaded.dtype, loaded.device)
        self.runner = build_runner(loaded, self.kv_cache, config)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy)
        self.eos_token_ids = _eos_token_ids(loaded)
        self.vocab_size = int(loaded.model.config.get_text_config().vocab_size)
        self.draft = draft
        self.components = Components(registry, ComponentInfo(
            loaded.tokenizer, self.vocab_size, self.eos_token_ids, loaded.device, loaded.name, draft, self))
        self.default_criteria = self.components.default_criteria()
        self.requests: dict[str, Request] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._appended: dict[Sequence, int] = {}  # sequences that got tokens this step -> how many
        self._counter = 0
        self.step_count = 0
        torch.manual_seed(config.seed)
        log.info("engine: %s, %s, %d KV blocks of %d tokens (%.0f MiB), max_model_len %d, %s forward",
                 loaded.name, str(loaded.dtype).removeprefix("torch."), num_blocks, config.block_size,
                 self.kv_cache.pool.numel() * self.kv_cache.pool.element_size() / 2**20, self.max_model_len,
                 _forward_name(self.runner))
        self.hooks.decodekit_engine_started(engine=self)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, add_special_tokens: bool = True) -> Request:
        """Queue a prompt (text or token ids). A bad request is finished with an error at the next step.

        Text is tokenized with the tokenizer's special tokens (e.g. BOS) unless `add_special_tokens` is False,
        as for a prompt already rendered by a chat template.
        """
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(self._counter)
        self._counter += 1
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            ids = list(prompt)
        request = Request(request_id, text, ids, params, priority)
        self.requests[request_id] = request
        error = self._validate(request)
        if error is None:
            try:
                request.plan = self.components.resolve(params)
                request.max_sequences = request.plan.strategy.num_sequences(request.plan.strategy_options, params)
            except DecodeKitError as exc:
                error = str(exc)
            except Exception as exc:  # a plugin failing to set up fails this request, not the caller's batch
                log.exception("planning request %s failed", request_id)
                error = f"could not plan the request: {exc!r}"
        seq = Sequence(request, list(ids), len(ids))
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.loaded.device).manual_seed(params.seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        request.sequences.append(seq)
        if error is not None:
            self._finish_request_with_error(request, error)
            return request
        try:
            seq.processor_states = [stage.processor.init_state(stage.options, ids) if stage.processor.stateful
                                    else None for stage in request.plan.stages]
        except Exception as exc:
            log.exception("request %s: a processor failed to start", request_id)
            self._finish_request_with_error(request, f"a processor failed to start: {exc!r}")
            return request
        self.scheduler.add(request)
        self.hooks.decodekit_request_added(engine=self, request=request)
        return request

    def _validate(self, request: Request) -> str | None:
        n = len(request.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.max_model_len:
            return f"the prompt has {n} tokens but the model's context is {self.max_model_len} tokens"
        vocab = self.loaded.model.config.get_text_config().vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_token_ids):
            return f"the prompt has token ids outside the vocabulary [0, {vocab})"
        return None

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its output finishes with reason "abort". Returns False if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        self.scheduler.remove(request)
        for seq in request.sequences:
            if not seq.finished:
                self._finish_sequence(seq, "abort")
        self._emit_final(request)
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (or has an output not yet returned by `step`)."""
        return self.scheduler.has_work() or bool(self._pending_outputs)

    # ---- the step loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs (deltas and finished requests) it produced."""
        self._propose()
        sched = self.scheduler.schedule()
        for request in sched.failed:
            self._finish_request_with_error(request, request.error or "failed")
        if not sched.empty:
            logits = self._forward(sched)
            if logits is not None:
                self._select(sched, logits)
                self._stop()
        outputs = self._emit()
        self.step_count += 1
        self.hooks.decodekit_step_finished(engine=self, outputs=outputs)
        return outputs

    def _forward(self, sched: SchedulerOutput) -> torch.Tensor | None:
        now = time.perf_counter()
        items = []
        for s in sched.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
            tokens = seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids
            items.append(ForwardItem(tokens[start : start + s.num_tokens], start,
                                     self.allocator.block_table(seq.seq_id),
                                     1 + len(seq.draft_token_ids) if s.completes else 0))
        try:
            logits = self.runner.forward(items, self.allocator.take_pending_copies())
        except Exception as exc:  # a failed forward fails this step's requests, not the engine
            log.exception("forward pass failed")
            for request in {s.seq.request.request_id: s.seq.request for s in sched.scheduled}.values():
                self._finish_request_with_error(request, f"model forward failed: {exc!r}")
            return None
        for s in sched.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            self.allocator.mark_computed(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens, len(seq.token_ids)))
        return logits

    def _propose(self) -> None:
        groups: dict[int, list[Sequence]] = defaultdict(list)
        strategies: dict[int, Strategy] = {}
        for request in self.scheduler.running:
            strategy = request.plan.strategy
            if type(strategy).propose is Strategy.propose:
                continue
            for seq in request.sequences:
                if not seq.finished and seq.num_uncomputed == 1:
                    groups[id(strategy)].append(seq)
                    strategies[id(strategy)] = strategy
        for key, seqs in groups.items():
            try:
                strategies[key].propose(self, seqs)
            except Exception as exc:  # a failing proposer fails its requests, not the engine
                log.exception("%s: propose failed", strategies[key].name)
                for request in {id(s.request): s.request for s in seqs}.values():
                    self._finish_request_with_error(request, f"{strategies[key].name} failed to propose: {exc!r}")

    def _select(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        rows = [s.seq for s in sched.scheduled if s.completes]
        starts, offset = [], 0
        for seq in rows:
            starts.append(offset)
            offset += 1 + len(seq.draft_token_ids)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, seq in enumerate(rows):
            groups[id(seq.request.plan.strategy)].append(i)

        def rows_of(indices: list[int]) -> torch.Tensor:
            if len(indices) == len(rows):
                return logits
            spans = [torch.arange(starts[i], starts[i] + 1 + len(rows[i].draft_token_ids)) for i in indices]
            return logits[torch.cat(spans).to(logits.device)]

        for indices in groups.values():
            seqs = [rows[i] for i in indices]
            strategy = seqs[0].request.plan.strategy
            try:
                strategy.select(self, seqs, rows_of(indices))
            except Exception:
                # Isolate the failing request(s): retry request by request so only the culprits fail.
                by_request: dict[int, list[int]] = defaultdict(list)
                for i in indices:
                    by_request[id(rows[i].request)].append(i)
                for part in by_request.values():
                    request = rows[part[0]].request
                    if request.finished or any(rows[i] in self._appended for i in part):
                        continue
                    try:
                        strategy.select(self, [rows[i] for i in part], rows_of(part))
                    except Exception as exc:
                        log.warning("request %s failed in %s: %r", request.request_id, strategy.name, exc)
                        self._finish_request_with_error(request, f"{strategy.name} failed: {exc!r}")
        for seq in rows:
            seq.draft_token_ids = []

    # StepContext, used by strategies
    def batch_view(self, seqs: list[Sequence]) -> BatchView:
        """The processors' view of these sequences: one row per scored position (drafts expand a sequence)."""
        params, histories, prompt_lens, offsets, generators = [], [], [], [], []
        for seq in seqs:
            for j in range(1 + len(seq.draft_token_ids)):
                params.append(seq.request.params)
                histories.append(seq.token_ids + seq.draft_token_ids[:j] if j else seq.token_ids)
                prompt_lens.append(seq.num_prompt_tokens)
                offsets.append(j)
                generators.append(seq.generator)
        return BatchView(params, histories, prompt_lens, self.eos_token_ids, self.loaded.device,
                         draft_offsets=offsets, generators=generators)

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Apply each request's processors, in order, to the rows of these sequences' scored positions."""
        view = self.batch_view(seqs)
        positions = [seq for seq in seqs for _ in range(1 + len(seq.draft_token_ids))]
        return apply_processors(logits, view, [seq.request.plan.stages for seq in positions],
                                [p.greedy for p in view.params], [seq.processor_states for seq in positions])

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Append a generated token; stopping runs at the end of the step."""
        self._append(seq, [token_id])

    def accept_draft(self, seq: Sequence, num_accepted: int, token_id: int) -> None:
        """Keep `num_accepted` draft tokens then `token_id`; roll the rest of the draft back out of the cache."""
        kept = seq.draft_token_ids[:num_accepted]
        valid = len(seq.token_ids) + num_accepted  # positions whose keys/values are right
        seq.draft_token_ids = []
        seq.num_computed_tokens = valid
        self.allocator.truncate(seq.seq_id, valid)
        seq.request.metrics.num_accepted_tokens += num_accepted
        self._append(seq, [*kept, token_id])

    def _append(self, seq: Sequence, token_ids: list[int]) -> None:
        # States first: if a stateful processor refuses the tokens, the sequence is left as it was.
        states = list(seq.processor_states)
        for i, stage in enumerate(seq.request.plan.stages):
            if stage.processor.stateful:
                states[i] = stage.processor.update_state(states[i], stage.options, token_ids)
        seq.processor_states = states
        seq.token_ids.extend(token_ids)
        self._appended[seq] = self._appended.get(seq, 0) + len(token_ids)

    def fork(self, seq: Sequence) -> Sequence:
        """A new running sequence sharing `seq`'s tokens and KV blocks (copy-on-write)."""
        request = seq.request
        child = Sequence(request, list(seq.token_ids), seq.num_prompt_tokens)
        child.status = seq.status
        child.num_computed_tokens = seq.num_computed_tokens
        child.cumulative_logprob = seq.cumulative_logprob
        child.detokenizer = seq.detokenizer.fork()
        child.text = seq.text
        child.processor_states = [
            stage.processor.fork_state(state) if stage.processor.stateful else None
            for stage, state in zip(request.plan.stages, seq.processor_states)
        ]
        child.state = dict(seq.state)
        if self.allocator.has(seq.seq_id):
            self.allocator.fork(seq.seq_id, child.seq_id)
        request.sequences.append(child)
        return child

    def free(self, seq: Sequence) -> None:
        """Drop a sequence whose request goes on (a pruned beam): its blocks are released, it is not returned."""
        self.scheduler.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED
        seq.request.sequences.remove(seq)
        self._appended.pop(seq, None)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish a sequence with a reason ("stop", "length")."""
        self._finish_sequence(seq, reason, stop_reason)

    def set_results(self, request: Request, results: list[StrategyResult]) -> None:
        """A strategy's final outputs for a request; its remaining sequences are released."""
        request.results = results
        for seq in list(request.sequences):
            if not seq.finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = results[0].finish_reason if results else "stop"
                self.scheduler.free_sequence(seq)
        request.metrics.num_generated_tokens = sum(len(r.token_ids) for r in results)
        self.scheduler.remove(request)
        self._emit_final(request)

    def _stop(self) -> None:
        now = time.perf_counter()
        for seq, count in self._appended.items():
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if seq.finished or request.plan.strategy.handles_stopping:
                continue
            new_tokens = seq.token_ids[len(seq.token_ids) - count :]
            del seq.token_ids[len(seq.token_ids) - count :]
            # Several tokens may arrive at once (speculative decoding): check after each, drop what follows a stop.
            for token in new_tokens:
                seq.token_ids.append(token)
                if self._check_stop(seq):
                    break
        for request in {id(s.request): s.request for s in self._appended}.values():
            request.metrics.num_generated_tokens = (
                sum(len(r.token_ids) for r in request.results) if request.results is not None
                else sum(s.num_generated for s in request.sequences))
            if request.finished and request.error is None and request.request_id in self.requests:
                self.scheduler.remove(request)
                self._emit_final(request)

    def _check_stop(self, seq: Sequence) -> bool:
        request = seq.request
        delta = seq.detokenizer.add(seq.token_ids[-1:])
        seq.new_text_len = len(delta)
        seq.text = seq.detokenizer.text
        decision = None
        for criterion in self.default_criteria:
            if criterion.is_active(request.params):
                decision = criterion.check(seq, request.params, self.eos_token_ids)
                if decision is not None:
                    break
        if decision is None:
            for criterion, options in request.plan.criteria:
                decision = criterion.check(seq, request.params, self.eos_token_ids, options)
                if decision is not None:
                    break
        if decision is not None:
            cut = decision.truncate_text_at
            self._finish_sequence(seq, decision.finish_reason, decision.stop_reason,
                                  None if cut is None else seq.text[:cut])
            return True
        if len(seq.token_ids) >= self.max_model_len:
            self._finish_sequence(seq, "length")
            return True
        return False

    def _finish_sequence(self, seq: Sequence, reason: str, stop_reason: str | int | None = None,
                         text: str | None = None) -> None:
        if text is None:
            seq.detokenizer.flush()
            text = seq.detokenizer.text
        seq.text = text
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.free_sequence(seq)

    def _finish_request_with_error(self, request: Request, error: str) -> None:
        request.error = error
        self.scheduler.remove(request)
        for seq in request.sequences:
            if not seq.finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "error"
                self.scheduler.free_sequence(seq)
        self._emit_final(request)

    # ---- outputs -------------------------------------------------------------------------------------------
    def _holdback(self, seq: Sequence) -> int:
        # Text that may still turn out to be the start of a stop string is not streamed yet.
        stops = seq.request.params.stop
        return 0 if seq.finished or not stops else max(len(s) for s in stops) - 1

    def _output(self, request: Request, final: bool) -> RequestOutput:
        if request.results is not None:
            skip = request.params.skip_special_tokens
            outputs = [
                CompletionOutput(i, self.tokenizer.decode(r.token_ids, skip_special_tokens=skip),
                                 list(r.token_ids), r.finish_reason, r.stop_reason, score=r.score)
                for i, r in enumerate(request.results)
            ]
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, final,
                                 request.metrics, request.error, [o.text for o in outputs],
                                 [o.token_ids for o in outputs])
        outputs, deltas, delta_ids = [], [], []
        for index, seq in enumerate(request.sequences):
            visible = seq.text[: max(0, len(seq.text) - self._holdback(seq))]
            deltas.append(visible[seq.emitted_text_len :])
            delta_ids.append(seq.generated_ids[seq.emitted_token_count :])
            seq.emitted_text_len = max(seq.emitted_text_len, len(visible))
            seq.emitted_token_count = seq.num_generated
            outputs.append(CompletionOutput(index, visible if not seq.finished else seq.text, seq.generated_ids,
                                            seq.finish_reason, seq.stop_reason, seq.cumulative_logprob or None))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, final,
                             request.metrics, request.error, deltas, delta_ids)

    def _emit_final(self, request: Request) -> None:
        request.metrics.finished_time = time.perf_counter()
        if request.plan is not None:
            try:
                request.plan.strategy.on_request_finished(request)
            except Exception:  # cleanup must not take the engine down
                log.exception("%s: on_request_finished failed", request.plan.strategy.name)
        output = self._output(request, final=True)
        self._pending_outputs.append(output)
        self.requests.pop(request.request_id, None)
        self.hooks.decodekit_request_finished(engine=self, request=request, output=output)

    def _emit(self) -> list[RequestOutput]:
        outputs = self._pending_outputs
        done = {o.request_id for o in outputs}
        for request in {id(s.request): s.request for s in self._appended}.values():
            if request.request_id not in done and not request.finished and not request.plan.strategy.handles_stopping:
                outputs.append(self._output(request, final=False))
        self._pending_outputs = []
        self._appended = {}
        return outputs

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


def _forward_name(runner: ModelRunner) -> str:
    """How the engine runs the model, for the start-up log."""
    if runner.fused is None:
        return "transformers"
    return "fused (prepacked weights)" if runner.fused.prepacked else "fused"
