"""Strategy benchmarks on the bundled model, side by side in one process (A B A B ..., medians and ratios).

- `spec`: `recipes/speculative.yaml`'s prompts and settings, speculative vs the same recipe without speculation,
  at batch 1 (one request at a time) and batch 8 (the prompts submitted together, cycled to 8).
- `beam`: 16 summarization requests (prompts of about 40 to 220 tokens) with 4 beams, decodekit's in-engine beam
  search vs transformers `generate(num_beams=4)` on the same 16 prompts as one left-padded batch; both return the
  same sequences (checked). decodekit prefills each prompt once and forks the beams (transformers prefills every
  beam's copy), and finished requests leave the batch.

Usage: python benchmarks/strategies.py {spec,beam,all} [--repeats 3] [--threads 1]

The prompts come from `decodekit.bench.workloads` (`speculative_recipe`, `summary_texts`), which `decodekit bench
matrix` uses too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from decodekit import LLM, SamplingParams
from decodekit.bench.workloads import speculative_recipe, summary_texts


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_spec(llm: LLM, repeats: int) -> None:
    recipe = speculative_recipe()
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in recipe["inputs"]["prompts"]]
    sampling = dict(recipe["sampling"])
    spec = SamplingParams(**sampling, strategy=recipe["strategy"])
    plain = SamplingParams(**sampling)
    # prefill every prompt once, untimed, so both strategies find them in the prefix cache (decode is compared)
    llm.generate(prompts, SamplingParams(max_tokens=1), add_special_tokens=False)
    for batch in (1, 8):
        batch_prompts = (prompts * 8)[: max(batch, len(prompts))] if batch > 1 else prompts
        rates: dict[str, list[float]] = {"plain": [], "speculative": []}
        accepted = drafted = 0
        def run(params: SamplingParams, batch: int = batch, batch_prompts: list[str] = batch_prompts) -> list[Any]:
            if batch == 1:
                return [llm.generate([q], params, add_special_tokens=False)[0] for q in batch_prompts]
            return llm.generate(batch_prompts[:batch], params, add_special_tokens=False)

        for _ in range(repeats):
            for name, params in (("plain", plain), ("speculative", spec)):
                elapsed, outs = _timed(lambda p=params: run(p))
                rates[name].append(sum(len(o.token_ids) for o in outs) / elapsed)
                if name == "speculative":
                    accepted += sum(o.metrics.num_accepted_tokens for o in outs)
                    drafted += sum(o.metrics.num_draft_tokens for o in outs)
        p, s = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
        print(f"spec batch {batch}: plain {p:.1f} tok/s, speculative {s:.1f} tok/s, ratio {s / p:.2f}x, "
              f"acceptance {accepted / max(drafted, 1):.0%} ({accepted}/{drafted})", flush=True)


def beam_prompts(llm: LLM, num_requests: int) -> list[str]:
    """Summarization prompts of different lengths (about 40 to 220 tokens), the typical beam-search job."""
    return [llm.apply_chat_template([{"role": "user", "content": text}]) for text in summary_texts(num_requests)]


def bench_beam(llm: LLM, repeats: int, num_requests: int = 16, max_tokens: int = 32) -> None:
    tok = llm.tokenizer
    prompts = beam_prompts(llm, num_requests)
    eos = list(llm.engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, strategy={"beam_search": {"num_beams": 4}})
    model = llm.engine.loaded.model
    tok.padding_side = "left"
    batch = tok(prompts, add_special_tokens=False, return_tensors="pt", padding=True)

    def hf() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False, num_beams=4,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id or eos[0])
        rows = []
        for row in out[:, batch.input_ids.shape[1]:].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            rows.append(row[: ends[0] + 1] if ends else row)
        return rows

    times: dict[str, list[float]] = {"hf": [], "decodekit": []}
    same = True
    for _ in range(repeats):
        t_hf, ref = _timed(hf)
        t_dk, outs = _timed(lambda: llm.generate(prompts, params, add_special_tokens=False))
        times["hf"].append(t_hf)
        times["decodekit"].append(t_dk)
        same &= [o.token_ids for o in outs] == ref
        tokens = sum(len(r) for r in ref)
    h, d = statistics.median(times["hf"]), statistics.median(times["decodekit"])
    lengths = [len(tok(p, add_special_tokens=False).input_ids) for p in prompts]
    shape = f"4 beams, {num_requests} requests, prompts {min(lengths)}-{max(lengths)} tokens, {max_tokens} new"
    print(f"beam ({shape}): HF generate {tokens / h:.1f} tok/s, decodekit {tokens / d:.1f} tok/s, "
          f"ratio {h / d:.2f}x, same sequences: {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["spec", "beam", "all"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m-instruct", dtype="float32")
    if args.which in ("spec", "all"):
        bench_spec(llm, args.repeats)
    if args.which in ("beam", "all"):
        bench_beam(llm, args.repeats)


if __name__ == "__main__":
    main()
