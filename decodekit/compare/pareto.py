"""The Pareto view of a comparison: for each quality metric with a better side, the points no other point beats on
both speed (tokens/s, higher is better) and that metric; over every point of the run, and within each recipe's own
sweep (its best settings)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Scored:
    """One point's place in a Pareto view: its label, its recipe, its speed and its quality figure."""

    label: str
    recipe: str
    speed: float
    quality: float


def frontier(points: Sequence[Scored], higher_is_better: bool) -> list[str]:
    """The labels of the points that no other point dominates (at least as fast and at least as good, and better on
    one of the two), fastest first. Points with the same figures are all kept."""
    sign = 1.0 if higher_is_better else -1.0

    def dominates(a: Scored, b: Scored) -> bool:
        at_least = a.speed >= b.speed and sign * a.quality >= sign * b.quality
        return at_least and (a.speed > b.speed or sign * a.quality > sign * b.quality)

    kept = [p for p in points if not any(dominates(q, p) for q in points)]
    return [p.label for p in sorted(kept, key=lambda p: (-p.speed, -sign * p.quality, p.label))]


def pareto_view(points: Sequence[Scored], higher_is_better: bool) -> dict[str, object]:
    """The frontier over every point (`all`) and within each recipe (`by_recipe`)."""
    recipes = dict.fromkeys(p.recipe for p in points)
    return {"all": frontier(points, higher_is_better),
            "by_recipe": {r: frontier([p for p in points if p.recipe == r], higher_is_better) for r in recipes}}
