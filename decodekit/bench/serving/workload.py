"""`bench serve`'s workload: seeded chat requests (prompts of varied lengths, mixed `max_tokens`, some greedy, some
sampled with a seed) and the warm-up's conversation."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly."
TOPICS = ("the ocean", "a violin", "Mount Everest", "bread", "the Moon", "a bicycle", "tea", "Paris", "volcanoes",
          "honey bees", "the printing press", "chess", "rainbows", "the Roman Empire", "coffee", "glaciers")
ASKS = ("What is special about {}?", "Explain {} to a ten-year-old.", "Give me three facts about {}.",
        "Write a short poem about {}.", "Summarize the history of {} in a few sentences.",
        "What are the pros and cons of {}?", "Write a short story about {}.", "Describe {} in one paragraph.")
NOTES = ("The Amazon rainforest covers much of northwestern Brazil and extends into Colombia and Peru.",
         "It is the largest tropical rainforest in the world, famed for its biodiversity.",
         "The river that drains the basin carries more water than any other river on Earth.",
         "Deforestation has cleared about a fifth of the forest since the 1970s.",
         "Bees communicate the direction of flowers with a dance inside the hive.",
         "The first printed books in Europe appeared in the middle of the fifteenth century.",
         "A glacier forms where more snow falls each winter than melts each summer.",
         "Tea was first drunk in China, as a medicine, thousands of years ago.",
         "The Moon is slowly drifting away from the Earth, by about four centimetres a year.",
         "Chess engines have beaten the best human players since the late 1990s.",
         "Volcanic soil is among the most fertile in the world.",
         "A violin has four strings tuned in fifths.")
MAX_TOKENS = (16, 32, 64, 96, 128, 192, 256)
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.7, 0.9
WARMUP_MESSAGES = ({"role": "user", "content": "Say hello."},)


@dataclass(frozen=True)
class ChatRequest:
    """One chat request: its conversation and decoding settings (`seed` None: greedy)."""

    messages: tuple[dict[str, str], ...]
    max_tokens: int
    seed: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        """Whether the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0

    def body(self, model: str, *, stream: bool = True) -> dict[str, Any]:
        """The `/v1/chat/completions` body (streamed with usage unless `stream` is False)."""
        body: dict[str, Any] = {"model": model, "messages": list(self.messages), "max_tokens": self.max_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "stream": stream}
        if self.seed is not None:
            body["seed"] = self.seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def make_chat_workload(num_requests: int = 64, seed: int = 0, *, sampled_share: float = 0.5, max_notes: int = 12,
                       max_tokens: Sequence[int] = MAX_TOKENS) -> list[ChatRequest]:
    """A seeded chat workload: questions about varied topics, some after 1 to `max_notes` sentences of notes (so
    prompts run from about 30 to 400 tokens), a quarter with a previous turn; `max_tokens` drawn from `max_tokens`;
    a `sampled_share` of the requests sampled (temperature 0.7, top-p 0.9, each with its own seed), the rest greedy.
    """
    if num_requests < 1:
        raise ValueError(f"`num_requests` must be >= 1, got {num_requests}")
    rng = random.Random(f"{seed}:serve-chat")
    requests = []
    for _ in range(num_requests):
        ask = rng.choice(ASKS).format(rng.choice(TOPICS))
        notes = rng.randint(0, max_notes) if max_notes > 0 else 0
        if notes:
            ask = "Here are some notes:\n" + " ".join(rng.sample(NOTES, min(notes, len(NOTES)))) + "\n\n" + ask
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        if rng.random() < 0.25:
            messages += [{"role": "user", "content": f"Hi! Can you tell me about {rng.choice(TOPICS)}?"},
                         {"role": "assistant", "content": "Of course. What would you like to know?"}]
        messages.append({"role": "user", "content": ask})
        limit = rng.choice(list(max_tokens))
        if rng.random() < sampled_share:
            requests.append(ChatRequest(tuple(messages), limit, rng.randrange(2**31), SAMPLED_TEMPERATURE,
                                        SAMPLED_TOP_P))
        else:
            requests.append(ChatRequest(tuple(messages), limit))
    return requests


__all__ = ["ChatRequest", "make_chat_workload"]
