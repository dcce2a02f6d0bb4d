"""How often a draft head's token equals the target's greedy token on chat answers it never saw in training.

For each of the first `--questions` of `decodekit.bench.workloads.CHAT_QUESTIONS`, the bundled model answers
greedily (`--max-tokens`); transformers then computes its last hidden states over prompt and answer, and the head
runs teacher-forced over them: its first draft step (true states) and its second (its own prediction as input, as at
inference). Printed: the share of answer positions where the head's top token (over its draft vocabulary) is the
target's next token, per step. A proxy for the acceptance of the first and second draft token, free of timing.

Usage: python benchmarks/draft_head_agreement.py [--head decodekit/models/heads/smollm2-135m-instruct.safetensors]
       [--questions 4] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from decodekit import LLM, SamplingParams
from decodekit.bench.workloads import CHAT_QUESTIONS
from decodekit.models.draft_head import load_head
from decodekit.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", type=Path, default=Path("decodekit/models/heads/smollm2-135m-instruct.safetensors"))
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    llm = LLM("smollm2-135m-instruct", dtype="float32")
    model = load_model("smollm2-135m-instruct", dtype="float32", device="cpu").model
    head, _ = load_head(args.head)
    embedding = model.get_input_embeddings().weight
    lm_rows = model.get_output_embeddings().weight[head.draft_vocab]
    agree, positions = [0, 0], 0
    for question in CHAT_QUESTIONS[: args.questions]:
        text = llm.apply_chat_template([{"role": "user", "content": question}])
        prompt = llm.tokenizer(text, add_special_tokens=False).input_ids
        answer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens))[0].token_ids
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            states = model.model(input_ids=ids).last_hidden_state
            embeds = embedding[ids[:, 1:]]
            first, kv = head(embeds, states[:, :-1])
            second = head.forward_second(embeds, states[:, :-1], first, kv)
            wanted = ids[0, 2:]  # greedy answer: the token after position i + 1 is the target's top token there
            answer_rows = slice(len(prompt) - 1, None)
            for n, predicted in enumerate((first, second)):
                tokens = head.draft_vocab[(predicted[0, :-1] @ lm_rows.T).argmax(-1)]
                agree[n] += int((tokens[answer_rows] == wanted[answer_rows]).sum())
        positions += len(wanted[answer_rows])
    print(f"{args.head}: first draft step {agree[0] / positions:.1%}, second {agree[1] / positions:.1%} "
          f"of {positions} answer positions ({args.questions} chat questions)")


if __name__ == "__main__":
    main()
