"""Look at a decoding trace (`decodekit run RECIPE --trace FILE.jsonl`): in the terminal, and as one self-contained
HTML page.

`read_trace` reads the file (one JSON line per request: `{"id", "prompt", "outputs": [{"index", "text",
"token_ids", "finish_reason", "trace": [events...]}]}`, the events described in `decodekit/core/trace.py`) into
`TraceRequest`s, and names the line of anything it cannot read. `render_terminal` prints, per request and output,
the text with every token coloured by its probability and, for the steps asked for, the candidates stage by stage,
how each token was chosen, the drafts and the beam decisions; `write_html` writes the same as a page (inline CSS
and JavaScript, the data embedded as JSON, nothing fetched) on which clicking a token, or the arrow keys, shows its
step.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from decodekit.api.errors import ConfigError, DecodeKitError

__all__ = [
    "PROBABILITY_BINS",
    "TraceFileError",
    "TraceOutput",
    "TraceRequest",
    "TraceStep",
    "html_page",
    "only_sequence",
    "parse_steps",
    "probability_bin",
    "read_trace",
    "render_terminal",
    "select_requests",
    "stage_changes",
    "write_html",
]


class TraceFileError(DecodeKitError):
    """A trace file that cannot be read: missing, not JSON lines, or a line that is not a `--trace` row. The
    message names the file and the line."""


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
UNKNOWN_BIN = ("not in top N", "#e9ecef", "#adb5bd", "#dde1e5")


def probability_bin(p: float | None) -> int:
    """The index in `PROBABILITY_BINS` of probability `p`, or `len(PROBABILITY_BINS)` when `p` is unknown."""
    if p is None or math.isnan(p):
        return len(PROBABILITY_BINS)
    for i, (low, *_rest) in enumerate(PROBABILITY_BINS):
        if p >= low:
            return i
    return len(PROBABILITY_BINS) - 1


# ---------------------------------------------------------------------------------------------------- reading


@dataclass
class TraceStep:
    """One generated token's event: the token, how it was chosen, each stage's top candidates, and what the
    strategy did at this step (drafts, beams)."""

    index: int
    token: int
    text: str | None
    chosen_by: str
    strategy: str
    stages: list[dict[str, Any]]
    """`[{"stage": name, "top": [[id, text, p], ...]}, ...]`: the model first, then each processor stage."""
    drafts: dict[str, Any] | None = None
    beam: dict[str, Any] | None = None
    beams: dict[str, Any] | None = None

    @property
    def probability(self) -> float | None:
        """The chosen token's probability at the last stage (the distribution it was chosen from), or None when
        the trace does not hold it (no stage, or the token is not among the last stage's candidates)."""
        return self.stage_probability(len(self.stages) - 1) if self.stages else None

    def stage_probability(self, stage: int) -> float | None:
        """The chosen token's probability at stage `stage` (the stage's `p`; in older files, read off its
        candidates), or None when the trace does not hold it."""
        if self.stages[stage].get("p") is not None:
            return float(self.stages[stage]["p"])
        for cand in self.stages[stage]["top"]:
            if cand[0] == self.token:
                return float(cand[2])
        return None


@dataclass
class TraceOutput:
    """One returned sequence of a request: its text, its steps, and its stop event."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    steps: list[TraceStep]
    stop: dict[str, Any] | None
    """The last event, `{"finished": reason, "stop_reason": ..., "criterion": name}` (or with `"error"`), if any."""
    traced: bool = True
    """False when the row holds no trace for this output (the request did not ask, or failed first)."""


@dataclass
class TraceRequest:
    """One line of a trace file: a request and its outputs."""

    id: str
    prompt: Any
    error: str | None
    outputs: list[TraceOutput]
    line: int
    """The line of the file it came from (1-based)."""
    position: int = 0
    """Its position among the file's requests (0-based)."""
    token_texts: dict[int, str | None] = field(default_factory=dict)
    """Every token text the row names (tokens and candidates), by id: the texts of drafts the model rejected."""


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a `--trace` file: one request per non-blank line. Raises `TraceFileError` naming the line for a file
    that is missing, is not JSON lines, or holds a line that is not a trace row."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file (write one with `decodekit run RECIPE --trace {path}`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(f"{path}: cannot read it: {exc}") from None
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFileError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        requests.append(_request(row, where, number, len(requests)))
    if not requests:
        raise TraceFileError(f"{path}: no requests in it (an empty file)")
    return requests


def _request(row: Any, where: str, number: int, position: int) -> TraceRequest:
    if not isinstance(row, dict):
        raise TraceFileError(f"{where}: not a trace row (a JSON {type(row).__name__}, not an object)")
    if not isinstance(row.get("outputs"), list):
        hint = " (is this an --output file? write a trace with `decodekit run RECIPE --trace FILE`)"
        raise TraceFileError(f'{where}: no "outputs" list{hint if "token_ids" in row else ""}; a trace row is '
                             '{"id", "prompt", "outputs": [{"index", "text", "token_ids", "trace"}]}')
    texts: dict[int, str | None] = {}
    outputs = [_output(out, f"{where}: outputs[{i}]", i, texts) for i, out in enumerate(row["outputs"])]
    error = row.get("error")
    return TraceRequest(id=str(row.get("id", position + 1)), prompt=row.get("prompt"),
                        error=None if error is None else str(error), outputs=outputs, line=number,
                        position=position, token_texts=texts)


def _output(out: Any, where: str, position: int, texts: dict[int, str | None]) -> TraceOutput:
    if not isinstance(out, dict):
        raise TraceFileError(f"{where}: not an object")
    events = out.get("trace")
    if events is not None and not isinstance(events, list):
        raise TraceFileError(f'{where}: "trace" is not a list of events')
    steps: list[TraceStep] = []
    stop: dict[str, Any] | None = None
    for k, event in enumerate(events or []):
        if not isinstance(event, dict):
            raise TraceFileError(f"{where}.trace[{k}]: not an object")
        if "finished" in event:
            stop = event
        elif "token" in event:
            steps.append(_step(event, f"{where}.trace[{k}]", len(steps), texts))
        else:
            raise TraceFileError(f'{where}.trace[{k}]: neither a token event ("token") nor a stop event '
                                 '("finished")')
    token_ids = out.get("token_ids") or [s.token for s in steps]
    return TraceOutput(index=int(out.get("index", position)), text=str(out.get("text") or ""),
                       token_ids=list(token_ids), finish_reason=out.get("finish_reason"), steps=steps, stop=stop,
                       traced=events is not None)


def _step(event: dict[str, Any], where: str, position: int, texts: dict[int, str | None]) -> TraceStep:
    try:
        stages = event.get("stages") or []
        for stage in stages:
            for cand in stage["top"]:
                texts.setdefault(int(cand[0]), cand[1])
                cand[2] = float(cand[2]) if math.isfinite(float(cand[2])) else 0.0  # NaN cannot go into JSON
        token = int(event["token"])
        texts.setdefault(token, event.get("text"))
        return TraceStep(index=int(event.get("index", position)), token=token, text=event.get("text"),
                         chosen_by=str(event.get("chosen_by", "?")), strategy=str(event.get("strategy", "?")),
                         stages=stages, drafts=event.get("drafts"), beam=event.get("beam"),
                         beams=event.get("beams"))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TraceFileError(f"{where}: a malformed token event ({type(exc).__name__}: {exc})") from None


def select_requests(requests: list[TraceRequest], key: str | None) -> list[TraceRequest]:
    """The requests `key` names: a request id, else a 0-based position in the file; all of them for None. Raises
    `ConfigError` listing the ids when it names none."""
    if key is None:
        return requests
    by_id = [r for r in requests if r.id == key]
    if by_id:
        return by_id
    if key.lstrip("-").isdigit() and -len(requests) <= int(key) < len(requests):
        return [requests[int(key)]]
    ids = ", ".join(r.id for r in requests[:20]) + (", ..." if len(requests) > 20 else "")
    raise ConfigError(f"no request {key!r} in the trace: its ids are {ids} (or give a position, 0 to "
                      f"{len(requests) - 1})")


def only_sequence(requests: list[TraceRequest], sequence: int | None) -> list[TraceRequest]:
    """The requests with only their output `sequence` (all of them for None); a request without one keeps none."""
    if sequence is None:
        return requests
    return [replace(r, outputs=[o for o in r.outputs if o.index == sequence]) for r in requests]


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """`A:B` (B excluded, either may be left out) or a single `I` as `(start, stop)`. Raises `ConfigError`."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            one = int(parts[0])
            return one, one + 1
        if len(parts) == 2:
            return (int(parts[0]) if parts[0].strip() else None), (int(parts[1]) if parts[1].strip() else None)
    except ValueError:
        pass
    raise ConfigError(f"--steps {text!r}: give A:B (token indices, B excluded; A: or :B for an open end) or I")


# ---------------------------------------------------------------------------------------------------- analysis


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


def _draft_views(output: TraceOutput, texts: dict[int, str | None]) -> dict[int, dict[str, Any]]:
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


def _step_owner(output: TraceOutput, views: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Step position -> position of the step carrying the drafts of the speculative step it belongs to."""
    owner: dict[int, int] = {}
    for pos, view in views.items():
        for k in range(pos, view["last"] + 1):
            owner[k] = pos
    return owner


def _stats(output: TraceOutput) -> dict[str, Any]:
    probs = [p for p in (s.probability for s in output.steps) if p is not None]
    proposed = sum(len(s.drafts.get("proposed", [])) for s in output.steps if s.drafts)
    accepted = sum(int(s.drafts.get("accepted", 0)) for s in output.steps if s.drafts)
    proposers = sorted({str(s.drafts["proposer"]) for s in output.steps if s.drafts and s.drafts.get("proposer")})
    strategies = sorted({s.strategy for s in output.steps})
    return {"tokens": len(output.steps), "mean_p": sum(probs) / len(probs) if probs else None,
            "drafted": proposed, "accepted": accepted,
            "spec_steps": sum(1 for s in output.steps if s.drafts), "proposers": proposers,
            "strategies": strategies}


# ---------------------------------------------------------------------------------------------------- terminal


def _quoted(text: str | None, token: int | None = None) -> str:
    """A token's text for the terminal: quoted, with escapes for newlines and tabs (`' the'`, `'\\n'`)."""
    if text is None:
        return f"#{token}" if token is not None else "?"
    if "\ufffd" in text and token is not None:  # a partial UTF-8 byte decodes to U+FFFD alone: say which token
        return f"{text!r}#{token}"
    return repr(text)


def _pct(p: float | None) -> str:
    if p is None:
        return "?"
    if p <= 0:
        return "0"
    return f"{p * 100:.3g}%"


def _short_pct(p: float) -> str:
    v = p * 100
    if v <= 0:
        return "0"
    return f"{v:.0f}%" if v >= 9.95 else f"{v:.1f}%" if v >= 0.995 else f"{v:.2g}%"


def _strip_style(p: float | None, parity: int) -> str:
    b = probability_bin(p)
    colours = PROBABILITY_BINS[b][2:] if b < len(PROBABILITY_BINS) else UNKNOWN_BIN[1:]
    return f"black on {colours[0] if parity == 0 else colours[2]}"


def _legend() -> Text:
    legend = Text().append("p(token): ", style="dim")
    for _low, label, light, _strong, _alt in PROBABILITY_BINS:
        legend.append(f" {label} ", style=f"black on {light}")
        legend.append(" ")
    legend.append(f" {UNKNOWN_BIN[0]} ", style=f"black on {UNKNOWN_BIN[1]}")
    legend.append("  underlined: accepted draft", style="dim")
    return legend


def _token_strip(output: TraceOutput) -> Text:
    strip = Text()
    for k, step in enumerate(output.steps):
        text = step.text if step.text is not None else f"⟨{step.token}⟩"
        shown = text.replace("\n", "↵\n") if text else "∅"
        style = _strip_style(step.probability, k % 2)
        if step.chosen_by == "draft accepted":
            style += " underline"
        strip.append(shown, style=style)
    return strip


def _stop_line(stop: dict[str, Any] | None, texts: dict[int, str | None]) -> Text:
    line = Text().append("finished: ", style="bold")
    if stop is None:
        return line.append("no stop event (the trace ends without one)", style="dim")
    line.append(str(stop.get("finished")), style="bold magenta")
    if stop.get("criterion") is not None:
        line.append(f"  criterion {stop['criterion']}")
    reason = stop.get("stop_reason")
    if reason is not None:
        shown = f"{reason} {_quoted(texts[reason])}" if isinstance(reason, int) and reason in texts else repr(reason)
        line.append(f"  stop reason {shown}")
    if stop.get("error") is not None:
        line.append(f"  error: {stop['error']}", style="red")
    return line


def _draft_line(view: dict[str, Any]) -> Text:
    line = Text().append("drafts", style="bold")
    if view.get("proposer"):
        line.append(f" ({view['proposer']})")
    line.append(": ")
    for d in view["proposed"]:
        style = {"accepted": "green", "rejected": "red strike", "unverified": "dim strike"}[d["fate"]]
        line.append(_quoted(d["text"], d["id"]), style=style)
        line.append(" ")
    line.append(f"— {view['accepted']} of {len(view['proposed'])} accepted")
    rejected = next((d for d in view["proposed"] if d["fate"] == "rejected"), None)
    if rejected is not None:
        line.append(f"; the target refused {_quoted(rejected['text'], rejected['id'])}")
        if rejected.get("model_p") is not None:
            line.append(f" (model p {_pct(rejected['model_p'])})")
        if view["correction"] is not None:
            verb = "chose" if view["correction_by"] == "argmax" else "drew"
            line.append(f" and {verb} {_quoted(view['correction_text'], view['correction_id'])} (token "
                        f"{view['correction']}) instead")
    elif view["bonus"]:
        line.append("; the target added a token of its own")
    return line


def _beam_lines(step: TraceStep, texts: dict[int, str | None]) -> list[Any]:
    lines: list[Any] = []
    if step.beam:
        beam = step.beam
        line = Text().append("beam: ", style="bold")
        if beam.get("parent") is not None:
            line.append(f"continues beam {beam['parent']} of the previous step")
        if beam.get("index") is None:
            line.append(" · finished here")
            if beam.get("final_score") is not None:
                line.append(f" with final score {beam['final_score']:.4g}")
        else:
            line.append(f" → beam {beam['index']} now")
        if beam.get("score") is not None:
            line.append(f", running score {beam['score']:.4g}")
        lines.append(line)
    if step.beams:
        table = Table(box=box.SIMPLE_HEAD, title="beam search at this step", title_justify="left",
                      title_style="bold", pad_edge=False)
        for col in ("from beam", "token", "score", "fate"):
            table.add_column(col)
        parent = (step.beam or {}).get("parent")
        for cand in step.beams.get("candidates", []):
            fate = str(cand.get("fate"))
            style = {"kept": "green", "finished": "cyan", "dropped": "dim strike"}.get(fate, "")
            mine = cand.get("token") == step.token and (parent is None or cand.get("parent") == parent)
            score = cand.get("score")
            table.add_row(str(cand.get("parent")), _quoted(cand.get("text"), cand.get("token")),
                          f"{score:.4g}" if isinstance(score, (int, float)) else str(score),
                          fate + (" ← this sequence" if mine else ""), style=style + (" bold" if mine else ""))
        lines.append(table)
        pruned = step.beams.get("pruned") or []
        if pruned:
            lines.append(Text(f"pruned beams (no continuation kept): {', '.join(str(p) for p in pruned)}",
                              style="dim"))
    return lines


def _cell(step: TraceStep, cand: list[Any], new: bool) -> Text:
    tid, text, p = cand[:3]
    cell = Text(_quoted(text, tid))
    cell.append(f" {_short_pct(p)}", style="dim" if tid != step.token else "")
    if new:
        cell.append(" new", style="cyan")
    if tid == step.token:
        cell.stylize("bold reverse")
    return cell


def _visible(stage: dict[str, Any]) -> list[list[Any]]:
    """A stage's candidates without the zero-probability fillers a truncating stage leaves in its top N."""
    return [c for c in stage["top"] if c[2] > 0]


def _change_note(step: TraceStep) -> Text | None:
    note = Text()
    for k in range(1, len(step.stages)):
        ch = stage_changes(step.stages[k - 1]["top"], step.stages[k]["top"], len(step.stages[0]["top"]))
        parts = []
        if ch["removed"]:
            parts.append("removed " + " ".join(_quoted(c[1], c[0]) for c in ch["removed"]))
        if ch["left"]:
            parts.append(f"pushed out of the top {len(step.stages[k]['top'])} "
                         + " ".join(_quoted(c[1], c[0]) for c in ch["left"]))
        if ch["moved"]:
            parts.append(f"{len(ch['moved'])} moved")
        if parts:
            note.append(" · " if note else "", style="dim")
            note.append(f"{step.stages[k]['stage']}: ", style="bold")
            note.append(", ".join(parts))
    return note or None


def _stage_table(step: TraceStep, width: int) -> Table | Text:
    """Each stage's candidates side by side (stages as columns, ranks as rows), or one line per stage when the
    table would not fit in `width` columns."""
    shown = [_visible(stage) for stage in step.stages]
    previous: list[set[int]] = [set()] + [{c[0] for c in top} for top in shown[:-1]]
    cells = [[_cell(step, c, k > 0 and c[0] not in previous[k]) for c in top] for k, top in enumerate(shown)]
    widths = [max([len(step.stages[k]["stage"])] + [c.cell_len for c in col]) for k, col in enumerate(cells)]
    if sum(widths) + 3 * len(widths) + 4 > width:
        lines = Text()
        for k, col in enumerate(cells):
            lines.append(("\n" if k else "") + step.stages[k]["stage"] + ": ", style="bold")
            for j, cell in enumerate(col):
                lines.append("  " if j else "")
                lines.append_text(cell)
        return lines
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("#", style="dim", justify="right")
    for stage in step.stages:
        table.add_column(stage["stage"], no_wrap=True)
    for rank in range(max((len(col) for col in cells), default=0)):
        table.add_row(str(rank + 1), *(col[rank] if rank < len(col) else "" for col in cells))
    return table


def _pipeline(step: TraceStep) -> Text:
    line = Text().append("p(chosen): ", style="dim")
    for k, stage in enumerate(step.stages):
        if k:
            line.append(" → ", style="dim")
        line.append(f"{stage['stage']} ")
        line.append(_pct(step.stage_probability(k)), style="bold")
    return line


def _render_step(console: Console, step: TraceStep, pos: int, output: TraceOutput,
                 views: dict[int, dict[str, Any]], owner: dict[int, int], texts: dict[int, str | None]) -> None:
    head = Text().append(f"token {step.index} ", style="bold")
    head.append(_quoted(step.text, step.token), style=_strip_style(step.probability, 0) + " bold")
    head.append(f"  id {step.token}  p {_pct(step.probability)}  ")
    head.append(step.chosen_by, style="bold cyan")
    head.append(f" · strategy {step.strategy}", style="dim")
    console.print(head)
    if step.stages:
        console.print(_pipeline(step))
    if pos in owner:
        view = views[owner[pos]]
        if owner[pos] != pos:
            console.print(Text(f"from the speculative step of tokens {output.steps[view['first']].index} to "
                               f"{output.steps[view['last']].index}:", style="dim"))
        console.print(_draft_line(view))
    for line in _beam_lines(step, texts):
        console.print(line)
    if step.stages:
        console.print(_stage_table(step, console.width))
        note = _change_note(step)
        if note is not None:
            console.print(note)
    else:
        console.print(Text("no candidates recorded for this token", style="dim"))
    if pos == len(output.steps) - 1:
        console.print(_stop_line(output.stop, texts))
    console.print()


def render_terminal(requests: list[TraceRequest], console: Console | None = None, *, sequence: int | None = None,
                    token: int | None = None, steps: tuple[int | None, int | None] | None = None,
                    show_all: bool = False, lowest: int = 5) -> None:
    """Print each request's outputs: the text with each token coloured by its probability (the chosen token's
    probability at the last stage), a summary (mean probability, the `lowest` least likely tokens, drafts), and
    the stop event. Steps are shown in detail (each stage's candidates, how the token was chosen, drafts, beam
    decisions) for token `token`, for the token indices `steps` (`(start, stop)`, stop excluded), or for every token
    with `show_all`. `sequence` keeps only that output of each request."""
    console = console or Console()
    if console.color_system is not None:
        console.print(_legend())
    for request in requests:
        console.print()
        title = Text().append(f"request {request.id}", style="bold")
        title.append(f"  (line {request.line})", style="dim")
        console.print(title)
        prompt = request.prompt if isinstance(request.prompt, str) else json.dumps(request.prompt)
        if prompt is not None:
            short = prompt if len(prompt) <= 240 else prompt[:240] + " [...]"
            console.print(f"[bold cyan]>>>[/] {escape(short)}", soft_wrap=True, highlight=False)
        if request.error:
            console.print(f"[red]error: {escape(request.error)}[/]", soft_wrap=True)
        outputs = [o for o in request.outputs if sequence is None or o.index == sequence]
        if not outputs:
            console.print(f"[yellow]no output {sequence} in this request[/]")
        for output in outputs:
            _render_output(console, request, output, token=token, steps=steps, show_all=show_all, lowest=lowest)


def _render_output(console: Console, request: TraceRequest, output: TraceOutput, *, token: int | None,
                   steps: tuple[int | None, int | None] | None, show_all: bool, lowest: int) -> None:
    stats = _stats(output)
    head = Text().append(f"output {output.index}", style="bold")
    head.append(f" · {stats['tokens']} tokens · {', '.join(stats['strategies']) or '-'}"
                f" · finish {output.finish_reason}", style="dim")
    console.print(head)
    if not output.traced:
        console.print(escape(output.text), soft_wrap=True, highlight=False)
        console.print(Text("no trace recorded for this output (run with --trace)", style="dim"))
        return
    console.print(_token_strip(output), soft_wrap=False)
    texts = request.token_texts
    if stats["mean_p"] is not None:
        console.print(f"mean p {_pct(stats['mean_p'])}", highlight=False)
    ranked = sorted((s for s in output.steps if s.probability is not None), key=lambda s: s.probability or 0)
    if ranked and lowest:
        least = Text("least likely: ")
        for k, s in enumerate(ranked[:lowest]):
            least.append(" · " if k else "", style="dim")
            least.append(f"{s.index} ", style="dim")
            least.append(_quoted(s.text, s.token), style=_strip_style(s.probability, 0))
            least.append(f" {_pct(s.probability)}")
        console.print(least)
    if stats["drafted"]:
        rate = stats["accepted"] / stats["drafted"]
        proposers = f" ({', '.join(stats['proposers'])})" if stats["proposers"] else ""
        console.print(f"drafts{proposers}: {stats['accepted']} of {stats['drafted']} accepted ({rate:.1%}) over "
                      f"{stats['spec_steps']} speculative steps", highlight=False)
    console.print(_stop_line(output.stop, texts))
    if not (show_all or token is not None or steps is not None):
        if output.steps:
            console.print(Text("details of a step: --token I, --steps A:B or --all", style="dim"))
        return
    views = _draft_views(output, texts)
    owner = _step_owner(output, views)
    wanted = [(pos, s) for pos, s in enumerate(output.steps)
              if show_all or (token is not None and s.index == token)
              or (steps is not None and (steps[0] is None or s.index >= steps[0])
                  and (steps[1] is None or s.index < steps[1]))]
    if not wanted:
        console.print(f"[yellow]no such token in this output (its tokens are 0 to {len(output.steps) - 1})[/]")
    console.print()
    for pos, step in wanted:
        _render_step(console, step, pos, output, views, owner, texts)


# ---------------------------------------------------------------------------------------------------- HTML


def _page_data(requests: list[TraceRequest], title: str, source: str | None,
               select: dict[str, Any] | None) -> dict[str, Any]:
    bins = [{"low": low, "label": label, "light": light, "strong": strong}
            for low, label, light, strong, _alt in PROBABILITY_BINS]
    bins.append({"low": None, "label": UNKNOWN_BIN[0], "light": UNKNOWN_BIN[1], "strong": UNKNOWN_BIN[2]})
    rows = []
    for request in requests:
        outputs = []
        for output in request.outputs:
            views = _draft_views(output, request.token_texts)
            owner = _step_owner(output, views)
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
                            "traced": output.traced, "stats": _stats(output), "tokens": tokens, "stop": stop})
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
    parts = {"TITLE": _html_escape(title), "CSS": _CSS, "JS": _JS,
             "DATA": _script_json(_page_data(requests, title, source, select))}
    return re.sub(r"\{\{(TITLE|CSS|JS|DATA)\}\}", lambda m: parts[m.group(1)], _PAGE)


def write_html(requests: list[TraceRequest], path: str | Path, *, title: str | None = None,
               source: str | None = None, select: dict[str, Any] | None = None) -> Path:
    """Write `html_page(requests, ...)` to `path` (UTF-8) and return the path. The title defaults to the source
    file's name."""
    path = Path(path)
    page = html_page(requests, title=title or (f"decodekit trace · {Path(source).name}" if source else
                                               "decodekit trace"), source=source, select=select)
    path.write_text(page, encoding="utf-8")
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy"
      content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>{{TITLE}}</title>
<style>{{CSS}}</style>
</head>
<body>
<header id="top"><div class="brand"><span class="logo">◆</span> <span id="title"></span></div>
<div id="summary" class="muted"></div><div id="legend"></div></header>
<main id="layout"><section id="requests" aria-label="requests"></section>
<aside id="details" aria-live="polite"></aside></main>
<noscript><p class="noscript">This page draws the trace with JavaScript; the data is in the page source.</p></noscript>
<script type="application/json" id="trace-data">{{DATA}}</script>
<script>{{JS}}</script>
</body>
</html>
"""

_CSS = """
:root {
  --bg: #f4f5f8; --card: #ffffff; --ink: #1b2030; --muted: #69718a; --line: #e3e6ee; --accent: #4263eb;
  --accent-soft: #edf2ff; --ok: #2b8a3e; --bad: #e03131; --warn: #e8590c;
  --mono: ui-monospace, "SFMono-Regular", "DejaVu Sans Mono", Menlo, Consolas, monospace;
  --sans: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", "Liberation Sans", sans-serif;
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--ink); font: 14px/1.45 var(--sans); }
header#top { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 18px; padding: 12px 20px;
  background: #1b2030; color: #f1f3f9; }
.brand { font-weight: 650; font-size: 15px; letter-spacing: .2px; }
.logo { color: #91a7ff; }
header .muted { color: #aab2c8; }
#legend { margin-left: auto; display: flex; gap: 4px; align-items: center; flex-wrap: wrap; font-size: 12px; }
#legend .sw { padding: 1px 7px; border-radius: 4px; color: #1b2030; }
#legend .lab { color: #aab2c8; margin-right: 4px; }
#legend .draftkey { color: #1b2030; background: #fff; border-radius: 4px; padding: 1px 7px;
  text-decoration: underline dashed var(--accent) 2px; text-underline-offset: 3px; margin-left: 6px; }
main#layout { display: grid; grid-template-columns: minmax(0, 1fr) 470px; gap: 16px; padding: 16px 20px;
  align-items: start; }
@media (max-width: 980px) { main#layout { grid-template-columns: 1fr; } }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 14px 16px;
  margin-bottom: 14px; box-shadow: 0 1px 2px rgba(20, 30, 60, .04); }
.req-head { display: flex; align-items: baseline; gap: 10px; margin-bottom: 6px; }
.req-head h2 { font-size: 14px; margin: 0; }
.muted { color: var(--muted); }
.small { font-size: 12px; }
details.prompt { margin: 4px 0 10px; }
details.prompt summary { cursor: pointer; color: var(--muted); font-size: 12.5px; white-space: nowrap;
  overflow: hidden; text-overflow: ellipsis; }
details[open].prompt .preview { display: none; }
details.prompt pre { white-space: pre-wrap; font: 12.5px/1.45 var(--mono); background: #f8f9fc;
  border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; margin: 6px 0 0; max-height: 240px;
  overflow: auto; }
.out { border-top: 1px solid var(--line); padding-top: 10px; margin-top: 10px; }
.out:first-of-type { border-top: none; margin-top: 0; padding-top: 0; }
.out-head { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin-bottom: 8px; font-size: 12.5px; }
.pill { display: inline-block; padding: 1px 8px; border-radius: 999px; background: #f1f3f5; color: #3b4256;
  font-size: 12px; white-space: nowrap; }
.pill.accent { background: var(--accent-soft); color: var(--accent); }
.pill.ok { background: #ebfbee; color: var(--ok); }
.pill.bad { background: #fff5f5; color: var(--bad); }
.tokens { font: 14.5px/1.9 var(--mono); white-space: pre-wrap; word-break: break-word; }
.tok { border-radius: 3px; padding: 1px 0; margin: 0 1px 0 0; cursor: pointer; outline-offset: 1px;
  box-shadow: inset -1px 0 0 rgba(255, 255, 255, .9); }
.tok:hover { outline: 2px solid rgba(66, 99, 235, .45); }
.tok.draft { text-decoration: underline dashed var(--accent) 1.5px; text-underline-offset: 4px; }
.tok.sel { outline: 2.5px solid var(--accent); background-image: none; position: relative; z-index: 1; }
.tok.inspec { box-shadow: inset 0 -3px 0 rgba(66, 99, 235, .35); }
.tok.empty { color: var(--muted); }
.spark { display: flex; align-items: flex-end; gap: 1px; height: 34px; margin-top: 10px; padding: 3px 0 0;
  border-bottom: 1px solid var(--line); }
.sb { flex: 1 1 0; max-width: 9px; height: 100%; display: flex; align-items: flex-end; cursor: pointer;
  border-radius: 2px 2px 0 0; }
.sb:hover { background: rgba(66, 99, 235, .12); }
.sbf { width: 100%; border-radius: 2px 2px 0 0; opacity: .85; }
.sb.sel { background: rgba(66, 99, 235, .18); box-shadow: 0 0 0 1.5px var(--accent); }
.sb.sel .sbf { opacity: 1; }
.stopchip { display: inline-block; font: 12px/1.5 var(--sans); margin-left: 6px; padding: 0 8px; border-radius: 999px;
  background: #1b2030; color: #fff; cursor: pointer; vertical-align: 1px; }
.stopchip.sel { outline: 2.5px solid var(--accent); outline-offset: 1px; }
.stopchip.error { background: var(--bad); }
aside#details { position: sticky; top: 12px; max-height: calc(100vh - 24px); overflow: auto; }
aside .hint { color: var(--muted); }
.kbd { font: 11px var(--mono); border: 1px solid #cfd4e0; border-bottom-width: 2px; border-radius: 4px;
  padding: 0 4px; background: #fff; }
.d-head { display: flex; align-items: center; gap: 10px; flex-wrap: wrap; }
.d-tok { font: 600 20px/1.3 var(--mono); padding: 2px 10px; border-radius: 6px; }
.d-p { font-size: 20px; font-weight: 650; }
.d-sub { margin: 6px 0 2px; display: flex; flex-wrap: wrap; gap: 6px; }
h3 { font-size: 11.5px; text-transform: uppercase; letter-spacing: .7px; color: var(--muted); margin: 16px 0 6px; }
.flow { display: flex; flex-wrap: wrap; gap: 4px; align-items: center; font-size: 12px; }
.flow .arrow { color: #adb5bd; }
.flow .st { background: #f1f3f5; border-radius: 6px; padding: 1px 7px; }
.flow .st b { font-variant-numeric: tabular-nums; }
.stage { border: 1px solid var(--line); border-radius: 8px; padding: 6px 10px 7px; margin-bottom: 7px; }
.stage-head { display: flex; justify-content: space-between; align-items: baseline; gap: 8px; margin-bottom: 5px; }
.stage-name { font-weight: 650; font-family: var(--mono); font-size: 12.5px; }
.changes { font-size: 11.5px; color: var(--muted); text-align: right; }
.row { display: grid; grid-template-columns: 118px minmax(0, 1fr) 58px 62px; gap: 8px; align-items: center;
  font-size: 12.5px; line-height: 1.3; padding: 1px 4px; border-radius: 5px; }
.row.chosen { background: var(--accent-soft); box-shadow: inset 3px 0 0 var(--accent); font-weight: 650; }
.row.zero { color: #adb5bd; }
.row.zero .chip { text-decoration: line-through; }
.chip { font-family: var(--mono); white-space: pre; overflow: hidden; text-overflow: ellipsis; }
.ws { color: #adb5bd; }
.bar { height: 10px; background: #f1f3f5; border-radius: 5px; overflow: hidden; }
.fill { height: 100%; border-radius: 5px; min-width: 1px; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
.delta { text-align: right; font-size: 11px; font-variant-numeric: tabular-nums; }
.delta.up { color: var(--ok); } .delta.down { color: var(--bad); } .delta.new { color: var(--accent); }
.gone { margin-top: 5px; font-size: 11.5px; display: flex; flex-wrap: wrap; gap: 4px; align-items: center; }
.gone .chip { background: #fff5f5; color: var(--bad); border-radius: 4px; padding: 0 5px;
  text-decoration: line-through; }
.gone .chip.left { background: #f1f3f5; color: var(--muted); text-decoration: none; }
.drafts { display: flex; flex-wrap: wrap; gap: 5px; align-items: center; }
.dchip { font: 13px/1.6 var(--mono); border-radius: 5px; padding: 0 7px; border: 1px solid transparent;
  white-space: pre; }
.dchip.accepted { background: #ebfbee; color: var(--ok); border-color: #b2f2bb; }
.dchip.rejected { background: #fff5f5; color: var(--bad); border-color: #ffc9c9; text-decoration: line-through; }
.dchip.unverified { background: #f8f9fa; color: #adb5bd; text-decoration: line-through; }
.dchip.here { outline: 2px solid var(--accent); outline-offset: 1px; }
.dchip .mark { font: 600 11px var(--sans); margin-right: 4px; text-decoration: none; display: inline-block; }
.note { font-size: 12.5px; margin-top: 6px; }
table.beams { border-collapse: collapse; width: 100%; font-size: 12.5px; }
table.beams th { text-align: left; font-weight: 600; color: var(--muted); border-bottom: 1px solid var(--line);
  padding: 3px 6px; }
table.beams td { padding: 3px 6px; border-bottom: 1px solid #f1f3f5; }
table.beams tr.mine td { background: var(--accent-soft); font-weight: 650; }
.fate { border-radius: 999px; padding: 0 7px; font-size: 11.5px; }
.fate.kept { background: #ebfbee; color: var(--ok); }
.fate.finished { background: #e7f5ff; color: #1971c2; }
.fate.dropped { background: #f8f9fa; color: #868e96; text-decoration: line-through; }
.kv { display: grid; grid-template-columns: 120px 1fr; gap: 3px 10px; font-size: 13px; }
.kv .k { color: var(--muted); }
.err { color: var(--bad); }
.noscript { padding: 20px; }
"""

_JS = r"""
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("trace-data").textContent);
  var ITEMS = [];   // every selectable thing, in page order: {r, o, k (token position or -1 for stop), el}
  var current = -1;

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function add(parent, child) { parent.appendChild(child); return child; }
  function pct(p) {
    if (p === null || p === undefined) return "?";
    if (p <= 0) return "0";
    return Number((p * 100).toPrecision(3)).toString() + "%";
  }
  function binOf(p) {
    if (p === null || p === undefined) return DATA.bins.length - 1;
    for (var i = 0; i < DATA.bins.length - 1; i++) if (p >= DATA.bins[i].low) return i;
    return DATA.bins.length - 2;
  }
  // a token's text made visible: spaces as a dim middle dot, newlines and tabs as arrows
  function chip(text, id, cls) {
    var c = el("span", "chip" + (cls ? " " + cls : ""));
    if (text === null || text === undefined) { c.textContent = "#" + id; c.title = "token id " + id; return c; }
    if (text === "") { add(c, el("span", "ws", "∅")); c.title = "empty text, token id " + id; return c; }
    var run = "";
    function flush() { if (run) { c.appendChild(document.createTextNode(run)); run = ""; } }
    for (var i = 0; i < text.length; i++) {
      var ch = text[i], sym = ch === " " ? "·" : ch === "\n" ? "↵" : ch === "\t" ? "⇥" : ch === "\r" ? "␍" : null;
      if (sym) { flush(); add(c, el("span", "ws", sym)); } else run += ch;
    }
    flush();
    if (text.indexOf("\ufffd") >= 0) add(c, el("span", "ws", "#" + id));  // a partial UTF-8 byte: say which
    c.title = JSON.stringify(text) + "  (id " + id + ")";
    return c;
  }

  function quote(text) { return text === null || text === undefined ? "?" : text === "" ? "∅" : "‘" + text + "’"; }

  function legend() {
    var box = document.getElementById("legend");
    add(box, el("span", "lab", "p(token)"));
    DATA.bins.forEach(function (b) {
      var s = add(box, el("span", "sw", b.label));
      s.style.background = b.light;
    });
    add(box, el("span", "draftkey", "accepted draft"));
  }

  function summary() {
    document.getElementById("title").textContent = DATA.title;
    document.title = DATA.title;
    var n = 0;
    DATA.requests.forEach(function (r) { r.outputs.forEach(function (o) { n += o.tokens.length; }); });
    document.getElementById("summary").textContent = DATA.requests.length + " request" +
      (DATA.requests.length === 1 ? "" : "s") + " · " + n + " tokens · click a token, or use ← →";
  }

  function stopLabel(stop) {
    if (!stop) return "no stop event";
    var s = "■ " + stop.finished;
    if (stop.criterion) s += " · " + stop.criterion;
    return s;
  }

  function buildRequests() {
    var root = document.getElementById("requests");
    DATA.requests.forEach(function (r, ri) {
      var card = add(root, el("div", "card"));
      var head = add(card, el("div", "req-head"));
      add(head, el("h2", null, "request " + r.id));
      add(head, el("span", "muted small", "line " + r.line));
      if (r.prompt !== null && r.prompt !== undefined) {
        var det = add(card, el("details", "prompt"));
        det.open = r.prompt.length <= 320 && DATA.requests.length <= 3;  // short prompts open, for context
        var sum = add(det, el("summary", null, "prompt"));
        add(sum, el("span", "preview", ": " + r.prompt.replace(/\s+/g, " ")));
        add(det, el("pre", null, r.prompt));
      }
      if (r.error) add(card, el("div", "err", "error: " + r.error));
      r.outputs.forEach(function (o, oi) {
        var box = add(card, el("div", "out"));
        box.id = "r" + ri + "o" + oi;
        var oh = add(box, el("div", "out-head"));
        add(oh, el("b", null, "output " + o.index));
        add(oh, el("span", "pill", o.stats.tokens + " tokens"));
        o.stats.strategies.forEach(function (s) { add(oh, el("span", "pill accent", s)); });
        if (o.stats.mean_p !== null) add(oh, el("span", "pill", "mean p " + pct(o.stats.mean_p)));
        if (o.stats.drafted) {
          add(oh, el("span", "pill ok", o.stats.accepted + " of " + o.stats.drafted + " drafts accepted" +
            (o.stats.proposers.length ? " (" + o.stats.proposers.join(", ") + ")" : "")));
        }
        add(oh, el("span", "pill" + (o.finish_reason === "error" ? " bad" : ""), "finish " + o.finish_reason));
        var strip = add(box, el("div", "tokens"));
        if (!o.traced) {
          strip.textContent = o.text;
          add(box, el("div", "muted small", "no trace recorded for this output"));
          return;
        }
        o.tokens.forEach(function (t, k) {
          var text = t.text === null ? "⟨" + t.id + "⟩" : t.text === "" ? "∅" : t.text.replace(/\n/g, "↵\n");
          var span = add(strip, el("span", "tok" + (t.by === "draft accepted" ? " draft" : "") +
                                           (t.text === "" || t.text === null ? " empty" : ""), text));
          span.style.backgroundColor = DATA.bins[t.bin].light;
          span.title = "token " + t.i + " · p " + pct(t.p) + " · " + t.by;
          span.dataset.item = String(ITEMS.length);
          ITEMS.push({r: ri, o: oi, k: k, el: span});
        });
        var sc = add(strip, el("span", "stopchip" + (o.stop && o.stop.finished === "error" ? " error" : ""),
                               stopLabel(o.stop)));
        sc.dataset.item = String(ITEMS.length);
        ITEMS.push({r: ri, o: oi, k: -1, el: sc});
        if (o.tokens.length > 1) spark(box, o, ITEMS.length - 1 - o.tokens.length);
      });
    });
    root.addEventListener("click", function (ev) {
      var t = ev.target.closest("[data-item]");
      if (t) select(Number(t.dataset.item), true);
    });
  }

  // one bar per token, its height the token's probability: where the output was unsure, at a glance
  function spark(box, o, first) {
    var chart = add(box, el("div", "spark"));
    chart.title = "p of each token";
    o.tokens.forEach(function (t, k) {
      var cell = add(chart, el("div", "sb"));
      var bar = add(cell, el("div", "sbf"));
      bar.style.height = (t.p === null ? 100 : Math.max(4, t.p * 100)) + "%";
      bar.style.background = t.p === null ? DATA.bins[t.bin].light : DATA.bins[t.bin].strong;
      cell.dataset.item = String(first + k);
      cell.title = "token " + t.i + " · p " + pct(t.p);
      ITEMS[first + k].bar = cell;
    });
  }

  // ---- the details panel
  function section(panel, title) { add(panel, el("h3", null, title)); }

  function kv(box, k, v, cls) { add(box, el("div", "k", k)); return add(box, el("div", cls || "v", v)); }

  function stopDetails(panel, o) {
    var s = o.stop;
    var box = add(panel, el("div", "kv"));
    if (!s) { kv(box, "stop", "the trace ends without a stop event"); return; }
    kv(box, "finished", s.finished);
    kv(box, "criterion", s.criterion === undefined ? "(not recorded)" : s.criterion);
    if (s.stop_reason !== undefined && s.stop_reason !== null) {
      var v = kv(box, "stop reason", "");
      if (typeof s.stop_reason === "number") {
        v.appendChild(chip(s.stop_reason_text === undefined ? null : s.stop_reason_text, s.stop_reason));
        add(v, el("span", "muted", "  (token " + s.stop_reason + ")"));
      } else v.textContent = JSON.stringify(s.stop_reason);
    }
    if (s.error) kv(box, "error", s.error, "err");
    kv(box, "finish_reason", o.finish_reason);
  }

  function draftDetails(panel, o, t, k) {
    var owner = o.tokens[t.spec];
    var d = owner.drafts;
    section(panel, "drafts" + (d.proposer ? " · proposer " + d.proposer : ""));
    var row = add(panel, el("div", "drafts"));
    d.proposed.forEach(function (p, j) {
      var c = add(row, el("span", "dchip " + p.fate));
      add(c, el("span", "mark", p.fate === "accepted" ? "✓" : p.fate === "rejected" ? "✗" : ""));
      c.appendChild(chip(p.text, p.id));
      if (p.fate === "accepted" && t.spec + j === k) c.classList.add("here");
      c.title = p.fate + (p.model_p !== undefined && p.model_p !== null ? " · model p " + pct(p.model_p) : "");
    });
    var note = d.accepted + " of " + d.proposed.length + " accepted";
    var rej = d.proposed.filter(function (p) { return p.fate === "rejected"; })[0];
    if (rej) {
      note += "; the target refused " + quote(rej.text === null ? "#" + rej.id : rej.text);
      if (rej.model_p !== undefined && rej.model_p !== null) note += " (model p " + pct(rej.model_p) + ")";
      if (d.correction !== null) {
        note += " and " + (o.tokens[d.last].by === "argmax" ? "chose " : "drew ") + quote(d.correction_text) +
          " (token " + d.correction + ") instead";
      }
    } else if (d.bonus) note += "; the target added one token of its own";
    add(panel, el("div", "note muted", note + ". One forward pass produced " + (d.last > d.first ? "tokens " +
      o.tokens[d.first].i + "–" + o.tokens[d.last].i : "token " + o.tokens[d.first].i) + "."));
  }

  function beamDetails(panel, t) {
    section(panel, "beam search");
    if (t.beam) {
      var b = t.beam, s = "";
      if (b.parent !== undefined && b.parent !== null) s += "continues beam " + b.parent + " of the previous step";
      if (b.index === null || b.index === undefined) {
        s += (s ? "; " : "") + "finished here";
        if (b.final_score !== undefined && b.final_score !== null) s += ", final score " + b.final_score.toFixed(4);
      } else s += (s ? " → " : "") + "beam " + b.index + " now";
      if (b.score !== undefined && b.score !== null) s += " · running score " + Number(b.score).toFixed(4);
      add(panel, el("div", "note", s));
    }
    if (t.beams) {
      var table = add(panel, el("table", "beams"));
      var hr = add(add(table, el("thead")), el("tr"));
      ["from beam", "token", "score", "fate"].forEach(function (h) { add(hr, el("th", null, h)); });
      var body = add(table, el("tbody"));
      (t.beams.candidates || []).forEach(function (c) {
        var mine = c.token === t.id && (!t.beam || t.beam.parent === undefined || c.parent === t.beam.parent);
        var tr = add(body, el("tr", mine ? "mine" : null));
        add(tr, el("td", null, c.parent));
        add(tr, el("td")).appendChild(chip(c.text, c.token));
        add(tr, el("td", "num", typeof c.score === "number" ? c.score.toFixed(4) : c.score));
        var f = add(tr, el("td"));
        add(f, el("span", "fate " + c.fate, c.fate + (mine ? " · this sequence" : "")));
      });
      if (t.beams.pruned && t.beams.pruned.length) {
        add(panel, el("div", "note muted", "pruned (no continuation kept): beam" +
          (t.beams.pruned.length > 1 ? "s " : " ") + t.beams.pruned.join(", ")));
      }
    }
  }

  function stageDetails(panel, t) {
    section(panel, "candidates, stage by stage");
    if (!t.stages.length) { add(panel, el("div", "muted", "no candidates recorded for this token")); return; }
    var flow = add(panel, el("div", "flow"));
    t.stages.forEach(function (s, i) {
      if (i) add(flow, el("span", "arrow", "→"));
      var st = add(flow, el("span", "st", s.stage + " "));
      var p = (s.p === undefined) ? null : s.p;  // the chosen token's own p (older files: read off the top N)
      if (p === null) s.top.forEach(function (c) { if (c[0] === t.id) p = c[2]; });
      add(st, el("b", null, pct(p)));
    });
    add(panel, el("div", "muted small", "p of the chosen token after each stage")).style.margin = "3px 0 8px";
    t.stages.forEach(function (s, i) {
      var box = add(panel, el("div", "stage"));
      var head = add(box, el("div", "stage-head"));
      add(head, el("span", "stage-name", s.stage));
      var ch = s.changes;
      var bits = [];
      if (!i) bits.push("the model's top " + s.top.length);
      else {
        if (ch.removed.length) bits.push(ch.removed.length + " removed");
        if (ch.added.length) bits.push(ch.added.length + " new");
        if (ch.left.length) bits.push(ch.left.length + " pushed out");
        if (ch.moved.length) bits.push(ch.moved.length + " moved");
        if (!bits.length) bits.push("same order");
      }
      add(head, el("span", "changes", bits.join(" · ")));
      s.top.forEach(function (c, rank) {
        if (c[2] <= 0) return;  // the zero-probability fillers a truncating stage leaves in its top N
        var r = add(box, el("div", "row" + (c[0] === t.id ? " chosen" : "") + (c[2] <= 0 ? " zero" : "")));
        r.appendChild(chip(c[1], c[0]));
        var bar = add(r, el("div", "bar"));
        var fill = add(bar, el("div", "fill"));
        fill.style.width = Math.max(0, Math.min(100, c[2] * 100)) + "%";
        fill.style.background = DATA.bins[binOf(c[2])].strong;
        add(r, el("div", "num", pct(c[2])));
        var dl = add(r, el("div", "delta"));
        if (i && c[2] > 0) {
          if (c[3] === null || c[3] === undefined) { dl.textContent = "new"; dl.classList.add("new"); }
          else {
            var d = (c[2] - c[3]) * 100;
            var move = c[4] !== null && c[4] !== undefined ? c[4] - rank : 0;
            dl.textContent = (move > 0 ? "↑" + move + " " : move < 0 ? "↓" + (-move) + " " : "") +
              (Math.abs(d) < 0.05 ? "=" : (d > 0 ? "+" : "−") + Math.abs(d).toFixed(1));
            dl.classList.add(d > 0.05 ? "up" : d < -0.05 ? "down" : "same");
            dl.title = "was " + pct(c[3]) + " at the previous stage";
          }
        }
        if (c[0] === t.id) r.title = "the chosen token";
      });
      if (i && (ch.removed.length || ch.left.length)) {
        var g = add(box, el("div", "gone"));
        if (ch.removed.length) {
          add(g, el("span", "muted", "removed:"));
          ch.removed.forEach(function (c) { g.appendChild(chip(c[1], c[0])); });
        }
        if (ch.left.length) {
          add(g, el("span", "muted", "pushed out of the top " + s.top.length + ":"));
          ch.left.forEach(function (c) { g.appendChild(chip(c[1], c[0], "left")); });
        }
      }
      var chosenHere = s.top.some(function (c) { return c[0] === t.id; });
      if (!chosenHere) add(box, el("div", "note muted", "the chosen token is not in this stage's top " + s.top.length));
    });
  }

  function render(item) {
    var panel = document.getElementById("details");
    panel.textContent = "";
    var card = add(panel, el("div", "card"));
    var r = DATA.requests[item.r], o = r.outputs[item.o];
    var where = "request " + r.id + " · output " + o.index;
    if (item.k < 0) {
      var hs = add(card, el("div", "d-head"));
      add(hs, el("span", "d-p", "stop"));
      add(hs, el("span", "muted", where + " · after " + o.tokens.length + " tokens"));
      section(card, "how the sequence ended");
      stopDetails(card, o);
      return;
    }
    var t = o.tokens[item.k];
    var head = add(card, el("div", "d-head"));
    var tok = add(head, el("span", "d-tok"));
    tok.appendChild(chip(t.text, t.id));
    tok.style.background = DATA.bins[t.bin].light;
    add(head, el("span", "d-p", pct(t.p)));
    add(head, el("span", "muted small", "token " + t.i + " of " + o.tokens.length + " · id " + t.id));
    var sub = add(card, el("div", "d-sub"));
    add(sub, el("span", "pill accent", t.by));
    add(sub, el("span", "pill", "strategy " + t.strategy));
    add(sub, el("span", "pill", where));
    if (t.spec !== undefined) draftDetails(card, o, t, item.k);
    if (t.beam || t.beams) beamDetails(card, t);
    stageDetails(card, t);
    if (item.k === o.tokens.length - 1) { section(card, "then the sequence stopped"); stopDetails(card, o); }
  }

  function select(n, fromUser) {
    if (n < 0 || n >= ITEMS.length) return;
    if (current >= 0) {
      ITEMS[current].el.classList.remove("sel");
      if (ITEMS[current].bar) ITEMS[current].bar.classList.remove("sel");
    }
    document.querySelectorAll(".tok.inspec").forEach(function (e) { e.classList.remove("inspec"); });
    current = n;
    var item = ITEMS[n];
    item.el.classList.add("sel");
    if (item.bar) item.bar.classList.add("sel");
    var o = DATA.requests[item.r].outputs[item.o];
    if (item.k >= 0 && o.tokens[item.k].spec !== undefined) {  // mark the tokens of the same forward pass
      var d = o.tokens[o.tokens[item.k].spec].drafts;
      ITEMS.forEach(function (it) {
        if (it.r === item.r && it.o === item.o && it.k >= d.first && it.k <= d.last) it.el.classList.add("inspec");
      });
    }
    render(item);
    if (fromUser) {
      item.el.scrollIntoView({block: "nearest"});
      var r = DATA.requests[item.r];
      var hash = "request=" + encodeURIComponent(r.id) + "&output=" + o.index +
        (item.k < 0 ? "&stop" : "&token=" + o.tokens[item.k].i);
      try { history.replaceState(null, "", "#" + hash); } catch (e) { /* file:// in some browsers */ }
    }
  }

  function find(want) {
    for (var n = 0; n < ITEMS.length; n++) {
      var it = ITEMS[n], r = DATA.requests[it.r], o = r.outputs[it.o];
      if (want.request !== null && want.request !== undefined && r.id !== String(want.request)) continue;
      if (want.output !== null && want.output !== undefined && o.index !== Number(want.output)) continue;
      if (want.stop && it.k < 0) return n;
      if (!want.stop && it.k >= 0 && o.tokens[it.k].i === Number(want.token)) return n;
    }
    return -1;
  }

  function fromHash() {
    var h = new URLSearchParams(location.hash.replace(/^#/, ""));
    if (!h.has("token") && !h.has("stop")) return null;
    return {request: h.get("request"), output: h.get("output"), token: h.get("token"), stop: h.has("stop")};
  }

  function hint() {
    var panel = document.getElementById("details");
    var card = add(panel, el("div", "card"));
    add(card, el("div", "d-p", "How was each token chosen?"));
    var p = add(card, el("p", "hint"));
    p.textContent = "Click a token to see its candidates after the model and after each processor, how it was " +
      "chosen, the drafts a speculative step proposed and what beam search kept. Colours are the chosen " +
      "token's probability at the last stage.";
    var k = add(card, el("p", "hint"));
    add(k, el("span", "kbd", "←")); k.appendChild(document.createTextNode(" "));
    add(k, el("span", "kbd", "→")); k.appendChild(document.createTextNode(" previous / next token   "));
    add(k, el("span", "kbd", "↑")); k.appendChild(document.createTextNode(" "));
    add(k, el("span", "kbd", "↓")); k.appendChild(document.createTextNode(" previous / next output"));
  }

  document.addEventListener("keydown", function (ev) {
    if (ev.altKey || ev.ctrlKey || ev.metaKey) return;
    var it = ITEMS[current];
    if (ev.key === "ArrowRight" || ev.key === "ArrowLeft") {
      select(current < 0 ? 0 : current + (ev.key === "ArrowRight" ? 1 : -1), true);
    } else if ((ev.key === "ArrowDown" || ev.key === "ArrowUp") && it) {
      var step = ev.key === "ArrowDown" ? 1 : -1, n = current;
      while (n >= 0 && n < ITEMS.length && ITEMS[n].r === it.r && ITEMS[n].o === it.o) n += step;
      if (n < 0 || n >= ITEMS.length) return;
      var target = ITEMS[n], first = n;
      while (first - 1 >= 0 && ITEMS[first - 1].r === target.r && ITEMS[first - 1].o === target.o) first--;
      var last = first;
      while (last + 1 < ITEMS.length && ITEMS[last + 1].r === target.r && ITEMS[last + 1].o === target.o) last++;
      select(Math.min(first + Math.max(it.k, 0), last), true);
    } else if (ev.key === "Home" && it) {
      var a = current; while (a - 1 >= 0 && ITEMS[a - 1].r === it.r && ITEMS[a - 1].o === it.o) a--; select(a, true);
    } else if (ev.key === "End" && it) {
      var b = current;
      while (b + 1 < ITEMS.length && ITEMS[b + 1].r === it.r && ITEMS[b + 1].o === it.o) b++;
      select(b, true);
    } else return;
    ev.preventDefault();
  });

  summary();
  legend();
  buildRequests();
  var want = fromHash() || DATA.select;
  var start = want ? find(want) : -1;
  if (start >= 0) { select(start, false); ITEMS[start].el.scrollIntoView({block: "center"}); } else hint();
  window.addEventListener("hashchange", function () {
    var w = fromHash(), n = w ? find(w) : -1;
    if (n >= 0 && n !== current) select(n, false);
  });
  document.body.dataset.ready = String(ITEMS.length);
})();
"""
