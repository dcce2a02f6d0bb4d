"""The report's plots, drawn with matplotlib as SVG to be inlined in the page (its text drawn as paths: no font, no
script, no network needed to show them), from the report's document alone:

- per quality figure with a better side: tokens/s against it, one colour per recipe, each recipe's sweep joined
  in order, the points of the run's Pareto frontier ringed;
- the output lengths of every point (box plots);
- each point's tokens/s and TTFT.
"""

from __future__ import annotations

import io
import math
from typing import Any

from decodekit.api.errors import ConfigError

PALETTE = ("#4263eb", "#e8590c", "#2b8a3e", "#ae3ec9", "#e03131", "#1098ad", "#f08c00", "#5c940d", "#862e9c")


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--html needs matplotlib, which is not installed: pip install 'decodekit[eval]'") from None
    matplotlib.use("Agg", force=True)  # no display: the figures only become SVG text
    matplotlib.rcParams.update({"svg.hashsalt": "decodekit", "svg.fonttype": "path", "font.size": 9,
                                "axes.spines.top": False, "axes.spines.right": False})
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    fig.clf()
    pyplot().close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # the page inlines the element: no XML prolog, no DOCTYPE


def _ok_points(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in document["points"] if p["status"] == "ok"]


def _colours(document: dict[str, Any]) -> dict[str, str]:
    recipes = dict.fromkeys(p["recipe"] for p in document["points"])
    return {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(recipes)}


def figure_value(point: dict[str, Any], name: str) -> float | None:
    """A point's quality figure `name` (a metric, or `accuracy:TASK`) from the document."""
    if name.startswith("accuracy:"):
        return next(iter((point["tasks"].get(name.split(":", 1)[1]) or {}).values()), None)
    figure = point["quality"].get(name)
    return figure.get("value") if figure else None


def tradeoff_plot(document: dict[str, Any], name: str, higher_is_better: bool) -> str | None:
    """Tokens/s against quality figure `name`; None when no point has both."""
    plt = pyplot()
    colours = _colours(document)
    frontier = set(document["pareto"].get(name, {}).get("all", []))
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    drawn = False
    for recipe, colour in colours.items():
        rows = [(p, figure_value(p, name)) for p in _ok_points(document) if p["recipe"] == recipe]
        rows = [(p, v) for p, v in rows if v is not None and p["speed"].get("tokens_per_s") is not None]
        if not rows:
            continue
        drawn = True
        xs = [p["speed"]["tokens_per_s"] for p, _ in rows]
        ys = [v for _, v in rows]
        ax.plot(xs, ys, "-o", color=colour, label=recipe, markersize=5, linewidth=1.2, alpha=.9)
        for (p, v), x in zip(rows, xs):
            if p["label"] in frontier:
                ax.plot([x], [v], "o", markersize=11, markerfacecolor="none", markeredgecolor="#1b2030")
            if p["sweep"]:
                ax.annotate(", ".join(str(s) for s in p["sweep"].values()), (x, v), fontsize=7,
                            xytext=(4, 4), textcoords="offset points", color="#495057")
    if not drawn:
        plt.close(fig)
        return None
    arrow = "↑ better" if higher_is_better else "↓ better"
    ax.set_xlabel("tokens/s  → faster")
    ax.set_ylabel(f"{name}  ({arrow})")
    ax.set_title(f"speed vs {name}", fontsize=10)
    ax.grid(alpha=.25)
    ax.legend(fontsize=7, frameon=False)
    return _svg(fig)


def length_plot(document: dict[str, Any]) -> str | None:
    """The distribution of output lengths at every point (box plots); None without the `length` metric."""
    rows = [(p["label"], p["quality"].get("length", {}).get("values") or []) for p in _ok_points(document)]
    rows = [(label, values) for label, values in rows if values]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.6, 0.55 * len(rows) + 1.5), 3.2))
    ax.boxplot([v for _, v in rows], showmeans=True)
    ax.set_xticks(range(1, len(rows) + 1), [label for label, _ in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("tokens per output")
    ax.set_title("output lengths", fontsize=10)
    ax.grid(alpha=.25, axis="y")
    return _svg(fig)


def speed_plot(document: dict[str, Any]) -> str | None:
    """Each point's tokens/s (bars) and TTFT p50 (dots, right axis); None when no point has a speed."""
    rows = [p for p in _ok_points(document) if p["speed"].get("tokens_per_s") is not None]
    if not rows:
        return None
    plt = pyplot()
    colours = _colours(document)
    fig, ax = plt.subplots(figsize=(max(4.6, 0.55 * len(rows) + 1.5), 3.2))
    xs = range(len(rows))
    ax.bar(xs, [p["speed"]["tokens_per_s"] for p in rows], color=[colours[p["recipe"]] for p in rows], alpha=.85)
    ax.set_xticks(list(xs), [p["label"] for p in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title("speed", fontsize=10)
    ttft = [p["speed"].get("ttft_p50_s") for p in rows]
    if any(t is not None for t in ttft):
        right = ax.twinx()
        right.plot(list(xs), [t * 1000 if t is not None else math.nan for t in ttft], "o", color="#1b2030")
        right.set_ylabel("TTFT p50 (ms, dots)")
        right.spines["right"].set_visible(True)
    return _svg(fig)
