"""What structured output costs: schema compile, per-step mask fill and apply, the first constrained step, and the
constraint's share of a decode step at batch 1 and 16 (llguidance, the bundled model's tokenizer; medians).

Usage: OMP_NUM_THREADS=1 python benchmarks/structured_cost.py [--repeats 50] [--device cpu] [--dtype float32]
       python benchmarks/structured_cost.py --device cuda --model FOLDER --random-init   # config + tokenizer only

`--random-init` builds the model from the folder's config.json with random weights: step times do not depend on
the weights, and the constraint keeps the random model's output valid all the same.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from decodekit import LLM, SamplingParams
from decodekit.api.components import ComponentInfo
from decodekit.api.constraints import ConstraintSpec, allocate_bitmask, apply_bitmask, get_backend
from decodekit.api.processors import BatchView
from decodekit_plugins.strict_schema import forbid_additional_properties
from decodekit_plugins.structured import JsonSchemaProcessor

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "format": "email"},
    "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                    "pattern": "^[0-9]{5}$"}}},
    "role": {"enum": ["engineer", "designer", "manager"]}}, "required": ["name", "age", "skills"]}
PREFIX = '{"name": "Ada Lovelace", "age": 36, "email": "ada@'


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn` in milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def load(args: argparse.Namespace) -> LLM:
    """The bundled model, a model folder, or a folder's architecture with random weights."""
    if not args.random_init:
        return LLM(args.model, dtype=args.dtype, device=args.device)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    return LLM(model, AutoTokenizer.from_pretrained(args.model), dtype=args.dtype, device=args.device)


class _Timed(JsonSchemaProcessor):
    """The json_schema processor, adding up the time spent in it (mask fills and applies, matcher advances)."""

    spent = 0.0

    def __call__(self, logits: torch.Tensor, batch: BatchView) -> torch.Tensor:
        start = time.perf_counter()
        out = super().__call__(logits, batch)
        _Timed.spent += time.perf_counter() - start
        return out

    def update_state(self, state: Any, options: Any, token_ids: list[int]) -> Any:
        start = time.perf_counter()
        out = super().update_state(state, options, token_ids)
        _Timed.spent += time.perf_counter() - start
        return out


def decode_step_ms(llm: LLM, batch: int, params: SamplingParams, steps: int = 12) -> float:
    """Median engine step time once `batch` requests are all decoding."""
    engine = llm.engine
    prompt = llm.apply_chat_template([{"role": "user", "content": "Give a person record as JSON."}])
    for _ in range(batch):
        engine.add_request(prompt, params, add_special_tokens=False)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for r in engine.scheduler.running
                                          for s in r.sequences):
        engine.step()
    times = []
    _Timed.spent = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    decode_step_ms.constraint_ms = _Timed.spent / steps * 1e3  # type: ignore[attr-defined]
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random-init", action="store_true", help="Random weights from the folder's config.json.")
    parser.add_argument("--rounds", type=int, default=3, help="Alternating plain/constrained decode measurements.")
    args = parser.parse_args()
    llm = load(args)
    tokenizer, vocab, eos = llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids

    start = time.perf_counter()
    backend = get_backend("llguidance", tokenizer, vocab, eos, llm.engine.registry.backend_loaders())
    print(f"tokenizer setup (once per tokenizer per process): {(time.perf_counter() - start) * 1e3:.0f} ms")

    specs = iter([ConstraintSpec.json_schema(forbid_additional_properties({**SCHEMA, "description": f"variant {i}"}))
                  for i in range(args.repeats + 1)])
    compile_ms = median_ms(lambda: backend.compile(next(specs)), args.repeats)
    print(f"compile a typical schema (uncached): {compile_ms:.2f} ms")

    proc = JsonSchemaProcessor()
    start = time.perf_counter()
    proc.setup(ComponentInfo(tokenizer=tokenizer, vocab_size=vocab, eos_token_ids=eos, device=args.device))
    print(f"processor setup + warm-up (per engine): {(time.perf_counter() - start) * 1e3:.1f} ms")
    options = proc.Params.model_validate({"schema": SCHEMA})
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    for batch in (1, 16):
        states = []
        for i in range(batch):
            state = proc.init_state(options, [])
            proc.update_state(state, options, prefix[: len(prefix) * i // batch])  # rows at different positions
            states.append(state)
        view = BatchView([SamplingParams()] * batch, [[0]] * batch, [1] * batch, eos, args.device,
                         options=[options] * batch, states=states)
        logits = torch.randn(batch, vocab, device=args.device)
        if batch == 16:
            fresh = JsonSchemaProcessor()
            fresh.setup(ComponentInfo(tokenizer=tokenizer, vocab_size=vocab, eos_token_ids=eos, device=args.device))
            start = time.perf_counter()
            fresh(logits, view)
            print(f"first constrained call after setup, batch 16: {(time.perf_counter() - start) * 1e3:.2f} ms")
        bitmask = allocate_bitmask(batch, vocab)
        jobs: list[tuple[Any, int, list[int]]] = [(s.matcher, i, []) for i, s in enumerate(states)]
        fill = median_ms(lambda: backend.fill_bitmask(jobs, bitmask), args.repeats)  # noqa: B023
        apply = median_ms(lambda: apply_bitmask(logits, bitmask), args.repeats)  # noqa: B023
        whole = median_ms(lambda: proc(logits, view), args.repeats)  # noqa: B023
        print(f"batch {batch:2d}: fill {fill:.3f} ms, apply {apply:.3f} ms, whole processor call {whole:.3f} ms")

    plain = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    constrained = SamplingParams(**plain.model_dump(exclude={"processors"}),
                                 processors=[{"json_schema": {"schema": SCHEMA}}])
    decode_step_ms(llm, 1, constrained, steps=2)  # builds the engine's json_schema processor
    llm.engine.components.get("processors", "json_schema").__class__ = _Timed
    for batch in (1, 16):
        # alternate the two, so drift in a shared machine's speed hits both alike
        base, with_constraint, inside = [], [], []
        for _ in range(args.rounds):
            base.append(decode_step_ms(llm, batch, plain))
            with_constraint.append(decode_step_ms(llm, batch, constrained))
            inside.append(decode_step_ms.constraint_ms)  # type: ignore[attr-defined]
        b, c, w = statistics.median(base), statistics.median(with_constraint), statistics.median(inside)
        print(f"decode step, batch {batch:2d}: {b:.2f} ms plain, {c:.2f} ms with the schema "
              f"({(c / b - 1) * 100:+.1f}%); time inside the constraint {w:.3f} ms per step "
              f"({w / b * 100:.1f}% of a plain step)")


if __name__ == "__main__":
    main()
