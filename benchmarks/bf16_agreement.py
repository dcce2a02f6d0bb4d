"""How close bf16 arithmetic stays to float32: decodekit's bfloat16 (bf16 weights; batched products on the CPU's
bf16 GEMM where it has one), transformers' own bf16 forward and vLLM's CPU build in bf16 (`--vllm PYTHON`), each
against decodekit's float32 run (transformers' float32 tokens, as the exactness tests hold) on the same token ids.

The workload is `decodekit bench mixed`'s (32 requests by default, all at once, greedy to their exact lengths; its
first round). transformers runs one request at a time (no padding: its bf16 tokens are its bf16 arithmetic alone).
Printed: per system, the share of requests whose greedy tokens equal the float32 ones, and the mean share of each
request's tokens before the first difference (the harness's `token_agreement`); also each bf16 system against
transformers' bf16.

Usage: python benchmarks/bf16_agreement.py [--num-requests 32] [--vllm /path/to/vllm/python] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch

from decodekit.bench.baselines import DecodekitSystem, HFGenerateSystem, System
from decodekit.bench.machine import environment, machine_line
from decodekit.bench.peers import VllmPeer, vllm_model_folder
from decodekit.bench.report import token_agreement
from decodekit.bench.workloads import make_workload
from decodekit.models import load_model


def outputs(system: System, requests: list, work: object) -> list[list[int]]:
    """The system's greedy tokens for `requests` (after its warm-up), and it closed."""
    try:
        system.prepare(work)  # type: ignore[arg-type]
        return system.run(requests).outputs
    finally:
        system.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--vllm", default=None, help="the Python of vLLM's CPU build (its own venv)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    float32 = load_model("smollm2-135m-instruct", dtype="float32")
    work = make_workload("mixed", float32.tokenizer, num_requests=args.num_requests)
    requests = work.requests(0)
    print(machine_line(environment(), "float32 / bfloat16"), flush=True)
    tokens: dict[str, list[list[int]]] = {}
    tokens["decodekit float32"] = outputs(DecodekitSystem(float32.model, float32.tokenizer, torch.float32, {}),
                                          requests, work)
    bf16 = load_model("smollm2-135m-instruct", dtype="bfloat16")
    dk = DecodekitSystem(bf16.model, bf16.tokenizer, torch.bfloat16, {})
    products = dk.llm.engine.model.forward_name
    tokens[f"decodekit bfloat16 ({products})"] = outputs(dk, requests, work)
    tokens["transformers bfloat16"] = outputs(HFGenerateSystem(bf16.model, bf16.tokenizer, 1), requests, work)
    if args.vllm:
        peer = VllmPeer(args.vllm, vllm_model_folder("smollm2-135m-instruct"), "bfloat16", threads=args.threads)
        tokens["vLLM bfloat16"] = outputs(peer, requests, work)
    reference, hf_bf16 = tokens["decodekit float32"], tokens["transformers bfloat16"]
    print(f"{args.num_requests} requests, {sum(r.output_len for r in requests)} greedy tokens")
    print(f"{'system':<58} {'= float32':>10} {'prefix':>7} {'= HF bf16':>10} {'prefix':>7}")
    for name, got in tokens.items():
        same, prefix = token_agreement(got, reference)
        same_hf, prefix_hf = token_agreement(got, hf_bf16)
        print(f"{name:<58} {same or 0:10.0%} {prefix or 0:7.1%} {same_hf or 0:10.0%} {prefix_hf or 0:7.1%}")


if __name__ == "__main__":
    main()
