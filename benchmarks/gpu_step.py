"""Batch-1 decode on a GPU: the engine's time per token against the time to read the weights once (the bound).

Prints, for one model folder: the engine's time per output token at batch 1 (greedy, `ignore_eos`, a long answer
so that the prefill is noise), the replay of the batch-1 CUDA graph alone (CUDA events), the weight bytes over the
measured device-to-device copy bandwidth, and how many host synchronisations the engine makes per step
(`torch.cuda.set_sync_debug_mode`). Run on the GPU machine:

    python benchmarks/gpu_step.py --model /tmp/smollm2-random --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="Also print the batch-1 step's kernels by device "
                        "time (torch.profiler over 20 eager runs of what the graph captures).")
    args = parser.parse_args()

    llm = LLM(args.model, device="cuda", dtype=args.dtype)
    model = llm.engine.loaded.model
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    weight_bytes = sum(weights.values())
    prompt = llm.tokenizer("The history of the printing press").input_ids
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # capture, warm up
    per_token = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params)
        torch.cuda.synchronize()
        per_token.append((time.perf_counter() - start) / args.tokens)
    tpot = statistics.median(per_token)

    replay = None
    graphs = llm.engine.model.runner.graphs
    if graphs is not None and (1, 1) in graphs._graphs:
        graph = graphs._graphs[(1, 1)].graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        end.synchronize()
        replay = start.elapsed_time(end) / 200 / 1e3

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

    if args.profile and graphs is not None and (1, 1) in graphs._graphs:
        from torch.profiler import ProfilerActivity, profile

        context = int(graphs.meta[4, 0])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                graphs._graphs[(1, 1)].graph.replay()
            torch.cuda.synchronize()
        print(f"20 replays of the batch-1 graph at context {context}:")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=70))

    bandwidth = copy_bandwidth()
    bound = weight_bytes / bandwidth
    print(f"model {args.model} ({args.dtype}, {weight_bytes / 2**20:.0f} MiB of weights) on "
          f"{torch.cuda.get_device_name()}; forward {llm.engine.model.forward_name}, "
          f"CUDA graphs {'on' if graphs is not None else 'off'}")
    print("| figure | value |")
    print("|---|---|")
    print(f"| engine time per token, batch 1 (median of {args.repeats} x {args.tokens} tokens) | "
          f"{tpot * 1e3:.3f} ms ({1 / tpot:.0f} tok/s) |")
    if replay is not None:
        print(f"| batch-1 graph replay alone (200 replays) | {replay * 1e3:.3f} ms |")
    print(f"| weights read once at the measured copy bandwidth ({bandwidth / 1e12:.2f} TB/s) | {bound * 1e3:.3f} ms |")
    print(f"| engine time over the bound | {tpot / bound:.1f}x |")
    print(f"| host synchronisations per step ({steps} steps, prefill included) | {len(syncs) / steps:.1f} "
          f"({', '.join(sites[:8])}) |")


if __name__ == "__main__":
    main()
