"""Plugins that misbehave on purpose, for the fault-isolation tests: a processor with every kind of bad result, a
stateful processor whose state hooks raise, a processor that turns NaN mid-request, a stopping criterion that
raises, a strategy that raises when it proposes or selects, and lifecycle hooks that raise."""

from __future__ import annotations

import torch
from pydantic import BaseModel

from decodekit import StoppingCriterion, hookimpl
from decodekit.api.processors import LogitsProcessor
from decodekit.api.proposer import Proposer
from decodekit_plugins.strategies import SampleStrategy


class Faulty(LogitsProcessor):
    """Misbehaves in the way its `mode` option says, only on rows whose `fault` option is true."""

    name = "faulty"

    class Params(BaseModel):
        mode: str
        fault: bool = True

    def __call__(self, logits, batch):
        faulty = [o.fault for o in batch.options]
        if not any(faulty):
            return logits
        mode = batch.options[faulty.index(True)].mode
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "none":
            return None
        if mode == "shape":
            return logits[:, :10]
        if mode == "int":
            return logits.long()
        if mode == "meta":
            return logits.to("meta")
        out = logits.clone()
        rows = torch.tensor(faulty)
        value = {"nan": float("nan"), "neginf": -float("inf"), "posinf": float("inf")}[mode]
        if mode == "neginf":
            out[rows] = value
        else:
            out[rows, 7] = value
        return out


class Stateful(LogitsProcessor):
    """A stateful processor whose `fails_in` state hook raises."""

    name = "stateful"
    stateful = True

    class Params(BaseModel):
        fails_in: str

    def __call__(self, logits, batch):
        return logits

    def init_state(self, options, prompt_ids):
        if options.fails_in == "init_state":
            raise ValueError("cannot start")
        return (0, options.fails_in)

    def update_state(self, state, options, token_ids):
        count, fails_in = state
        if fails_in == "update_state" and count + len(token_ids) >= 2:
            raise ValueError("cannot advance")
        return (count + len(token_ids), fails_in)

    def fork_state(self, state):
        if state[1] == "fork_state":
            raise ValueError("cannot fork")
        return state


class LateNaN(LogitsProcessor):
    """NaN from the third generated token on."""

    name = "late_nan"

    def __call__(self, logits, batch):
        generated = torch.tensor([len(h) - p for h, p in zip(batch.histories, batch.prompt_lens)])
        return torch.where((generated >= 3)[:, None], float("nan"), logits)


class Explodes(StoppingCriterion):
    """Raises once a sequence has two generated tokens."""

    name = "explodes"

    def check(self, seq, params, eos_token_ids, options=None):
        if seq.num_generated >= 2:
            raise RuntimeError("boom")
        return None


class Flaky(SampleStrategy):
    """Plain sampling that raises in `propose` or `select` for the requests whose `fails_in` option says so."""

    name = "flaky"

    class Params(BaseModel):
        fails_in: str = "nothing"

    def propose(self, ctx, seqs):
        if any(s.request.plan.strategy_options.fails_in == "propose" for s in seqs):
            raise RuntimeError("cannot draft")

    def select(self, ctx, seqs, logits):
        if any(s.request.plan.strategy_options.fails_in == "select" for s in seqs):
            raise RuntimeError("cannot choose")
        super().select(ctx, seqs, logits)


class BoomProposer(Proposer):
    """A speculative proposer that always raises."""

    name = "boom"

    def propose(self, ctx, seqs, ks, options):
        raise RuntimeError("no drafts today")


class OutOfVocabulary(SampleStrategy):
    """Plain sampling, except that it appends a token id past any vocabulary."""

    name = "out_of_vocabulary"

    def select(self, ctx, seqs, logits):
        for seq in seqs:
            ctx.append_token(seq, 10**6)


class FaultyProcessors:
    """Registers the faulty processors and the raising stopping criterion."""

    @hookimpl
    def decodekit_register_processors(self, register):
        register(Faulty.name, Faulty)
        register(Stateful.name, Stateful)
        register(LateNaN.name, LateNaN)

    @hookimpl
    def decodekit_register_stopping_criteria(self, register):
        register(Explodes.name, Explodes)

    @hookimpl
    def decodekit_register_strategies(self, register):
        register(Flaky.name, Flaky)
        register(OutOfVocabulary.name, OutOfVocabulary)

    @hookimpl
    def decodekit_register_proposers(self, register):
        register(BoomProposer.name, BoomProposer)


class FaultyHooks:
    """Lifecycle hooks that raise: when a request with prompt token 13 is added, after every step, and when a
    request finishes."""

    @hookimpl
    def decodekit_request_added(self, engine, request):
        if request.prompt_token_ids[0] == 13:
            raise KeyError("no room for 13")

    @hookimpl
    def decodekit_step_finished(self, engine, outputs):
        raise RuntimeError("metrics backend down")

    @hookimpl
    def decodekit_request_finished(self, engine, request, output):
        raise RuntimeError("cannot log")
