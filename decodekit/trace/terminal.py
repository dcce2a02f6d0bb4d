"""The terminal view of a trace (`decodekit trace FILE`): per request and output, the text with every token coloured
by its probability, a summary and the stop; for the steps asked for, the candidates stage by stage, how each token
was chosen, the drafts and the beam decisions (`render_terminal`)."""

from __future__ import annotations

import json
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from decodekit.trace.analysis import (
    PROBABILITY_BINS,
    UNKNOWN_BIN,
    draft_views,
    output_stats,
    probability_bin,
    stage_changes,
    step_owner,
)
from decodekit.trace.format import TraceOutput, TraceRequest, TraceStep

__all__ = ["render_terminal"]


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
    stats = output_stats(output)
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
    views = draft_views(output, texts)
    owner = step_owner(output, views)
    wanted = [(pos, s) for pos, s in enumerate(output.steps)
              if show_all or (token is not None and s.index == token)
              or (steps is not None and (steps[0] is None or s.index >= steps[0])
                  and (steps[1] is None or s.index < steps[1]))]
    if not wanted:
        console.print(f"[yellow]no such token in this output (its tokens are 0 to {len(output.steps) - 1})[/]")
    console.print()
    for pos, step in wanted:
        _render_step(console, step, pos, output, views, owner, texts)
