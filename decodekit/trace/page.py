"""The HTML page of a trace (`decodekit trace FILE --html PAGE`): one self-contained file on which clicking a token,
or the arrow keys, shows its step.

The page's markup, style and script are this package's data files `page.html`, `page.css` and `page.js` (kept
apart so that each is read, and checked, as what it is: tests/trace/test_trace_view.py parses them). `html_page` fills
the markup's four slots: `{{TITLE}}` (escaped), `{{CSS}}` and `{{JS}}` (inlined: nothing is fetched) and `{{DATA}}`,
the trace as JSON in a `<script type="application/json">` element, escaped so that no token text can end it.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from decodekit.trace.analysis import (
    PROBABILITY_BINS,
    UNKNOWN_BIN,
    draft_views,
    output_stats,
    probability_bin,
    stage_changes,
    step_owner,
)
from decodekit.trace.format import TraceRequest

__all__ = ["PAGE_FILES", "html_page", "page_file", "write_html"]

PAGE_FILES = ("page.html", "page.css", "page.js")
"""The page's data files in this package: the markup (with the slots), the style, the script."""
_SLOT = re.compile(r"\{\{(TITLE|CSS|JS|DATA)\}\}")


@functools.cache
def page_file(name: str) -> str:
    """The text of the page's data file `name` (one of `PAGE_FILES`), read once through `importlib.resources` so
    that an installed wheel, a zip or a source checkout all serve it."""
    if name not in PAGE_FILES:
        raise ValueError(f"{name!r} is not one of the page's files {PAGE_FILES}")
    return resources.files("decodekit.trace").joinpath(name).read_text(encoding="utf-8")


def _page_data(requests: list[TraceRequest], title: str, source: str | None,
               select: dict[str, Any] | None) -> dict[str, Any]:
    """What page.js draws, computed here once so that the script only lays it out: the colour scale, and per token
    its stages with each candidate's probability and rank at the stage before, what each stage changed, its drafts'
    fates and its beams."""
    bins = [{"low": low, "label": label, "light": light, "strong": strong}
            for low, label, light, strong, _alt in PROBABILITY_BINS]
    bins.append({"low": None, "label": UNKNOWN_BIN[0], "light": UNKNOWN_BIN[1], "strong": UNKNOWN_BIN[2]})
    rows = []
    for request in requests:
        outputs = []
        for output in request.outputs:
            views = draft_views(output, request.token_texts)
            owner = step_owner(output, views)
            tokens = []
            for pos, step in enumerate(output.steps):
                stages = []
                for k, stage in enumerate(step.stages):
                    prev = {c[0]: (r, c[2]) for r, c in enumerate(step.stages[k - 1]["top"])} if k else {}
                    top = [[c[0], c[1], c[2], prev.get(c[0], (None, None))[1], prev.get(c[0], (None, None))[0]]
                           for c in stage["top"]]
                    entry: dict[str, Any] = {"stage": stage["stage"], "top": top, "p": step.stage_probability(k)}
                    if k:
                        entry["changes"] = stage_changes(step.stages[k - 1]["top"], stage["top"],
                                                         len(step.stages[0]["top"]))
                    stages.append(entry)
                p = step.probability
                token: dict[str, Any] = {"i": step.index, "id": step.token, "text": step.text, "p": p,
                                         "bin": probability_bin(p), "by": step.chosen_by, "strategy": step.strategy,
                                         "stages": stages}
                if pos in owner:
                    token["spec"] = owner[pos]
                if pos in views:
                    token["drafts"] = views[pos]
                if step.beam is not None:
                    token["beam"] = step.beam
                if step.beams is not None:
                    token["beams"] = step.beams
                tokens.append(token)
            stop = dict(output.stop) if output.stop is not None else None
            if stop is not None and isinstance(stop.get("stop_reason"), int):
                stop["stop_reason_text"] = request.token_texts.get(stop["stop_reason"])
            outputs.append({"index": output.index, "text": output.text, "finish_reason": output.finish_reason,
                            "traced": output.traced, "stats": output_stats(output), "tokens": tokens, "stop": stop})
        prompt = request.prompt if isinstance(request.prompt, str) or request.prompt is None else json.dumps(
            request.prompt)
        rows.append({"id": request.id, "prompt": prompt, "error": request.error, "line": request.line,
                     "outputs": outputs})
    return {"title": title, "source": source, "bins": bins, "requests": rows, "select": select}


def _script_json(data: Any) -> str:
    """JSON that is safe inside a `<script>` element: no `<`, `>` or `&` (so no `</script>` and no `<!--`), and
    no U+2028/U+2029."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, default=str)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                          ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


def _html_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def html_page(requests: list[TraceRequest], *, title: str = "decodekit trace", source: str | None = None,
              select: dict[str, Any] | None = None) -> str:
    """The HTML page of `requests`, self-contained: inline CSS and JavaScript, the data embedded as JSON in a
    `<script type="application/json">` element, no network. `select` (`{"request": id, "output": index, "token":
    i}`) is the token selected when the page opens; a URL fragment such as `#token=12` or
    `#request=2&output=0&token=12` overrides it."""
    parts = {"TITLE": _html_escape(title), "CSS": page_file("page.css"), "JS": page_file("page.js"),
             "DATA": _script_json(_page_data(requests, title, source, select))}
    # one pass over the markup only: a slot's name inside the style, the script or the data stays as it is
    return _SLOT.sub(lambda m: parts[m.group(1)], page_file("page.html"))


def write_html(requests: list[TraceRequest], path: str | Path, *, title: str | None = None,
               source: str | None = None, select: dict[str, Any] | None = None) -> Path:
    """Write `html_page(requests, ...)` to `path` (UTF-8) and return the path. The title defaults to the source
    file's name."""
    path = Path(path)
    page = html_page(requests, title=title or (f"decodekit trace · {Path(source).name}" if source else
                                               "decodekit trace"), source=source, select=select)
    path.write_text(page, encoding="utf-8")
    return path
