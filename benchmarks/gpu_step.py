"""The GPU path against its bounds: batch-1 decode against reading the weights once, large batches against the
tensor cores' bf16 rate.

For one model folder, in one process:

- batch 1, for each variant of the decode path (alternated over `--repeats` rounds, medians, each warmed up by an
  answer as long first, so that every graph it replays is captured before the timing): the engine's time per output
  token (greedy, `ignore_eos`, a long answer so that the prefill is noise) and the replay of its longest graph alone
  (CUDA events), the difference being the host's share. The variants: `one step a token` (a layer in five launches,
  RoPE by lookup, each launch a programmatic dependent launch on Hopper: `gpu_layer.programmatic_launches`), and
  greedy runs of 8, 32 (the default on a GPU: `plan.GRAPH_RUN_STEPS`) and 64 tokens a graph replay
  (`decode_run_steps`);
- the weight bytes over the measured device-to-device copy bandwidth (the batch-1 bound), and the host
  synchronisations per step (`torch.cuda.set_sync_debug_mode`);
- with `--batches`, throughput at those many concurrent requests (prompts and outputs drawn from 16..1024,
  `ignore_eos`): output tokens per second, milliseconds a step, and the decode's share of the bf16 matrix rate
  measured here (2 x parameters FLOP per token over a large bf16 product's rate); with `--host-profile`, where the
  host's time goes at the largest of them (cProfile).

Run on the GPU machine:

    python benchmarks/gpu_step.py --model /tmp/smollm2-135m --tokens 256 --batches 64,256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings
from typing import Any

import torch

from decodekit import LLM, SamplingParams


def copy_bandwidth(gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (median of 10)."""
    src = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times[2:])


def bf16_matmul_rate(size: int = 8192) -> float:
    """A large bf16 matrix product's rate in FLOP/s (random operands, median of 10)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times[2:])


VARIANTS = {"one step a token": 1, "runs of 8": 8, "runs of 32": 32, "runs of 64": 64}


def set_variant(llm: LLM, name: str) -> None:
    """Switch the engine to a decode-path variant (`VARIANTS`: its run length); the graphs are captured anew."""
    llm.engine.config.decode_run_steps = VARIANTS[name]
    graphs = llm.engine.model.runner.graphs
    if graphs is not None:
        graphs._graphs.clear()
        graphs._runs.clear()


def replay_time(graph: Any, replays: int = 200) -> float:
    """Seconds per replay of a captured graph (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays / 1e3


def workload(vocab: int, requests: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """`requests` greedy requests, prompts and outputs drawn from 16..1024 tokens (`ignore_eos`)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 1024))] for _ in range(requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(16, 1024), ignore_eos=True)
              for _ in range(requests)]
    return prompts, params


def throughput(llm: LLM, vocab: int, requests: int) -> tuple[float, int, float]:
    """Output tokens per second of `workload(vocab, requests)` run together, the tokens, and milliseconds a step."""
    prompts, params = workload(vocab, requests)
    llm.generate(prompts[:4], params[:4])  # graphs of the first buckets, warm-up
    torch.cuda.synchronize()
    steps = llm.engine.step_count
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = llm.engine.step_count - steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall, tokens, wall / max(steps, 1) * 1e3


def host_profile(llm: LLM, vocab: int, requests: int) -> None:
    """`workload(vocab, requests)` again under cProfile: the engine's functions by cumulative time (where the
    host's time a step goes at that many requests; cProfile inflates the Python share)."""
    import cProfile
    import pstats

    prompts, params = workload(vocab, requests)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    profiler.disable()
    print(f"host profile of the {requests}-request run (cumulative seconds):")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats("decodekit", 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="Comma-separated batch-1 variants to time "
                        f"(of {', '.join(VARIANTS)}).")
    parser.add_argument("--batches", default="", help="Comma-separated request counts for the throughput rows.")
    parser.add_argument("--profile", action="store_true", help="Also print the batch-1 graph's kernels by device "
                        "time (torch.profiler over 20 replays).")
    parser.add_argument("--host-profile", action="store_true", help="Also run the largest --batches again under "
                        "cProfile and print the engine's functions by cumulative time.")
    args = parser.parse_args()

    batches = [int(b) for b in args.batches.split(",") if b]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    llm = LLM(args.model, device="cuda", dtype=args.dtype, max_num_seqs=max([1, *batches]),
              max_num_batched_tokens=4096, kv_cache_memory="24GiB" if batches else "2GiB")
    model = llm.engine.loaded.model
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    weight_bytes = sum(weights.values())
    parameters = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    prompt = llm.tokenizer("The history of the printing press").input_ids
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    graphs = llm.engine.model.runner.graphs
    per_token: dict[str, list[float]] = {v: [] for v in variants}
    replays: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name in variants:
            set_variant(llm, name)
            answers[name] = llm.generate([prompt], params)[0].outputs[0].token_ids  # captures every graph it needs
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt], params)
            torch.cuda.synchronize()
            per_token[name].append((time.perf_counter() - start) / args.tokens)
            if graphs is not None:
                one = [c for key, c in graphs._graphs.items() if key[:2] == (1, 1)]
                runs = [(steps, c) for (steps, _), c in graphs._runs.items() if c.graph is not None]
                if runs:
                    steps, captured = max(runs, key=lambda r: r[0])
                    replays[name] = replay_time(captured.graph) / steps
                elif one and one[0].graph is not None:
                    replays[name] = replay_time(one[0].graph)

    set_variant(llm, "one step a token")
    steps = 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = sorted({f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in syncs})

    if args.profile and graphs is not None:
        from torch.profiler import ProfilerActivity, profile

        captured = next(c for key, c in graphs._graphs.items() if key[:2] == (1, 1))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                captured.graph.replay()
            torch.cuda.synchronize()
        print("20 replays of the one-step batch-1 graph (five launches a layer):")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))

    bandwidth = copy_bandwidth()
    bound = weight_bytes / bandwidth
    print(f"model {args.model} ({args.dtype}, {weight_bytes / 2**20:.0f} MiB of weights, {parameters / 1e6:.0f}M "
          f"parameters) on {torch.cuda.get_device_name()}; forward {llm.engine.model.forward_name}, CUDA graphs "
          f"{'on' if graphs is not None else 'off'}; same tokens across variants: "
          f"{len({tuple(a) for a in answers.values()}) == 1}")
    print(f"| batch-1 variant | engine per token (median of {args.repeats} x {args.tokens}) | graph replay per token "
          f"| replay / bound | engine / bound ({bound * 1e3:.3f} ms: weights at {bandwidth / 1e12:.2f} TB/s) |")
    print("|---|---|---|---|---|")
    for name in variants:
        tpot = statistics.median(per_token[name])
        replay = f"{replays[name] * 1e3:.3f} ms | {replays[name] / bound:.2f}x" if name in replays else "- | -"
        print(f"| {name} | {tpot * 1e3:.3f} ms ({1 / tpot:.0f} tok/s) | {replay} | {tpot / bound:.2f}x |")
    print(f"host synchronisations per step (five launches, {steps} steps, prefill included): "
          f"{len(syncs) / steps:.1f} ({', '.join(sites[:8])})")
    if batches:
        set_variant(llm, "runs of 32")
        rate = bf16_matmul_rate()
        print(f"| concurrent requests | output tok/s | tokens | ms a step | share of the bf16 matrix rate "
              f"({rate / 1e12:.0f} TFLOP/s measured) |")
        print("|---|---|---|---|---|")
        for requests in batches:
            tok_s, tokens, step_ms = throughput(llm, model.config.vocab_size, requests)
            print(f"| {requests} | {tok_s:.0f} | {tokens} | {step_ms:.1f} | {tok_s * 2 * parameters / rate:.1%} |")
        if args.host_profile:
            host_profile(llm, model.config.vocab_size, max(batches))


if __name__ == "__main__":
    main()
