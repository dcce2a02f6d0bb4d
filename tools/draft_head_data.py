"""Self-distillation data for a trained draft head of the bundled model (issue 20): text the model itself writes.

A draft head learns to predict the target's next token from the target's last hidden states, so its training data
is the target's own output: no dataset is downloaded. This script makes the prompts (chat questions built from
instruction templates and topics, copy tasks, and raw continuations of random ordinary tokens), lets the bundled
model answer them through decodekit (half greedy, half sampled at temperature 0.8, every request seeded), and saves
the token ids of every prompt and answer. Hidden states are not stored: a training run recomputes them with one
forward per sequence, which costs far less than generating, and keeps the file small enough to commit.

Resumable: requests are run in rounds of `--round-size`, and each finished round is appended to the output file
(`.npz`: `tokens` int32, `starts`/`prompt_lens`/`lengths` int64, `seeds`, `greedy`); a rerun skips the requests
already there. The request list is a pure function of `--seed` and `--num-requests`.

Usage: python tools/draft_head_data.py --output data/draft_head/smollm2_selfdistill.npz [--num-requests 1200]
       [--max-tokens 256] [--round-size 64] [--seed 0] [--prompt-set templated]
The second file: --output data/draft_head/smollm2_selfdistill_open.npz --num-requests 1000 --seed 1
       --prompt-set open
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INSTRUCTIONS = (
    "Explain {topic} to a ten-year-old.", "Write a short poem about {topic}.", "What are the pros and cons of {topic}?",
    "Give me three surprising facts about {topic}.", "Write a short story that involves {topic}.",
    "How would you describe {topic} to someone from the year 1800?", "Summarize the history of {topic}.",
    "What questions should I ask an expert on {topic}?", "Write a product description for {topic}.",
    "Compare {topic} with something similar, and explain the differences.", "Write a haiku about {topic}.",
    "What are common misconceptions about {topic}?", "Give step-by-step instructions related to {topic}.",
    "Write a dialogue between two friends discussing {topic}.", "Why does {topic} matter?",
    "Write a short news report about {topic}.", "List five words associated with {topic} and explain each.",
    "Write a Python function that has something to do with {topic}, with a docstring.",
    "Plan a one-day trip centred on {topic}.", "Write a limerick about {topic}.",
)
TOPICS = (
    "the ocean", "volcanoes", "honeybees", "the printing press", "black holes", "bread baking", "chess", "the Moon",
    "electric cars", "photosynthesis", "the Roman Empire", "jazz music", "glaciers", "the Internet", "owls",
    "recycling", "the human heart", "origami", "rainbows", "coffee", "the stock market", "dinosaurs", "solar panels",
    "the Great Wall of China", "knitting", "vaccines", "earthquakes", "mountain climbing", "the violin", "tea",
    "machine learning", "gardening", "the French Revolution", "submarines", "bicycles", "lighthouses", "sleep",
    "board games", "deserts", "the immune system", "rivers", "libraries", "the Olympic Games", "clouds", "cheese",
    "space stations", "penguins", "the piano", "bridges", "friendship",
)
PASSAGES = (
    "The Amazon rainforest covers much of the Amazon basin of South America and holds an estimated 390 billion trees.",
    "Marie Curie conducted pioneering research on radioactivity and was the first person to win two Nobel Prizes.",
    "def total(values):\n    result = 0\n    for value in values:\n        result += value\n    return result",
    "The Great Barrier Reef is the world's largest coral reef system, off the coast of Queensland, Australia.",
    "Water boils at 100 degrees Celsius at sea level, and at lower temperatures at higher altitudes.",
)
COPY_TASKS = ("Repeat this text exactly:", "Rewrite this text in your own words:",
              "Translate this into simple English:", "Summarize this in one sentence:",
              "Add a comment explaining this:")

# The `open` prompt set: everyday questions of many shapes, about topics and activities the templated set lacks.
OPEN_QUESTIONS = (
    "How does {topic} work?", "Why is {topic} important?", "What is the difference between {topic} and {other}?",
    "Can you explain {topic} in simple terms?", "What would happen if there were no {topic}?",
    "Describe {topic} to someone who has never seen it.", "What are the main parts of {topic}?",
    "Tell me something most people do not know about {topic}.", "How has {topic} changed over the last century?",
    "Write a short paragraph about {topic} for a school newsletter.", "What is the best way to learn about {topic}?",
    "Write an email to a friend about {topic}.", "What are three questions a child might ask about {topic}?",
    "Write a short speech about {topic}.", "Give an example of {topic} in everyday life.",
    "Is {topic} good or bad for the environment? Explain.", "Write a recipe-style guide to understanding {topic}.",
    "What jobs are related to {topic}?", "Explain {topic} using an analogy.", "Write a tweet about {topic}.",
)
OPEN_ACTIVITIES = (
    "Give me some tips for {activity}.", "What should I know before {activity}?", "How do I get better at {activity}?",
    "What are common mistakes when {activity}?", "Make a checklist for {activity}.",
    "What equipment do I need for {activity}?", "How can I stay motivated while {activity}?",
    "Write a beginner's guide to {activity}.", "How much time should I spend on {activity} each week?",
    "What are the health benefits of {activity}?",
)
OPEN_TOPICS = (
    "a microwave oven", "the water cycle", "a thermostat", "credit cards", "tides", "a compass", "thunderstorms",
    "the postal service", "wind turbines", "the seasons", "an airplane wing", "batteries", "the human eye", "yeast",
    "traffic lights", "a museum", "memory", "money", "a city park", "public transport", "the calendar", "soap",
    "a camera", "weather forecasts", "the alphabet", "a kitchen knife", "elections", "insurance", "a rainforest",
    "the moon landing", "nutrition labels", "a hospital", "time zones", "the stock exchange", "plastic", "ants",
    "music theory", "a telescope", "fire", "maps", "email", "the brain", "coral reefs", "trains", "umbrellas",
    "a vegetable garden", "a newspaper", "passwords", "bees and flowers", "the sun",
)
OPEN_ACTIVITY_NAMES = (
    "running a marathon", "learning a new language", "cooking for a large family", "moving to a new city",
    "starting a small business", "painting with watercolours", "writing a novel", "camping in the rain",
    "saving money for a holiday", "training a puppy", "studying for an exam", "planting a tree",
    "giving a presentation", "swimming in the sea", "buying a used car", "learning to juggle", "baking sourdough",
    "photographing birds", "building a bookshelf", "teaching a child to ride a bike", "keeping a journal",
    "travelling alone", "playing the drums", "cleaning a house quickly", "meditating",
)


@dataclass(frozen=True)
class DataRequest:
    """One generation: a chat message or raw token ids, greedy or sampled, with its seed."""

    message: str | None
    raw_ids: tuple[int, ...] | None
    greedy: bool
    seed: int


def make_requests(count: int, seed: int, token_pool: list[int]) -> list[DataRequest]:
    """The request list: 70% instruction x topic chat, 15% copy tasks, 15% raw continuations of 8-32 random ordinary
    tokens; alternately greedy and sampled. A pure function of its arguments."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        kind = rng.random()
        greedy = index % 2 == 0
        if kind < 0.70:
            message = rng.choice(INSTRUCTIONS).format(topic=rng.choice(TOPICS))
            requests.append(DataRequest(message, None, greedy, seed * 1_000_003 + index))
        elif kind < 0.85:
            message = f"{rng.choice(COPY_TASKS)}\n\n{rng.choice(PASSAGES)}"
            requests.append(DataRequest(message, None, greedy, seed * 1_000_003 + index))
        else:
            ids = tuple(rng.choice(token_pool) for _ in range(rng.randint(8, 32)))
            requests.append(DataRequest(None, ids, greedy, seed * 1_000_003 + index))
    return requests


def make_open_requests(count: int, seed: int) -> list[DataRequest]:
    """The `open` request list: everyday questions (two thirds about a topic, one third about an activity),
    alternately greedy and sampled. A pure function of its arguments."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        if rng.random() < 2 / 3:
            message = rng.choice(OPEN_QUESTIONS).format(topic=rng.choice(OPEN_TOPICS), other=rng.choice(OPEN_TOPICS))
        else:
            message = rng.choice(OPEN_ACTIVITIES).format(activity=rng.choice(OPEN_ACTIVITY_NAMES))
        requests.append(DataRequest(message, None, index % 2 == 0, seed * 1_000_003 + index))
    return requests


def _load(path: Path) -> dict[str, np.ndarray]:
    if not path.exists():
        return {}
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


Row = tuple[list[int], int, int, bool]  # tokens (prompt + answer), prompt length, seed, greedy


def _append(path: Path, found: dict[str, np.ndarray], rows: list[Row]) -> dict[str, np.ndarray]:
    """Add finished rows (tokens, prompt length, seed, greedy) and rewrite the file atomically."""
    tokens = [found["tokens"]] if found else []
    starts = list(found["starts"]) if found else []
    lengths = list(found["lengths"]) if found else []
    prompt_lens = list(found["prompt_lens"]) if found else []
    seeds = list(found["seeds"]) if found else []
    greedy = list(found["greedy"]) if found else []
    offset = int(starts[-1] + lengths[-1]) if starts else 0
    for ids, prompt_len, seed, is_greedy in rows:
        tokens.append(np.asarray(ids, dtype=np.int32))
        starts.append(offset)
        lengths.append(len(ids))
        prompt_lens.append(prompt_len)
        seeds.append(seed)
        greedy.append(is_greedy)
        offset += len(ids)
    result = {"tokens": np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
              "starts": np.asarray(starts, np.int64), "lengths": np.asarray(lengths, np.int64),
              "prompt_lens": np.asarray(prompt_lens, np.int64), "seeds": np.asarray(seeds, np.int64),
              "greedy": np.asarray(greedy, bool)}
    partial = path.with_suffix(".partial.npz")
    np.savez_compressed(partial, **result)  # type: ignore[arg-type]
    partial.replace(path)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--num-requests", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--round-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-set", choices=["templated", "open"], default="templated",
                        help="templated: instruction x topic chat, copy tasks, raw continuations; open: everyday "
                        "questions of many shapes")
    args = parser.parse_args()

    from decodekit import LLM, SamplingParams
    from decodekit.bench.workloads import safe_token_pool

    llm = LLM("smollm2-135m-instruct", dtype="float32", max_num_seqs=args.round_size)
    tokenizer = llm.tokenizer
    requests = (make_open_requests(args.num_requests, args.seed) if args.prompt_set == "open"
                else make_requests(args.num_requests, args.seed, safe_token_pool(tokenizer)))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    found = _load(args.output)
    done = len(found["starts"]) if found else 0
    print(f"{done} of {len(requests)} requests already in {args.output}", flush=True)
    start = time.perf_counter()
    generated = 0
    for first in range(done, len(requests), args.round_size):
        batch = requests[first : first + args.round_size]
        prompts: list[list[int]] = []
        for request in batch:
            if request.message is not None:
                text = llm.apply_chat_template([{"role": "user", "content": request.message}])
                prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
            else:
                prompts.append(list(request.raw_ids or ()))
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0 if r.greedy else 0.8, seed=r.seed)
                  for r in batch]
        outs = llm.generate(prompts, params)
        rows = [(prompt + out.token_ids, len(prompt), request.seed, request.greedy)
                for prompt, out, request in zip(prompts, outs, batch)]
        found = _append(args.output, found, rows)
        generated += sum(len(out.token_ids) for out in outs)
        elapsed = time.perf_counter() - start
        print(f"{first + len(batch)} of {len(requests)} requests, {generated} tokens generated in {elapsed:.0f} s "
              f"({generated / elapsed:.0f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
