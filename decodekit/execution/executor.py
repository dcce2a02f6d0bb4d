"""Model execution's face to the engine: a model with its own paged KV cache, run the way its plan says.

`ModelExecutor` bundles a `BlockAllocator`, a `PagedKVCache` and the `ModelRunner`, all built from the model's
`ExecutionPlan` (`plan.py`: fused decoder or transformers forward, kernels, weight format, KV dtype); it is the
engine's target model, or a proposer's draft model. The engine's scheduler drives the target's blocks itself; a proposer
drives its own model by sequence (`decodekit.api.proposer.ProposerModel`: `reserve`, `forward`, `truncate`,
`release`), opening it through `ComponentInfo.open_model`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from decodekit.api.errors import ConfigError
from decodekit.api.models import LoadedModel
from decodekit.api.sampling import DrawRule
from decodekit.execution.attention.kv_cache import PagedKVCache
from decodekit.execution.blocks import BlockAllocator
from decodekit.execution.fused.decoder import release_layer_weights
from decodekit.execution.fused.layer_stack import RunDraws, RunInterrupt
from decodekit.execution.fused.relaid_linears import relay_linears
from decodekit.execution.host_memory import retain_freed_memory
from decodekit.execution.items import ForwardItem
from decodekit.execution.parallel.runner import TensorParallelRunner
from decodekit.execution.plan import ExecutionPlan, RelayPlan
from decodekit.execution.runner import ModelRunner

log = logging.getLogger("decodekit.engine")


class ModelExecutor:
    """A model, its KV pool of `num_blocks` blocks, the allocator of those blocks, and its runner, as `plan` says.

    Args:
        loaded: the model.
        plan: how it runs (`plan_execution`).
        num_blocks: KV blocks in the pool.
        release_sources: free the module's layer weights once quantized copies serve them
            (`fused_decoder.release_layer_weights`), where decodekit loaded the model itself; False where another
            part still reads them (a self-draft of the same module).
    """

    def __init__(self, loaded: LoadedModel, plan: ExecutionPlan, num_blocks: int,
                 release_sources: bool = False) -> None:
        geometry, config = plan.geometry, plan.config
        self.plan = plan
        retain_freed_memory()  # a step's large tensors reused, not faulted in anew (the host side of a GPU run too)
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self._cached: dict[int, int] = {}  # a proposer's sequences: tokens whose keys/values are stored
        self._tokens: dict[int, list[int]] = {}  # ... and those tokens, for the prefix cache's block hashes
        self.kv_source: Callable[[int], ModelExecutor | None] | None = None
        """Where a self-draft finds the target's keys and values of a sequence (`adopt_target_kv`): the target (None
        for a sequence it does not hold), set by the engine for a draft that is the target's own model in another
        format with a pool laid out alike; None otherwise."""
        self.runner: ModelRunner | TensorParallelRunner
        if plan.tensor_parallel > 1:
            # split over ranks: rank 0's shard and pool, the workers started (`execution.parallel`); the module is
            # cut in place only where nothing else reads it whole
            self.runner = TensorParallelRunner(loaded, plan, num_blocks, in_place=release_sources and loaded.owned)
            self.kv_cache = self.runner.kv_cache
            return
        self.kv_cache = PagedKVCache(geometry.num_layers, num_blocks, config.block_size, geometry.num_kv_heads,
                                     geometry.head_dim, plan.kv_dtype, loaded.device)
        if plan.relay is not None:
            _relay_unfused_linears(loaded, plan.relay)
        self.runner = ModelRunner(loaded.model, self.kv_cache, plan, loaded.stored)
        fused = self.runner.fused
        if release_sources and loaded.owned and fused is not None and fused.quantization is not None:
            freed = release_layer_weights(loaded.model)
            log.info("%s: the module's layer weights (%.0f MiB) freed; the fused decoder's %s copies serve them",
                     loaded.name, freed / 2**20, fused.quantization)

    def close(self) -> None:
        """Stop what the model runs on besides this process (a split model's worker ranks); nothing otherwise."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def run(self, items: list[ForwardItem], block_copies: list[tuple[int, int]]
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One packed forward of the engine's scheduled items over this pool (after the pending copy-on-write
        `block_copies`): float32 logits of the positions the items ask for, and the last hidden states where an
        item asks for them (None when none does)."""
        return self.runner.forward_with_hidden(items, block_copies)

    @property
    def runs_decode(self) -> bool:
        """Whether `decode_run` can run several greedy steps of one sequence in one native call here."""
        return self.runner.runs_decode

    def decode_run(self, token: int, position: int, block_table: list[int], steps: int, stop_ids: Sequence[int],
                   block_copies: list[tuple[int, int]], draws: RunDraws | None = None,
                   interrupt: RunInterrupt | None = None) -> list[int] | None:
        """Up to `steps` greedy tokens of one sequence whose pending `token` is at `position` (its block table
        holding every position written), ending after one of `stop_ids` (or, natively, once `interrupt` is raised):
        the tokens the one-row forwards would have led the argmax to, with their keys and values written (the last
        token's stays pending); with `draws`, each drawn instead (`RunDraws`). None where this model has no such
        runs."""
        return self.runner.decode_run(token, position, block_table, steps, stop_ids, block_copies, draws, interrupt)

    @property
    def forward_name(self) -> str:
        """How the model runs, for logs: "transformers" (with how many linear layers were re-laid or quantized, if any),
        "fused",
        "fused (prepacked weights)", "fused (int8 weights)", "fused (bf16 weights)" or, with several rows on the CPU's
        bf16 dot products, "fused (bf16 weights, bf16 products)"."""
        fused = self.runner.fused
        if fused is None:
            relaid, quantization = getattr(self.runner.model, "decodekit_relaid_linears", (0, None))
            if quantization is not None:
                return f"transformers ({relaid} linear layers in {quantization})"
            return f"transformers ({relaid} linear layers re-laid)" if relaid else "transformers"
        if fused.quantization is not None:
            return f"fused ({fused.quantization} weights{', bf16 products' if fused.bf16_gemm else ''})"
        return "fused (prepacked weights)" if fused.prepacked else "fused"

    # ---- driven by sequence (decodekit.api.proposer.ProposerModel) -----------------------------------------
    def num_cached(self, key: int) -> int:
        """How many leading tokens of sequence `key` have their keys and values stored."""
        return self._cached.get(key, 0)

    def reserve(self, key: int, num_tokens: int, token_ids: Sequence[int] | None = None) -> bool:
        """Make room for sequence `key` to hold `num_tokens` tokens in all; False (nothing reserved) if the pool
        cannot. For a new `key`, `token_ids` (its tokens so far) let it start from the blocks another sequence
        already computed for the same prefix (the prefix cache): `num_cached` then says how many."""
        if not self.allocator.has(key):
            known = list(token_ids or [])
            extra = max(0, self.allocator.blocks_needed(num_tokens) - self.allocator.blocks_needed(len(known)))
            if not self.allocator.can_allocate(known, extra_blocks=extra):
                return False
            self._cached[key] = self.allocator.allocate(key, known)
            self._tokens[key] = known[: self._cached[key]]
        start = self.num_cached(key)
        if self.allocator.blocks_to_write(key, start, num_tokens) > self.allocator.num_free_blocks:
            return False
        self.allocator.ensure_slots(key, start, num_tokens)
        return True

    @torch.inference_mode()
    def forward(self, batch: Sequence[tuple[int, list[int]]]) -> torch.Tensor:
        """One packed forward: each `(key, tokens)` appends `tokens` after the sequence's cached ones. Returns
        float32 logits `[len(batch), vocab]`, the scores after each sequence's last new token."""
        items = []
        for key, tokens in batch:
            start = self.num_cached(key)
            if not self.allocator.has(key):
                self.allocator.allocate(key, [])
            self.allocator.ensure_slots(key, start, start + len(tokens))
            items.append(ForwardItem(list(tokens), start, self.allocator.block_table(key), 1))
        logits = self.runner.forward(items, self.allocator.take_pending_copies())
        for key, tokens in batch:
            self._stored(key, tokens)
        return logits

    def _stored(self, key: int, tokens: Sequence[int]) -> None:
        """Note that sequence `key`'s keys and values now hold `tokens` after its cached ones, and publish its full
        blocks, so a later sequence with the same prefix starts from them."""
        self._cached[key] = self.num_cached(key) + len(tokens)
        stored = self._tokens.setdefault(key, [])
        stored.extend(tokens)
        self.allocator.mark_computed(key, stored, self._cached[key])

    @torch.inference_mode()
    def greedy_run(self, key: int, token: int, steps: int) -> list[int] | None:
        """`steps` greedy tokens after sequence `key`'s cached tokens and `token`, in one native call (`decode_run`):
        the argmaxes `steps` one-token forwards would lead to, with the keys and values of `token` and of every new
        token but the last stored as those forwards would store them. None (nothing run) where this model has no
        native runs or the slots are not reserved (`reserve`).

        A self-draft at batch 1 drafts this way: each of its one-token forwards otherwise pays the step's Python
        (the forward's glue, processing, selection), ~1.2 ms of an 8.4 ms int8 token on a 2-core Zen 3."""
        return self._run(key, token, steps, None)

    @torch.inference_mode()
    def sample_run(self, key: int, token: int, steps: int, rule: DrawRule, uniforms: Sequence[float]
                   ) -> tuple[list[int], torch.Tensor] | None:
        """`greedy_run`, each token drawn instead from the distribution `rule` makes of the logits `forward` would
        return (`DrawRule`), by the inverse of that distribution's CDF at `uniforms[i]` (in [0, 1)); returns the
        tokens and those distributions (float32 `[steps, vocab]`). None (nothing run) as `greedy_run`, and where
        the model samples no runs natively (a GPU's graphs).

        A sampled self-draft at batch 1 drafts this way: a one-token forward's Python is dearer still there (the
        processing, a sampled selection's noise over the vocabulary, the softmax of its q row)."""
        draws = RunDraws(rule, torch.tensor(list(uniforms), dtype=torch.float64))
        tokens = self._run(key, token, steps, draws)
        if tokens is None or draws.probs is None:
            return None
        return tokens, draws.probs

    def _run(self, key: int, token: int, steps: int, draws: RunDraws | None) -> list[int] | None:
        start = self.num_cached(key)
        if steps < 1 or not self.runs_decode or not self.allocator.has(key) \
                or self.allocator.num_slots(key) < start + steps:
            return None
        self.allocator.ensure_slots(key, start, start + steps)
        tokens = self.runner.decode_run(token, start, self.allocator.block_table(key), steps, (),
                                        self.allocator.take_pending_copies(), draws)
        if tokens is None:
            return None
        self._stored(key, [token, *tokens[:-1]])  # the last new token's keys and values stay unwritten, as in `forward`
        return tokens

    @torch.inference_mode()
    def adopt_target_kv(self, key: int, token_ids: Sequence[int], computed: int) -> int:
        """Copy the target's keys and values of sequence `key`'s tokens from `num_cached(key)` up to `computed` (the
        tokens the target has computed; never the last of `token_ids`, which the draft feeds for its logits) into
        this model's pool instead of computing them, where this model is the target's self-draft (`kv_source`);
        returns `num_cached(key)` after. Reserve the slots first (`reserve`).

        A self-draft (the target's weights in int8, say) otherwise feeds its first forward of a call everything its
        cache lacks: a new request's whole prompt, and every token decoded while drafting was off. On the bundled
        model at batch 8 (float32 target, int8 self-draft, 2-core Intel Xeon) those catch-ups took ~400 ms a call,
        ~10% of a chat run. The copied values are the target's, not what the draft would have computed from its own
        weights: the draft only proposes, so output is unchanged (lossless), and its proposals read the target's
        more exact keys and values of the text so far. Nothing is copied where the target no longer holds a position
        (a sliding window's dropped blocks) or the slots are not reserved."""
        start = self.num_cached(key)
        end = min(computed, len(token_ids) - 1)  # the last token is the draft's to feed: its logits are the draft's
        found = self.kv_source(key) if self.kv_source is not None and end > start else None
        if found is None or not self.allocator.has(key) or self.allocator.num_slots(key) < end:
            return start
        cache, allocator = found.kv_cache, found.allocator
        if not allocator.has(key) or allocator.num_slots(key) < end:
            return start
        source = [allocator.slot(key, p) for p in range(start, end)]
        dropped = allocator.dropped_block * allocator.block_size
        if any(dropped <= slot < dropped + allocator.block_size for slot in source):
            return start
        self.kv_cache.copy_blocks(self.allocator.take_pending_copies())  # a shared block is written only as a copy
        target = [self.allocator.slot(key, p) for p in range(start, end)]
        device = self.kv_cache.slots.device
        rows = cache.slots[:, :, torch.tensor(source, device=cache.slots.device)]
        self.kv_cache.slots[:, :, torch.tensor(target, device=device)] = rows.to(device, self.kv_cache.slots.dtype)
        self._cached[key] = end
        stored = self._tokens.setdefault(key, [])
        stored.extend(token_ids[len(stored):end])
        self.allocator.mark_computed(key, stored, end)
        return end

    def truncate(self, key: int, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of sequence `key` (a rejected draft's are dropped)."""
        if self.num_cached(key) > num_tokens:
            self._cached[key] = num_tokens
            del self._tokens.setdefault(key, [])[num_tokens:]
            self.allocator.truncate(key, num_tokens)

    def release(self, key: int) -> None:
        """Free everything sequence `key` holds."""
        self._cached.pop(key, None)
        self._tokens.pop(key, None)
        if self.allocator.has(key):
            self.allocator.free(key)


def _relay_unfused_linears(loaded: LoadedModel, relay: RelayPlan) -> int:
    """Re-lay the linear layers of a model that runs its own forward, as `relay` says (`relaid_linears`); returns how
    many layers now run this way.

    Raises:
        ConfigError: the same model object already multiplies another weight format for another engine.
    """
    model = loaded.model
    quantization = relay.quantization
    routed: tuple[int, str | None] | None = getattr(model, "decodekit_relaid_linears", None)
    if routed is not None:  # the same model object in a second engine: its layers already run their products
        if routed[1] != quantization:
            raise ConfigError(f"quantization {quantization!r}: this model object's linear layers already multiply "
                              f"{routed[1] or 'float32'} products for another engine; load a fresh copy")
        return routed[0]
    count = relay_linears(model, relay.prepack, relay.kernels, quantization, release=loaded.owned,
                          bf16_gemm=relay.bf16_gemm)
    if relay.widen:
        model.float()
    model.decodekit_relaid_linears = (count, quantization)
    log.info("%s runs its own forward; %d linear layers %s", loaded.name, count,
             f"multiply {quantization} copies" if quantization else "re-laid for the native single-row products")
    return count
