"""Catalogue warpers: typical-p, top-n-sigma, epsilon, eta, XTC, dynamic temperature and mirostat (v1 and v2).

None of them is on by default: a request or recipe names them in its `processors:` list, in the order they
should run. Typical, epsilon and eta follow transformers' warpers (same formulas, `min_keep` for its
`min_tokens_to_keep`); top-n-sigma, XTC, dynamic temperature and mirostat follow llama.cpp's samplers. The math
is vectorized over the rows; per-row parameters come from `batch.options`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from pydantic import Field

from decodekit import hookimpl
from decodekit.api.params import StrictParams
from decodekit.api.processors import NEG_INF, BatchView, LogitsProcessor


def _column(batch: BatchView, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[rows, 1]` tensor of one option across the rows, on the logits' device."""
    return batch.option_tensor(name, dtype or like.dtype).to(like.device)[:, None]


def _protect_top(logits: torch.Tensor, remove: torch.Tensor, batch: BatchView) -> torch.Tensor:
    """Never remove a row's `min_keep` highest logits (transformers' `min_tokens_to_keep`, ties kept)."""
    # the largest k comes from the options on the host: no device sync to size `topk`
    largest = min(max(o.min_keep for o in batch.options), logits.shape[-1])
    k = _column(batch, "min_keep", logits, torch.long).clamp(max=logits.shape[-1])
    kth = logits.topk(largest, dim=-1).values.gather(1, k - 1)
    return remove & (logits < kth)


def _row_uniforms(batch: BatchView, device: torch.device) -> torch.Tensor:
    """`[rows]` uniform draws in [0, 1): a seeded row's is keyed by its generator's seed and the position it scores
    (`_keyed_uniform`), the rest drawn at once from the global RNG.

    Keyed rather than drawn from the row's generator: speculative verification scores draft rows too, and a draw per
    scored row would shift the stream, so a seeded request would get other coins (other tokens, even greedy ones)
    with speculation than without."""
    rows = len(batch)
    shared = torch.rand(rows, device=device) if any(g is None for g in batch.generators) else None
    if shared is not None and all(g is None for g in batch.generators):
        return shared
    parts = [torch.tensor([_keyed_uniform(g.initial_seed(), len(batch.histories[i]))], device=device)
             if g is not None else shared[i : i + 1]  # type: ignore[index]
             for i, g in enumerate(batch.generators)]
    return torch.cat(parts)


_MASK64 = (1 << 64) - 1


def _keyed_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (`seed`, `position`): SplitMix64 of the pair."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) * 2.0**-53


class TypicalPProcessor(LogitsProcessor):
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy, up to `mass`.

    Same formula as transformers' `TypicalLogitsWarper`.

    Example (recipe): `processors: [{typical_p: {mass: 0.9}}]`
    """

    name = "typical_p"
    example: ClassVar[dict[str, Any]] = {"mass": 0.8}

    class Params(StrictParams):
        mass: float = Field(gt=0.0, lt=1.0, description="Probability mass of the most typical tokens to keep.")
        min_keep: int = Field(1, ge=1, description="Always keep at least this many tokens.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        vocab = logits.shape[-1]
        logp = logits.log_softmax(dim=-1)
        entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)
        sorted_scores, order = (-logp - entropy).abs().sort(dim=-1)
        cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < _column(batch, "mass", logits)).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        remove_sorted = sorted_scores > sorted_scores.gather(1, last)
        positions = torch.arange(vocab, device=logits.device)[None, :]
        remove_sorted &= positions >= _column(batch, "min_keep", logits, torch.long)
        return logits.masked_fill(remove_sorted.scatter(1, order, remove_sorted), NEG_INF)


class TopNSigmaProcessor(LogitsProcessor):
    """Keep tokens whose logit is within `n` standard deviations of the row's largest (llama.cpp's top-n-sigma).

    The mean and (population) standard deviation are taken over the finite logits, as llama.cpp does.

    Example (recipe): `processors: [{top_n_sigma: {n: 1.0}}]`
    """

    name = "top_n_sigma"
    example: ClassVar[dict[str, Any]] = {"n": 1.0}
    argmax_invariant = True

    class Params(StrictParams):
        n: float = Field(gt=0.0, description="Keep logits >= max - n * std.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        finite = logits.isfinite()
        count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
        values = logits.masked_fill(~finite, 0.0)
        mean = values.sum(dim=-1, keepdim=True) / count
        std = ((values - mean).square().masked_fill(~finite, 0.0).sum(dim=-1, keepdim=True) / count).sqrt()
        top = logits.amax(dim=-1, keepdim=True)
        return logits.masked_fill(logits < top - _column(batch, "n", logits) * std, NEG_INF)


class EpsilonProcessor(LogitsProcessor):
    """Epsilon sampling: drop tokens with probability below `epsilon` (transformers' `EpsilonLogitsWarper`).

    Example (recipe): `processors: [{epsilon: {epsilon: 0.0003}}]`
    """

    name = "epsilon"
    example: ClassVar[dict[str, Any]] = {"epsilon": 0.01}
    argmax_invariant = True

    class Params(StrictParams):
        epsilon: float = Field(gt=0.0, lt=1.0, description="Drop tokens with probability below this.")
        min_keep: int = Field(1, ge=1, description="Always keep at least this many tokens.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        remove = logits.softmax(dim=-1) < _column(batch, "epsilon", logits)
        return logits.masked_fill(_protect_top(logits, remove, batch), NEG_INF)


class EtaProcessor(LogitsProcessor):
    """Eta sampling: drop tokens below min(epsilon, sqrt(epsilon) * exp(-entropy)) (transformers' `EtaLogitsWarper`).

    Example (recipe): `processors: [{eta: {epsilon: 0.0009}}]`
    """

    name = "eta"
    example: ClassVar[dict[str, Any]] = {"epsilon": 0.2}
    argmax_invariant = True

    class Params(StrictParams):
        epsilon: float = Field(gt=0.0, lt=1.0, description="Upper bound of the entropy-dependent cutoff.")
        min_keep: int = Field(1, ge=1, description="Always keep at least this many tokens.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        logp = logits.log_softmax(dim=-1)
        probs = logp.exp()
        entropy = -(probs * logp).nansum(dim=-1, keepdim=True)
        epsilon = _column(batch, "epsilon", logits)
        eta = torch.minimum(epsilon, epsilon.sqrt() * torch.exp(-entropy))
        return logits.masked_fill(_protect_top(logits, probs < eta, batch), NEG_INF)


class XTCProcessor(LogitsProcessor):
    """Exclude Top Choices (llama.cpp's XTC): with chance `probability`, drop every token whose probability is at
    least `threshold` except the least likely of them.

    Nothing happens when fewer than two tokens reach the threshold, when `threshold > 0.5`, or when fewer than
    `min_keep` candidates would remain. The draw uses the row's seeded generator when the request has a seed.
    Tokens tied at the least likely above-threshold probability are all kept (llama.cpp keeps one of them, chosen
    by its sort order).

    Example (recipe): `processors: [{xtc: {threshold: 0.1, probability: 0.5}}]`
    """

    name = "xtc"
    example: ClassVar[dict[str, Any]] = {"threshold": 0.05, "probability": 0.5}

    class Params(StrictParams):
        threshold: float = Field(0.1, ge=0.0, le=1.0, description="Probability at which a token is a top choice.")
        probability: float = Field(0.5, ge=0.0, le=1.0, description="Chance that the top choices are excluded.")
        min_keep: int = Field(1, ge=1, description="Do nothing unless at least this many candidates remain.")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        chance = _row_uniforms(batch, logits.device)[:, None]
        threshold = _column(batch, "threshold", logits)
        probs = logits.softmax(dim=-1)
        above = (probs >= threshold) & logits.isfinite()
        least = probs.masked_fill(~above, math.inf).amin(dim=-1, keepdim=True)
        remove = above & (probs > least)
        remaining = logits.isfinite().sum(dim=-1, keepdim=True) - remove.sum(dim=-1, keepdim=True)
        apply = ((chance < _column(batch, "probability", logits)) & (threshold <= 0.5)
                 & (remaining >= _column(batch, "min_keep", logits, torch.long)))
        return logits.masked_fill(remove & apply, NEG_INF)


class DynamicTemperatureProcessor(LogitsProcessor):
    """Entropy-scaled temperature (llama.cpp's `temp_ext`): the temperature moves within `temperature ± delta` with
    the normalized entropy of the row, raised to `exponent`.

    With `delta == 0` it is plain temperature; a temperature of 0 keeps only the most likely token(s), and so does
    one small enough to overflow a logit. A row with fewer than two finite logits is left alone when `delta > 0`,
    as in llama.cpp.

    Example (recipe): `processors: [{dynamic_temperature: {temperature: 0.8, delta: 0.5, exponent: 1.0}}]`
    """

    name = "dynamic_temperature"
    example: ClassVar[dict[str, Any]] = {"temperature": 1.0, "delta": 0.5}
    argmax_invariant = True

    class Params(StrictParams):
        temperature: float = Field(1.0, ge=0.0, description="Centre of the temperature range.")
        delta: float = Field(0.0, ge=0.0, description="Half-width of the range (llama.cpp's dynatemp_range).")
        exponent: float = Field(1.0, gt=0.0, description="Exponent on the normalized entropy (dynatemp_exponent).")

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        temperature = _column(batch, "temperature", logits)
        delta = _column(batch, "delta", logits)
        count = logits.isfinite().sum(dim=-1, keepdim=True)
        logp = logits.log_softmax(dim=-1)
        entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)
        normalized = entropy / count.clamp(min=2).to(logits.dtype).log()
        low = (temperature - delta).clamp(min=0.0)
        dynamic = low + (temperature + delta - low) * normalized.pow(_column(batch, "exponent", logits))
        t = torch.where(delta > 0, dynamic, temperature)
        untouched = (delta > 0) & (count <= 1)
        scaled = logits / torch.where(t > 0, t, torch.ones_like(t))
        # a temperature so close to 0 that a logit overflows to +-inf (ties, NaN in softmax) acts as 0: greedy
        overflow = (scaled.isinf() & logits.isfinite()).any(dim=-1, keepdim=True)
        greedy = logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True), NEG_INF)
        return torch.where(untouched, logits, torch.where((t > 0) & ~overflow, scaled, greedy))


class _Mirostat(LogitsProcessor):
    """What mirostat v1 and v2 share: `mu` per sequence, steered so the observed surprise tends to `tau`.

    State per sequence: `mu` (starts at `2 * tau`) and, per scored position, the truncated distribution. When a
    token is accepted, `update_state` moves `mu` by `-eta * (surprise - tau)`, the surprise being the token's under
    the truncated distribution (so later processors, e.g. temperature, do not change it; put `temperature` before
    mirostat in the list for llama.cpp's order). Speculative rows are exact: the row at draft offset `j` uses the
    `mu` that the `j` drafted tokens would produce if accepted. Everything stays on the device (no host sync).
    Subclasses say which tokens a row keeps for its `mu` (`_keep`).
    """

    argmax_invariant = True
    stateful = True

    def init_state(self, options: Any, prompt_ids: list[int]) -> dict[str, Any]:
        """`mu = 2 * tau`; `steps[j]`: the log2 distribution and `mu` at draft offset `j`, kept until accepted."""
        return {"mu": 2.0 * options.tau, "steps": {}}

    def update_state(self, state: dict[str, Any], options: Any, token_ids: list[int]) -> dict[str, Any]:
        """Move `mu` over the accepted tokens, the `i`-th scored at draft offset `i`."""
        for offset, token in enumerate(token_ids):
            step = state["steps"].get(offset)
            if step is None:  # not scored by mirostat (a greedy row skips argmax-invariant stages)
                break
            state["mu"] = _next_mu(step, token, options)
        state["steps"] = {}
        return state

    def fork_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy sharing the (never mutated) tensors."""
        return {"mu": state["mu"], "steps": dict(state["steps"])}

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        offsets = batch.draft_offsets
        out = logits if max(offsets) == 0 else torch.empty_like(logits)
        # offset j needs the mu that offset j-1 of the same sequence produced: handle offsets in increasing order
        for depth in sorted(set(offsets)):
            rows = [r for r, o in enumerate(offsets) if o == depth]
            mu = torch.stack([self._mu(batch, r, logits) for r in rows])[:, None]
            part = logits if len(rows) == len(batch) else logits[torch.tensor(rows, device=logits.device)]
            kept = part.masked_fill(~self._keep(part, mu, [batch.options[r] for r in rows]), NEG_INF)
            log2p = kept.log_softmax(dim=-1) / math.log(2)
            for i, r in enumerate(rows):
                batch.states[r]["steps"][depth] = (log2p, i, mu, i)
            if len(rows) == len(batch):
                return kept
            out[torch.tensor(rows, device=logits.device)] = kept
        return out

    def _keep(self, logits: torch.Tensor, mu: torch.Tensor, options: list[Any]) -> torch.Tensor:
        """`[rows, vocab]` bool: the tokens each row keeps, given its `mu` (`[rows, 1]`)."""
        raise NotImplementedError

    def _mu(self, batch: BatchView, row: int, like: torch.Tensor) -> torch.Tensor:
        state, depth = batch.states[row], batch.draft_offsets[row]
        previous = state["steps"].get(depth - 1) if depth > 0 else None
        if previous is not None:
            return _next_mu(previous, batch.histories[row][-1], batch.options[row])
        return torch.as_tensor(state["mu"], dtype=like.dtype, device=like.device)


class MirostatProcessor(_Mirostat):
    """Mirostat v2 (llama.cpp's `mirostat_v2`): keep tokens whose surprise (-log2 p) is at most the request's `mu`,
    which steers the observed surprise toward `tau` (state, updates and speculative rows: see `_Mirostat`).

    Example (recipe): `processors: [{mirostat: {tau: 5.0, eta: 0.1}}]`
    """

    name = "mirostat"

    class Params(StrictParams):
        tau: float = Field(5.0, gt=0.0, description="Target surprise in bits.")
        eta: float = Field(0.1, gt=0.0, description="Learning rate of mu.")

    def _keep(self, logits: torch.Tensor, mu: torch.Tensor, options: list[Any]) -> torch.Tensor:
        surprise = -logits.log_softmax(dim=-1) / math.log(2)
        return (surprise <= mu) | (logits == logits.amax(dim=-1, keepdim=True))


class MirostatV1Processor(_Mirostat):
    """Mirostat v1 (Basu et al. 2021; llama.cpp's `mirostat`, `--mirostat 1`): keep the `k` most likely tokens,
    `k` from a Zipf fit of the distribution and the request's `mu`, which steers the observed surprise toward `tau`
    (state, updates and speculative rows: see `_Mirostat`).

    Per row, as llama.cpp: the Zipf exponent `s_hat` is the least-squares fit of `log(p_i / p_(i+1))` on
    `log((i + 2) / (i + 1))` over the `m` most likely tokens; with `epsilon = s_hat - 1` and `N` the vocabulary
    size, `k = ((epsilon * 2 ** mu) / (1 - N ** -epsilon)) ** (1 / s_hat)`, truncated to an integer and clamped to
    [1, N]. Where llama.cpp's arithmetic has no answer, the row keeps its most likely token: a NaN `k`
    (`s_hat == 1`, or fewer than two tokens with a probability to fit); an infinite `k` (a flat top) keeps them
    all. Pairs with a removed token (-inf; llama.cpp would divide by a zero probability) are left out of the fit.
    Tokens tied with the `k`-th are all kept (llama.cpp keeps `k` of them, in its sort order). One sort of the row
    per call (the fit needs the top `m`, the cut the `k`-th, and `k` stays on the device).

    Example (recipe): `processors: [{mirostat_v1: {tau: 5.0, eta: 0.1}}]`
    """

    name = "mirostat_v1"

    class Params(StrictParams):
        tau: float = Field(5.0, gt=0.0, description="Target surprise in bits.")
        eta: float = Field(0.1, gt=0.0, description="Learning rate of mu.")
        m: int = Field(100, ge=2, description="Most likely tokens the Zipf exponent is fitted on (llama.cpp: 100).")

    def _keep(self, logits: torch.Tensor, mu: torch.Tensor, options: list[Any]) -> torch.Tensor:
        vocab = logits.shape[-1]
        work = torch.promote_types(logits.dtype, torch.float32)  # the fit in float32 at least, as llama.cpp
        ordered = logits.sort(dim=-1, descending=True).values  # one sort: the top m for the fit, the k-th for k
        widest = min(max(o.m for o in options), vocab)
        logp = ordered[:, :widest].to(work) - logits.to(work).logsumexp(dim=-1, keepdim=True)
        i = torch.arange(widest - 1, device=logits.device, dtype=work)[None, :]
        t = torch.log((i + 2) / (i + 1))
        b = logp[:, :-1] - logp[:, 1:]  # log(p_i / p_(i+1))
        m = torch.tensor([o.m for o in options], device=logits.device)[:, None]
        fitted = (i < m - 1) & logp[:, 1:].isfinite()
        s_hat = (t * b).masked_fill(~fitted, 0.0).sum(dim=-1, keepdim=True) / (t * t * fitted).sum(dim=-1, keepdim=True)
        epsilon = s_hat - 1
        k = ((epsilon * 2 ** mu.to(work)) / (1 - float(vocab) ** -epsilon)) ** (1 / s_hat)
        k = torch.nan_to_num(k.floor(), nan=1.0, posinf=float(vocab)).clamp(1, vocab).long()
        return logits >= ordered.gather(1, k - 1)


def _next_mu(step: tuple[torch.Tensor, int, torch.Tensor, int], token: int, options: Any) -> torch.Tensor:
    log2p, row, mu, mu_row = step
    surprise = -log2p[row, token]
    # a token mirostat had removed (chosen anyway after a later processor) leaves mu where it was
    return torch.where(surprise.isfinite(), mu[mu_row, 0] - options.eta * (surprise - options.tau), mu[mu_row, 0])


@hookimpl
def decodekit_register_processors(register: Callable[..., None]) -> None:
    """Register the catalogue warpers (used only when a request or recipe names them)."""
    for proc in (TypicalPProcessor, TopNSigmaProcessor, EpsilonProcessor, EtaProcessor, XTCProcessor,
                 DynamicTemperatureProcessor, MirostatProcessor, MirostatV1Processor):
        register(proc.name, proc)
