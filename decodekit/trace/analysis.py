"""What both views of a trace compute from it: the colour scale of token probabilities (`PROBABILITY_BINS`,
`probability_bin`), what each processor stage did to the candidates (`stage_changes`), the fate of each drafted
token (`draft_views`, `step_owner`) and an output's figures (`output_stats`)."""

from __future__ import annotations

import math
from typing import Any

from decodekit.trace.format import TraceOutput

__all__ = [
    "PROBABILITY_BINS",
    "UNKNOWN_BIN",
    "draft_views",
    "output_stats",
    "probability_bin",
    "stage_changes",
    "step_owner",
]


# (lowest probability, label, light background, strong colour, second light shade for the terminal strip)
PROBABILITY_BINS: tuple[tuple[float, str, str, str, str], ...] = (
    (0.9, "≥ 90%", "#c9efd2", "#2f9e44", "#b2e6bf"),
    (0.6, "60–90%", "#e3f4bd", "#74b816", "#d3ec9e"),
    (0.3, "30–60%", "#fff0b3", "#f2b705", "#ffe48a"),
    (0.1, "10–30%", "#ffd8a8", "#f76707", "#ffc78a"),
    (0.0, "< 10%", "#ffc9c9", "#e03131", "#ffb0b0"),
)
"""The colour scale of token probabilities, highest first: `(lowest p, label, background, bar colour, alternate
background)`. A token whose probability the trace does not hold is grey."""
UNKNOWN_BIN: tuple[str, str, str, str] = ("not in top N", "#e9ecef", "#adb5bd", "#dde1e5")
"""The colour of a token whose probability the trace does not hold: `(label, background, bar colour, alternate
background)`."""


def probability_bin(p: float | None) -> int:
    """The index in `PROBABILITY_BINS` of probability `p`, or `len(PROBABILITY_BINS)` when `p` is unknown."""
    if p is None or math.isnan(p):
        return len(PROBABILITY_BINS)
    for i, (low, *_rest) in enumerate(PROBABILITY_BINS):
        if p >= low:
            return i
    return len(PROBABILITY_BINS) - 1


def stage_changes(previous: list[list[Any]], top: list[list[Any]], keep: int | None = None
                  ) -> dict[str, list[list[Any]]]:
    """What one stage did to the candidates it got, from both stages' top lists (`[id, text, p]` each):
    `removed` (candidates the stage set to probability 0), `left` (candidates pushed out of the top N, not
    necessarily removed), `added` (candidates new to the top N) and `moved` (`[id, text, old rank, new rank]`,
    0-based, for candidates in both lists whose rank changed). `keep` is N (the model stage's length): a stage that
    lists fewer has removed the rest."""
    before = {c[0]: (rank, c) for rank, c in enumerate(previous) if c[2] > 0}
    after = {c[0]: (rank, c) for rank, c in enumerate(top)}
    # every surviving candidate is listed when the stage lists fewer than N, or (older files) pads with zeros
    complete = (keep is not None and len(top) < keep) or any(c[2] <= 0 for c in top)
    removed: list[list[Any]] = []
    left: list[list[Any]] = []
    moved: list[list[Any]] = []
    for tid, (rank, cand) in before.items():
        if tid in after and after[tid][1][2] <= 0:
            removed.append(cand)
        elif tid not in after:
            (removed if complete else left).append(cand)
        elif after[tid][0] != rank:
            moved.append([tid, cand[1], rank, after[tid][0]])
    added = [c for c in top if c[2] > 0 and c[0] not in before]
    return {"removed": removed, "left": left, "added": added, "moved": moved}


def draft_views(output: TraceOutput, texts: dict[int, str | None]) -> dict[int, dict[str, Any]]:
    """For each step that carries drafts (by its position in `output.steps`): the proposed tokens with their fate
    (`accepted`, `rejected`: the first the target refused, `unverified`: after it), the proposer, and which steps
    the speculative step produced."""
    views: dict[int, dict[str, Any]] = {}
    for pos, step in enumerate(output.steps):
        drafts = step.drafts
        if not drafts:
            continue
        proposed = [int(t) for t in drafts.get("proposed", [])]
        accepted = int(drafts.get("accepted", 0))
        last = min(pos + accepted, len(output.steps) - 1)  # the correction (or bonus) token, unless cut by a stop
        correction = output.steps[pos + accepted] if pos + accepted < len(output.steps) else None
        tokens = []
        for k, tid in enumerate(proposed):
            fate = "accepted" if k < accepted else "rejected" if k == accepted else "unverified"
            view: dict[str, Any] = {"id": tid, "text": texts.get(tid), "fate": fate}
            if fate == "rejected" and correction is not None and correction.stages:
                view["model_p"] = next((c[2] for c in correction.stages[0]["top"] if c[0] == tid), None)
            tokens.append(view)
        views[pos] = {"proposer": drafts.get("proposer"), "proposed": tokens, "accepted": accepted,
                      "first": pos, "last": last,
                      "correction": None if correction is None or accepted >= len(proposed) else correction.index,
                      "correction_id": None if correction is None else correction.token,
                      "correction_text": None if correction is None else correction.text,
                      "correction_by": None if correction is None else correction.chosen_by,
                      "bonus": correction is not None and accepted >= len(proposed)}
    return views


def step_owner(output: TraceOutput, views: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Step position -> position of the step carrying the drafts of the speculative step it belongs to."""
    owner: dict[int, int] = {}
    for pos, view in views.items():
        for k in range(pos, view["last"] + 1):
            owner[k] = pos
    return owner


def output_stats(output: TraceOutput) -> dict[str, Any]:
    """An output's figures: `tokens`, `mean_p` (the mean over its tokens whose probability the trace holds; None
    when it holds none), `drafted` and `accepted` draft tokens over `spec_steps` speculative steps, the `proposers`
    and `strategies` (sorted)."""
    probs = [p for p in (s.probability for s in output.steps) if p is not None]
    proposed = sum(len(s.drafts.get("proposed", [])) for s in output.steps if s.drafts)
    accepted = sum(int(s.drafts.get("accepted", 0)) for s in output.steps if s.drafts)
    proposers = sorted({str(s.drafts["proposer"]) for s in output.steps if s.drafts and s.drafts.get("proposer")})
    strategies = sorted({s.strategy for s in output.steps})
    return {"tokens": len(output.steps), "mean_p": sum(probs) / len(probs) if probs else None,
            "drafted": proposed, "accepted": accepted,
            "spec_steps": sum(1 for s in output.steps if s.drafts), "proposers": proposers,
            "strategies": strategies}
