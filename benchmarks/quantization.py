"""Compressed weights (int8, bf16) against float32 on the bundled model, side by side in one process: speed and
quality.

- speed: decode tokens/s of each `quantization` (`--weights`, default int8 and bf16) and float32 at batch 1 (the
  chat questions one at a time) and batch 32 (32 requests submitted together), interleaved repeats, medians and
  the median of per-repeat ratios;
- greedy agreement: the chat questions answered greedily by each (96 tokens), then the float32 answers fed back to
  the compressed model as prompts (`prompt_logprobs=0`): the share of answer positions where its most likely token
  is float32's (teacher-forced top-1 agreement, which does not compound after a first difference), the share of
  answers identical token for token, and the mean length of the common prefix; for scale, the same teacher-forced
  agreement of transformers' own bfloat16 forward (every activation rounded to bf16) with float32;
- perplexity on held-out text: the Python language reference's prose that ships with CPython (`pydoc_data`), a
  text nobody tuned against, scored with `prompt_logprobs=0` in windows of `--window` tokens.

`--model` measures another model (a folder; e.g. an architecture the fused decoder cannot take, whose own linear
layers then multiply the compressed copies), `--speed-only` skips the quality figures (meaningless on a random
model).

Usage: python benchmarks/quantization.py [--repeats 3] [--threads 0] [--window 512] [--weights int8 bf16]
       [--model smollm2-135m-instruct] [--speed-only]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

from decodekit import LLM, SamplingParams
from decodekit.bench.machine import environment, machine_line
from decodekit.bench.workloads import CHAT_QUESTIONS

HELD_OUT_TOPICS = ("assignment", "for", "try", "with", "class", "function", "lambda", "import")
"""`pydoc_data.topics` entries scored for perplexity (language-reference prose and grammar, ~6k tokens)."""


def held_out_text() -> str:
    """The held-out text: CPython's bundled language-reference topics, joined."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in HELD_OUT_TOPICS)


def perplexity(llm: LLM, ids: list[int], window: int) -> float:
    """exp of the mean negative log-likelihood of `ids`, scored in consecutive windows of `window` tokens (each
    window's first token is conditioned on nothing but itself and is not scored)."""
    total, count = 0.0, 0
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        out = llm.generate([chunk], params)[0]
        for token, position in zip(chunk[1:], (out.prompt_logprobs or [])[1:]):
            assert position is not None
            total -= position[token].logprob
            count += 1
    return math.exp(total / count)


def decode_rates(llms: dict[str, LLM], prompts: list[str], batch: int, repeats: int,
                 max_tokens: int = 64) -> dict[str, list[float]]:
    """Tokens/s per model per repeat, interleaved: batch 1 runs the prompts one at a time, larger batches submit
    `batch` requests (the prompts cycled) together."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    work = (prompts * (batch // len(prompts) + 1))[:batch] if batch > 1 else prompts
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(repeats):
        for name, llm in llms.items():
            start = time.perf_counter()
            if batch == 1:
                outs = [llm.generate([p], params, add_special_tokens=False)[0] for p in work]
            else:
                outs = llm.generate(work, params, add_special_tokens=False)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return rates


def agreement(reference: LLM, other: LLM, prompts: list[str], max_tokens: int = 96) -> dict[str, float]:
    """Greedy agreement of `other` with `reference` on `prompts` (see the module docstring)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ref = reference.generate(prompts, params, add_special_tokens=False)
    got = other.generate(prompts, params, add_special_tokens=False)
    prefixes, identical = [], 0
    for a, b in zip(ref, got):
        common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                      min(len(a.token_ids), len(b.token_ids)))
        prefixes.append(common)
        identical += a.token_ids == b.token_ids
    top1 = positions = 0
    tok = reference.tokenizer
    for prompt, out in zip(prompts, ref):
        prompt_ids = tok(prompt, add_special_tokens=False).input_ids
        forced = other.generate([prompt_ids + out.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        rows = (forced.prompt_logprobs or [])[len(prompt_ids):]
        for token, row in zip(out.token_ids, rows):
            assert row is not None
            top1 += row[token].rank == 1
            positions += 1
    return {"top1": top1 / positions, "identical": identical / len(prompts),
            "prefix": statistics.mean(prefixes), "length": statistics.mean(len(o.token_ids) for o in ref)}


def hf_bf16_top1(reference: LLM, prompts: list[str], max_tokens: int = 96) -> float:
    """Teacher-forced top-1 agreement of transformers' bfloat16 forward of the bundled model with `reference`'s
    greedy answers: how far torch's own bf16 arithmetic moves the argmax."""
    model = reference.engine.loaded.model
    bf16 = type(model)(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict({name: value.to(torch.bfloat16) for name, value in model.state_dict().items()})
    tok = reference.tokenizer
    outs = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), add_special_tokens=False)
    top1 = positions = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            prompt_ids = tok(prompt, add_special_tokens=False).input_ids
            logits = bf16(torch.tensor([prompt_ids + out.token_ids])).logits[0, len(prompt_ids) - 1:-1]
            top1 += int((logits.argmax(-1) == torch.tensor(out.token_ids)).sum())
            positions += len(out.token_ids)
    return top1 / positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--window", type=int, default=512, help="perplexity window in tokens")
    parser.add_argument("--weights", nargs="+", choices=["int8", "bf16"], default=["int8", "bf16"])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the model (bundled name or folder)")
    parser.add_argument("--speed-only", action="store_true", help="skip agreement and perplexity")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llms = {"float32": LLM(args.model, dtype="float32")}
    for weights in args.weights:
        llms[weights] = LLM(args.model, dtype="float32", quantization=weights)
    print(machine_line(environment(), "float32"), flush=True)
    for name, llm in llms.items():
        print(f"{name}: {llm.engine.model.forward_name}", flush=True)
    prompts = [llms["float32"].apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    for batch in (1, 32):
        rates = decode_rates(llms, prompts, batch, args.repeats)
        for weights in args.weights:
            ratios = [q / f for q, f in zip(rates[weights], rates["float32"])]
            print(f"batch {batch:2}: float32 {statistics.median(rates['float32']):6.1f} tok/s, {weights} "
                  f"{statistics.median(rates[weights]):6.1f} tok/s, ratio {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}, {args.repeats} repeats)", flush=True)
    if args.speed_only:
        return
    for weights in args.weights:
        stats = agreement(llms["float32"], llms[weights], prompts)
        print(f"{weights} greedy agreement over {len(prompts)} chat answers ({stats['length']:.0f} tokens on "
              f"average): top-1 {stats['top1']:.1%} of positions (teacher-forced), identical answers "
              f"{stats['identical']:.0%}, common prefix {stats['prefix']:.1f} tokens", flush=True)
    print(f"for scale, transformers' bfloat16 forward: top-1 {hf_bf16_top1(llms['float32'], prompts):.1%} of the "
          "same positions (teacher-forced)", flush=True)
    ids = llms["float32"].tokenizer(held_out_text(), add_special_tokens=False).input_ids
    ppl: dict[str, Any] = {name: perplexity(llm, ids, args.window) for name, llm in llms.items()}
    print(f"perplexity on {len(ids)} held-out tokens (windows of {args.window}): float32 {ppl['float32']:.3f}, "
          + ", ".join(f"{w} {ppl[w]:.3f} ({ppl[w] / ppl['float32'] - 1:+.2%})" for w in args.weights), flush=True)


if __name__ == "__main__":
    main()
