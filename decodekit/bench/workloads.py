"""Seeded, deterministic benchmark workloads: token-id prompts of exact lengths, exact output lengths.

A workload fixes the *shape* of the traffic (how many requests, each prompt's and output's length) from its
seed. The token ids are drawn per round (`Workload.requests(round_index)`) from the tokenizer's ordinary
vocabulary: every system sees the same ids within a round, but a new round brings new ids, so no system can
serve a repeated round from a prefix cache filled by the previous one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("batch1", "batch", "mixed", "ttft")
"""The workload names `make_workload` knows."""

MIXED_MIN_LEN = 16
MIXED_MAX_LEN = 256
TTFT_PROMPT_LEN = 256
DEFAULT_PROMPT_LEN = 32

MIXED_REQUESTS, MIXED_REPEATS = 16, 2
"""`decodekit bench mixed`'s default size: 16 requests, 2 rounds (a few minutes for the three systems on a
2-core CPU with the bundled model). The same generator as the full size, so the same kind of figures."""
MIXED_FULL_REQUESTS, MIXED_FULL_REPEATS = 64, 3
"""`decodekit bench mixed --full`: the size of the figures in docs/history/benchmarks-2026-11.md (~45 minutes on
that CPU)."""

COPY_PROMPTS = (
    "Repeat the following text exactly, word for word:\n\nThe Great Barrier Reef is the world's largest "
    'coral reef system, composed of over 2,900 individual reefs and 900 islands stretching for over 2,300 '
    'kilometres over an area of approximately 344,400 square kilometres. The reef is located in the Coral '
    'Sea, off the coast of Queensland, Australia.',
    'Rewrite this paragraph, keeping every fact:\n\nMarie Curie was a Polish and naturalised-French physicist '
    'and chemist who conducted pioneering research on radioactivity. She was the first woman to win a Nobel '
    'Prize, the first person to win a Nobel Prize twice, and the only person to win a Nobel Prize in two '
    'scientific fields.',
    'Add type hints to this Python function and return the whole function:\n\ndef mean(values):\n    total '
    '= 0\n    for value in values:\n        total += value\n    return total / len(values)',
    'Summarize this in two sentences:\n\nThe Amazon rainforest covers much of the Amazon basin of South '
    'America. The basin encompasses seven million square kilometres, of which five and a half million square '
    'kilometres are covered by the rainforest. The majority of the forest is contained within Brazil, with '
    '60% of the rainforest, followed by Peru with 13% and Colombia with 10%.',
)
"""Prompts whose answers copy from their input (repeat, rewrite, add type hints, summarize): where prompt lookup
(n-gram) drafts pay. recipes/speculative.yaml runs them too."""

FACTS = (
    "The Amazon rainforest covers much of the Amazon basin of South America.",
    "The basin encompasses seven million square kilometres, most of it covered by the rainforest.",
    "The majority of the forest is contained within Brazil, followed by Peru and Colombia.",
    "It represents over half of the planet's remaining rainforests.",
    "It is the largest and most biodiverse tract of tropical rainforest in the world.",
    "An estimated 390 billion individual trees are divided into 16,000 species.",
    "More than 30 million people of 350 different ethnic groups live in the Amazon.",
    "Deforestation has cleared about a fifth of the forest since the 1970s.",
    "Scientists warn that further loss could turn parts of the forest into savanna.",
    "The river that drains the basin carries more water than any other river on Earth.",
)
"""The sentences the summarization prompts of the beam-search benchmarks are made of."""

CHAT_QUESTIONS = (
    "What are three good habits for staying healthy while working from home?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Why do leaves change colour in autumn?",
    "Give me some tips for learning to play the guitar as an adult.",
    "How does a bill become a law in a parliamentary democracy?",
    "Describe the taste of a ripe mango to someone who has never had one.",
)
"""Free-form chat questions: nothing in the prompt to copy, the case where n-gram lookup finds little and a draft
model has to predict the answer itself (the speculative benchmarks' `chat` set)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt token ids and exactly how many tokens it must generate."""

    prompt_ids: list[int]
    output_len: int


@dataclass
class Workload:
    """The shape of a benchmark's traffic; `requests(r)` gives round r's concrete prompts.

    Attributes:
        name: one of `WORKLOADS`.
        prompt_lens: each request's prompt length, in arrival order.
        output_lens: each request's exact output length.
        batch_size: the batch size static batching uses for this workload.
        token_pool: the token ids prompts are drawn from (no special or added tokens).
        seed: the workload's seed.
    """

    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    batch_size: int
    token_pool: list[int] = field(repr=False)
    seed: int = 0

    @property
    def num_requests(self) -> int:
        """How many requests arrive (all at once)."""
        return len(self.prompt_lens)

    @property
    def total_output_tokens(self) -> int:
        """The useful output tokens of one round: the sum of the requested output lengths."""
        return sum(self.output_lens)

    @property
    def total_prompt_tokens(self) -> int:
        """The prompt tokens of one round."""
        return sum(self.prompt_lens)

    def requests(self, round_index: int = 0) -> list[BenchRequest]:
        """Round `round_index`'s requests: same lengths every round, fresh (seeded) token ids."""
        rng = random.Random(f"{self.seed}:{self.name}:{round_index}")
        return [BenchRequest([rng.choice(self.token_pool) for _ in range(n)], out)
                for n, out in zip(self.prompt_lens, self.output_lens, strict=True)]

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary of the shape."""
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "prompt_tokens": self.total_prompt_tokens,
            "output_tokens": self.total_output_tokens,
            "prompt_len_min": min(self.prompt_lens),
            "prompt_len_max": max(self.prompt_lens),
            "output_len_min": min(self.output_lens),
            "output_len_max": max(self.output_lens),
        }


@dataclass
class TextWorkload(Workload):
    """A workload of natural-language prompts: request i asks `texts[i % len(texts)]` and must generate exactly
    its output length.

    Every prompt starts with its own tag, "Request R.I" (R the round, I the request): in the system turn of the
    tokenizer's chat template, or as the first line without one. So, as with the token-id workloads, no prompt
    shares a cached prefix with another one or with an earlier round's (the transformers baselines have no
    prefix cache). `prompt_lens` are round 0's; the tag's digits can change them by a token in other rounds.
    """

    texts: list[str] = field(default_factory=list, repr=False)
    tokenizer: Any = field(default=None, repr=False)
    vocab_size: int | None = None

    def prompt_ids(self, round_index: int, index: int) -> list[int]:
        """Request `index`'s prompt token ids in round `round_index`."""
        tag, text = f"Request {round_index}.{index}.", self.texts[index % len(self.texts)]
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": tag}, {"role": "user", "content": text}]
            text = str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        else:
            text = f"{tag}\n{text}"
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if self.vocab_size is not None and max(ids) >= self.vocab_size:
            raise ValueError(f"the tokenizer gives ids up to {max(ids)}, beyond the model's {self.vocab_size}")
        return ids

    def requests(self, round_index: int = 0) -> list[BenchRequest]:
        """Round `round_index`'s requests: the texts, freshly tagged."""
        return [BenchRequest(self.prompt_ids(round_index, i), out) for i, out in enumerate(self.output_lens)]


def make_text_workload(name: str, tokenizer: Any, texts: list[str], *, num_requests: int, output_len: int,
                       batch_size: int, seed: int = 0, vocab_size: int | None = None) -> TextWorkload:
    """A `TextWorkload` of `num_requests` requests cycling through `texts`, each generating `output_len` tokens.

    Args:
        name: the workload's name (its token-id pool is the tokenizer's ordinary vocabulary, for warm-ups).
        batch_size: the batch size static batching uses.
        vocab_size: the model's vocabulary size (a prompt with an id beyond it is refused).
    """
    if not texts:
        raise ValueError("a text workload needs at least one text")
    for label, value in (("num_requests", num_requests), ("batch_size", batch_size), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"`{label}` must be >= 1, got {value}")
    work = TextWorkload(name, [], [output_len] * num_requests, batch_size, safe_token_pool(tokenizer, vocab_size),
                        seed, texts=list(texts), tokenizer=tokenizer, vocab_size=vocab_size)
    work.prompt_lens = [len(r.prompt_ids) for r in work.requests(0)]
    return work


def summary_texts(num_requests: int) -> list[str]:
    """Summarization requests of different lengths (1 to 10 of `FACTS`: about 40 to 220 tokens in a chat
    template), the typical beam-search job."""
    return [f"Summarize in one sentence: {' '.join(FACTS[(i + j) % len(FACTS)] for j in range(1 + (i * 3) % 10))}"
            for i in range(num_requests)]


def safe_token_pool(tokenizer: Any, vocab_size: int | None = None) -> list[int]:
    """Token ids safe to put in a synthetic prompt: inside the vocabulary, and not special or added tokens.

    Args:
        tokenizer: a transformers tokenizer.
        vocab_size: the model's vocabulary size when it differs from the tokenizer's (ids stay below both).
    """
    size = len(tokenizer)
    if vocab_size is not None:
        size = min(size, vocab_size)
    excluded = set(getattr(tokenizer, "all_special_ids", []) or [])
    excluded.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    pool = [i for i in range(size) if i not in excluded]
    if len(pool) < 2:
        raise ValueError(f"the tokenizer leaves only {len(pool)} ordinary token ids below {size}")
    return pool


def make_workload(
    name: str,
    tokenizer: Any,
    *,
    num_requests: int = 64,
    batch_size: int = 16,
    output_len: int = 64,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    seed: int = 0,
    vocab_size: int | None = None,
) -> Workload:
    """Build a named workload.

    - `batch1`: one request, a `prompt_len`-token prompt (32 by default), `output_len` output tokens.
    - `batch`: `batch_size` such requests.
    - `mixed`: `num_requests` requests, prompt and output lengths drawn uniformly from 16..256 (seeded).
    - `ttft`: one 256-token prompt, 1 output token.

    Args:
        name: one of `WORKLOADS`.
        tokenizer: its ordinary vocabulary supplies the prompt ids.
        num_requests: requests of the `mixed` workload.
        batch_size: requests of the `batch` workload, and static batching's batch size everywhere.
        output_len: output length of `batch1` and `batch`.
        prompt_len: prompt length of `batch1` and `batch`.
        seed: seeds the lengths (and, with the round index, the token ids).
        vocab_size: the model's vocabulary size (prompt ids stay below it).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    for label, value in (("num_requests", num_requests), ("batch_size", batch_size),
                         ("output_len", output_len), ("prompt_len", prompt_len)):
        if value < 1:
            raise ValueError(f"`{label}` must be >= 1, got {value}")
    pool = safe_token_pool(tokenizer, vocab_size)
    if name == "batch1":
        prompts, outputs = [prompt_len], [output_len]
    elif name == "batch":
        prompts, outputs = [prompt_len] * batch_size, [output_len] * batch_size
    elif name == "mixed":
        rng = random.Random(f"{seed}:mixed-lengths")
        prompts = [rng.randint(MIXED_MIN_LEN, MIXED_MAX_LEN) for _ in range(num_requests)]
        outputs = [rng.randint(MIXED_MIN_LEN, MIXED_MAX_LEN) for _ in range(num_requests)]
    else:  # ttft
        prompts, outputs = [TTFT_PROMPT_LEN], [1]
    return Workload(name, prompts, outputs, batch_size, pool, seed)


def default_baselines(workload: str) -> tuple[str, ...]:
    """The baselines that make sense against decodekit for a workload."""
    return {
        "batch1": ("hf-sequential",),
        "batch": ("hf-static",),
        "mixed": ("hf-static", "hf-cb"),
        "ttft": ("hf-sequential",),
    }[workload]
