"""The self-contained HTML report of a comparison (`decodekit compare --html FILE`): the table, the plots
(`decodekit.compare.plots`, inline SVG) and the Pareto frontier, in one file that needs no network and no script.

The page's markup and style are this package's data files `report.html` and `report.css`, filled here from the
report's document (`decodekit.compare.report.report_document`), so a saved JSON file can be drawn again.
"""

from __future__ import annotations

import functools
import html
import re
from importlib import resources
from pathlib import Path
from typing import Any

from decodekit.compare.plots import length_plot, speed_plot, tradeoff_plot
from decodekit.compare.report import comparison_table

PAGE_FILES = ("report.html", "report.css")
_SLOT = re.compile(r"\{\{([A-Z]+)\}\}")


@functools.cache
def page_file(name: str) -> str:
    """The text of the report's data file `name` (one of `PAGE_FILES`)."""
    if name not in PAGE_FILES:
        raise ValueError(f"{name!r} is not one of the report's files {PAGE_FILES}")
    return resources.files("decodekit.compare").joinpath(name).read_text(encoding="utf-8")


def _table(document: dict[str, Any]) -> str:
    table = comparison_table(document)
    head = "".join(f'<th class="{"name" if i == 0 else ""}">{html.escape(h)}</th>'
                   for i, h in enumerate(table.headers))
    body = []
    for label, cells, best, frontier in table.rows:
        name = f'<td class="name">{html.escape(label)}</td>'
        if isinstance(cells, str):
            body.append(f'<tr>{name}<td class="failed" colspan="{len(table.headers) - 1}">{html.escape(cells)}</td>'
                        "</tr>")
            continue
        tds = "".join(f'<td class="{"best" if i in best else "missing" if c in ("-", "n/a") else ""}">'
                      f"{html.escape(c)}</td>" for i, c in enumerate(cells))
        body.append(f'<tr class="{"frontier" if frontier else ""}">{name}{tds}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _pareto(document: dict[str, Any]) -> str:
    items = []
    for name, view in document["pareto"].items():
        labels = ", ".join(f"<code>{html.escape(label)}</code>" for label in view["all"])
        items.append(f"<li>tokens/s vs <b>{html.escape(name)}</b>: {labels}</li>")
    return f'<ul class="pareto">{"".join(items)}</ul>' if items else '<p class="muted">no quality figure to weigh</p>'


def _figures(svgs: list[str | None]) -> str:
    return "".join(f"<figure>{svg}</figure>" for svg in svgs if svg) or '<p class="muted">nothing to plot</p>'


def html_report(document: dict[str, Any], title: str = "decodekit compare") -> str:
    """The report page of a comparison document."""
    better = {f"accuracy:{t}": True for t in document["tasks"]}
    better.update({name: m["higher_is_better"] for name, m in document["metrics"].items()})
    tradeoffs = [tradeoff_plot(document, name, up) for name, up in better.items() if up is not None]
    ok = sum(p["status"] == "ok" for p in document["points"])
    summary = (f"{len(document['points'])} points ({ok} ran), {document['prompts']} prompts x {document['samples']} "
               f"samples, seed {document['seed']}" + (f", tasks {', '.join(document['tasks'])}" if document["tasks"]
                                                      else "") + f" · {document['wall_s']:.0f} s")
    notes = " · ".join(f"{name}: {m['description']} ({m['aggregate']})" for name, m in document["metrics"].items())
    parts = {"TITLE": html.escape(title), "CSS": page_file("report.css"), "SUMMARY": html.escape(summary),
             "TABLE": _table(document), "NOTES": html.escape(notes) + " · bold: the best of its column; ◆: on a "
             "Pareto frontier", "TRADEOFFS": _figures(tradeoffs),
             "DISTRIBUTIONS": _figures([length_plot(document), speed_plot(document)]), "PARETO": _pareto(document),
             "MACHINE": html.escape(f"{document['machine']} · {' '.join(document['command'])}")}
    return _SLOT.sub(lambda m: parts[m.group(1)], page_file("report.html"))


def write_html(document: dict[str, Any], path: Path, title: str = "decodekit compare") -> Path:
    """Write `html_report(document)` to `path` (UTF-8) and return the path."""
    path.write_text(html_report(document, title), encoding="utf-8")
    return path
