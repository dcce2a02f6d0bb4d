"""Replay `decodekit bench serve`'s chat workload offline, in one process, to split engine time from server time.

Usage: python benchmarks/serve_offline_replay.py [--num-requests 64] [--in-flight 16] [--seed 0] [--dtype float32]

The same seeded requests as `decodekit bench serve` (prompts through the chat template, greedy or seeded top-p
sampling, the same `max_tokens`) are fed to `LLM.engine` directly, keeping `--in-flight` of them running as the
16 clients do; it prints generated tokens per second and the median step time. Compare with the `decodekit serve`
row of `decodekit bench serve --baseline none` on the same machine: the difference is what HTTP, streaming and the
clients cost.
"""

from __future__ import annotations

import argparse
import time

from decodekit import LLM, SamplingParams
from decodekit.bench.serving.workload import ChatRequest, make_chat_workload


def sampling_params(request: ChatRequest) -> SamplingParams:
    """The engine's parameters for one workload request, as the server maps its body."""
    if request.greedy:
        return SamplingParams(max_tokens=request.max_tokens, temperature=0.0)
    return SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                          seed=request.seed)


def main() -> None:
    """Run the replay and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, kv_cache_memory=256 << 20)
    engine = llm.engine
    requests = make_chat_workload(args.num_requests, args.seed)
    prompts = [llm.apply_chat_template(list(r.messages)) for r in requests]
    engine.add_request(prompts[0], SamplingParams(max_tokens=8), add_special_tokens=False)  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    pending, in_flight, tokens, step_times = list(range(len(requests))), 0, 0, []
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < args.in_flight:
            i = pending.pop(0)
            engine.add_request(prompts[i], sampling_params(requests[i]), request_id=str(i), add_special_tokens=False)
            in_flight += 1
        began = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - began)
        for out in outputs:
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    step_times.sort()
    print(f"{len(requests)} requests, {args.in_flight} in flight: {tokens} tokens in {wall:.1f} s = "
          f"{tokens / wall:.1f} tok/s; {len(step_times)} steps, median {step_times[len(step_times) // 2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
