"""Strategy benchmarks on the bundled model, side by side in one process (A B A B ..., medians and ratios).

- `spec`: speculative decoding against plain decoding, greedy, on two prompt sets: `copy` (recipes/speculative.yaml's
  rewrite/repeat prompts, 128 tokens) and `chat` (free-form questions, 96 tokens), at batch 1 (one request at a time),
  8 and 32 (the prompts submitted together, cycled). Configurations with k fixed (`adaptive: off`, or transformers'
  heuristic): n-gram (k 4, heuristic), an int8 copy of the target as draft (k 6), n-gram on two-token matches
  chained to the int8 draft (k 6, drafting nothing while 4 or more sequences run), the trained draft head shipped
  for the bundled model (`eagle`, k 2) and n-gram chained to it (k 3, paused likewise), suffix decoding (k 4), and
  the chain n-gram -> suffix -> int8 draft (k 4, paused likewise), the int8 draft drafting a tree (k 6, width 2,
  up to 16 nodes, branching where its probability is below 0.8: `docs/speculative.md`, "Draft trees"); and with k
  adapted by cost (the strategy's default: each step's k from the acceptance and this machine's step cost by rows,
  calibrated by the steps it times, and the proposers' host time, 0 where it cannot pay): suffix, the int8 draft, the
  chain, and the int8 draft's tree (cut to the rows that are nearly free). recipes/speculative.yaml uses n-gram
  chained to the int8 draft. `--dtype auto` runs the target as the bundled GGUF stores it. Each row gives the median of
  per-repeat ratios to plain with their range, each proposer's acceptance (accepted of drafted, and its acceptance
  length: tokens per verification, 1 + accepted / verifications), and whether the output equalled plain's token for
  token.
- `beam`: 16 summarization requests (prompts of about 40 to 220 tokens) with 4 beams, decodekit's in-engine beam
  search vs transformers `generate(num_beams=4)` on the same 16 prompts as one left-padded batch; both return the
  same sequences (checked). decodekit prefills each prompt once and forks the beams (transformers prefills every
  beam's copy), and finished requests leave the batch.

Usage: python benchmarks/strategies.py {spec,beam,all} [--repeats 3] [--threads 1] [--configs "trained head,ngram"]
       [--batches 1,8,32] [--max-tokens N (a smoke run: shorter outputs)] [--keep-suffix-outputs]

The suffix proposer keeps the engine's recent outputs to draft from; since the benchmark repeats the same prompts, it
forgets them before each timed run (`--keep-suffix-outputs`: not, as every run did before 2026-11-28).

The first adaptive run on a machine measures the target's and the draft's step cost (a few seconds, then cached in
$DECODEKIT_CACHE/step_cost); the untimed warm-up run of each configuration does it before the clock starts.

The prompts come from `decodekit.bench.workloads` (`COPY_PROMPTS`, `CHAT_QUESTIONS`, `summary_texts`), which
`decodekit bench matrix` uses too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from decodekit import LLM, SamplingParams
from decodekit.bench.machine import environment, machine_line
from decodekit.bench.workloads import CHAT_QUESTIONS, COPY_PROMPTS, summary_texts
from decodekit.recipe_runner import forget_outputs


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# The speculative configurations compared, each against plain decoding on the same prompts in the same run.
NGRAM = {"proposer": "ngram", "num_speculative_tokens": 4, "adaptive": True}
INT8_DRAFT = {"proposer": "draft", "num_speculative_tokens": 6}
CHAINED = {"proposer": "ngram", "proposer_options": {"prompt_lookup_min": 2}, "fallback": "draft",
           "num_speculative_tokens": 6, "disable_by_batch_size": 4}
TRAINED_HEAD = {"proposer": "eagle", "num_speculative_tokens": 2}
CHAINED_HEAD = {"proposer": "ngram", "proposer_options": {"prompt_lookup_min": 2}, "fallback": "eagle",
                "num_speculative_tokens": 3, "disable_by_batch_size": 4}
INT8_DRAFT_TREE = {**INT8_DRAFT, "tree": {"width": 2, "max_nodes": 16, "threshold": 0.8}}
SUFFIX = {"proposer": "suffix", "num_speculative_tokens": 4}
CHAIN3 = {"proposer": "ngram", "proposer_options": {"prompt_lookup_min": 2}, "fallback": ["suffix", "draft"]}
# k adapted by cost: the strategy's default when num_speculative_tokens is unset
ADAPTIVE_SUFFIX = {"proposer": "suffix"}
ADAPTIVE_DRAFT = {"proposer": "draft"}
ADAPTIVE_TREE = {"proposer": "draft", "tree": INT8_DRAFT_TREE["tree"]}  # the tree only where its rows are nearly free
SPEC_CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain": None, "ngram": NGRAM, "int8 draft": INT8_DRAFT, "ngram + int8 draft": CHAINED,
    "trained head": TRAINED_HEAD, "ngram + trained head": CHAINED_HEAD, "suffix": SUFFIX,
    "ngram > suffix > int8 draft": {**CHAIN3, "num_speculative_tokens": 4, "disable_by_batch_size": 4},
    "int8 draft tree": INT8_DRAFT_TREE, "suffix (adaptive)": ADAPTIVE_SUFFIX, "int8 draft (adaptive)": ADAPTIVE_DRAFT,
    "ngram > suffix > int8 draft (adaptive)": CHAIN3, "int8 draft tree (adaptive)": ADAPTIVE_TREE}


def spec_prompt_sets(llm: LLM) -> dict[str, tuple[list[str], int]]:
    """The two prompt sets and their output lengths, chat-templated: `copy` (rewrite and repeat tasks, 128 tokens)
    and `chat` (free-form questions, 96 tokens)."""
    def chat(texts: Any) -> list[str]:
        return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]

    return {"copy": (chat(COPY_PROMPTS), 128), "chat": (chat(CHAT_QUESTIONS), 96)}


def bench_spec(llm: LLM, repeats: int, configs: dict[str, dict[str, Any] | None] | None = None,
               batches: tuple[int, ...] = (1, 8, 32), max_tokens_cap: int = 0,
               keep_outputs: bool = False, sample_n: int = 0, seeded: bool = False) -> list[dict[str, Any]]:
    """Every configuration against plain decoding, per prompt set and batch size, interleaved (plain, then each
    configuration, repeated), greedy. Prints and returns one row per (set, batch, configuration): median tokens/s
    (every sequence's tokens), the median of the per-repeat ratios to plain, acceptance per proposer, and whether
    the output equalled plain's. Before each timed run the suffix proposer forgets the outputs it saw, unless
    `keep_outputs`. With `sample_n`, each request is parallel sampling instead: `n = sample_n` samples at
    temperature SAMPLE_TEMPERATURE, unseeded (a server's usual request) or, with `seeded`, seeded (such a request
    chooses its draft lengths as if it ran alone, so that its output does not depend on the batch); the batch counts
    requests; speculation draws other random numbers than plain decoding, so "same as plain" is not asked.
    """
    configs = configs or SPEC_CONFIGS
    rows = []
    for set_name, (prompts, max_tokens) in spec_prompt_sets(llm).items():
        max_tokens = min(max_tokens, max_tokens_cap) if max_tokens_cap else max_tokens
        # prefill every prompt once, untimed, so every configuration finds them in the prefix cache; and run each
        # configuration once, so a draft model is opened (and quantized) before the clock starts
        llm.generate(prompts, SamplingParams(max_tokens=1), add_special_tokens=False)
        for strategy in configs.values():
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=6, **(
                {"strategy": {"speculative": strategy}} if strategy else {})), add_special_tokens=False)
        for batch in batches:
            batch_prompts = (prompts * batch)[:batch] if batch > len(prompts) else prompts

            def run(strategy: dict[str, Any] | None, batch: int = batch, batch_prompts: list[str] = batch_prompts,
                    max_tokens: int = max_tokens) -> list[Any]:
                sampling: dict[str, Any] = {"temperature": 0}
                if sample_n:
                    sampling = {"temperature": SAMPLE_TEMPERATURE, "seed": 0 if seeded else None, "n": sample_n}
                params = SamplingParams(max_tokens=max_tokens, **sampling,
                                        **({"strategy": {"speculative": strategy}} if strategy else {}))
                if batch == 1:
                    return [llm.generate([q], params, add_special_tokens=False)[0] for q in batch_prompts]
                return llm.generate(batch_prompts, params, add_special_tokens=False)

            rates: dict[str, list[float]] = {name: [] for name in configs}
            counts: dict[str, dict[str, list[int]]] = {name: {} for name in configs}  # [accepted, drafted, steps]
            same = dict.fromkeys(configs, True)
            reference = None
            for _ in range(repeats):
                for name, strategy in configs.items():
                    if not keep_outputs:  # a repeat would draft the previous one's answer (Proposer.forget_outputs)
                        forget_outputs(llm)
                    elapsed, outs = _timed(lambda s=strategy: run(s))
                    rates[name].append(sum(len(c.token_ids) for o in outs for c in o.outputs) / elapsed)
                    ids = [[c.token_ids for c in o.outputs] for o in outs]
                    reference = ids if strategy is None else reference
                    same[name] &= ids == reference and not sample_n
                    for out in outs:
                        for proposer, c in out.metrics.proposer_tokens.items():
                            total = counts[name].setdefault(proposer, [0, 0, 0])
                            total[0] += c["accepted"]
                            total[1] += c["drafted"]
                            total[2] += c["steps"]
            for name in configs:
                ratios = [r / p for r, p in zip(rates[name], rates["plain"])]
                acceptance = ", ".join(f"{proposer} {a / max(d, 1):.0%} of {d // repeats}, "
                                       f"length {1 + a / max(steps, 1):.2f}"
                                       for proposer, (a, d, steps) in counts[name].items()) or "-"
                row = {"prompts": set_name, "batch": batch, "config": name, "tok_s": statistics.median(rates[name]),
                       "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "acceptance": acceptance, "same_as_plain": "n/a (sampled)" if sample_n else same[name]}
                rows.append(row)
                print(f"spec {set_name:4} batch {batch:2}: {name:37} {row['tok_s']:6.1f} tok/s  {row['ratio']:.2f}x "
                      f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f})  accepted: {acceptance}  "
                      f"same as plain: {row['same_as_plain']}", flush=True)
    return rows


SAMPLE_TEMPERATURE = 0.7
"""`--sample-n`'s temperature: a chat sampler's usual setting."""


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


def _uses_draft(strategy: dict[str, Any] | None) -> bool:
    """Whether a configuration's chain names the `draft` proposer (the engine then needs its draft model)."""
    if strategy is None:
        return False
    fallback = strategy.get("fallback") or []
    return "draft" in [strategy.get("proposer"), *([fallback] if isinstance(fallback, str) else fallback)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["spec", "beam", "all"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--configs", default="", help="comma-separated speculative configurations to compare "
                        f"with plain (default: all of {', '.join(c for c in SPEC_CONFIGS if c != 'plain')})")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes for `spec`")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="cap the outputs' length (a smoke run; 0: 128 copy, 96 chat)")
    parser.add_argument("--keep-suffix-outputs", action="store_true",
                        help="let the suffix proposer draft from the outputs of earlier repeats of the same prompts "
                        "(before 2026-11-28 every run did; by default it forgets them before each timed run)")
    parser.add_argument("--draft-quantization", choices=["int8", "bf16", "q4_0", "q4_1", "q8_0"], default="int8",
                        help="the self-draft's weights (the `draft` configurations are named after it)")
    parser.add_argument("--sample-n", type=int, default=0,
                        help="`spec` as parallel sampling: each request draws this many samples (n) at "
                        f"temperature {SAMPLE_TEMPERATURE} instead of one greedy sequence")
    parser.add_argument("--seeded", action="store_true", help="with --sample-n: seeded requests")
    parser.add_argument("--dtype", default="float32",
                        help="the target's dtype (`auto`: the bundled GGUF's blocks as stored, where the "
                        "configurations without a draft model run)")
    parser.add_argument("--quantization", choices=["int8", "bf16", "q4_0", "q4_1", "q8_0"], default=None,
                        help="quantize the target's weights on load (with --dtype float32; e.g. `int8`, whose rows "
                        "cost the least beyond the first, so verifying a draft is cheapest)")
    args = parser.parse_args()
    quantization = args.draft_quantization
    known = {name.replace("int8", quantization): strategy for name, strategy in SPEC_CONFIGS.items()}
    names = [c.strip() for c in args.configs.split(",") if c.strip()] or list(known)
    unknown = [c for c in names if c not in known]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {list(known)}")
    configs = {"plain": None, **{c: known[c] for c in names if c != "plain"}}
    if args.threads:
        torch.set_num_threads(args.threads)
    # the quantized self-draft serves the `draft` configurations; plain, n-gram, suffix and beam never open it
    uses_draft = any(_uses_draft(strategy) for strategy in configs.values())
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype,
              **({"draft": "target", "draft_quantization": quantization} if uses_draft else {}),
              **({"quantization": args.quantization} if args.quantization else {}))
    target = args.dtype + (f", {args.quantization} weights" if args.quantization else "")
    print(machine_line(environment(), target), f"| {llm.engine.model.forward_name}", flush=True)
    if args.which in ("spec", "all"):
        bench_spec(llm, args.repeats, configs, tuple(int(b) for b in args.batches.split(",")), args.max_tokens,
                   args.keep_suffix_outputs, args.sample_n, args.seeded)
    if args.which in ("beam", "all"):
        bench_beam(llm, args.repeats)


if __name__ == "__main__":
    main()
