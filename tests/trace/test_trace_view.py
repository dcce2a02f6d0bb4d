"""`decodekit trace FILE`: the terminal view of a real trace (tiny models, and once through `decodekit run
--trace`), a synthetic trace with beam decisions and hostile token texts, the self-contained HTML page (and what a
real headless browser builds from it), the page's shipped files checked as markup, style and script, and clear
errors naming the line of a bad file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from decodekit import LLM, SamplingParams
from decodekit.api.errors import ConfigError
from decodekit.cli import app
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from decodekit.trace.analysis import probability_bin, stage_changes
from decodekit.trace.format import TraceFileError, read_trace, trace_row
from decodekit.trace.page import PAGE_FILES, html_page, page_file, write_html
from decodekit.trace.selection import parse_steps, select_requests
from decodekit.trace.terminal import render_terminal
from tests.helpers.browser import chromium
from tests.helpers.reference import random_prompts

ROOT = Path(__file__).parents[2]
HOSTILE = '</script><i id="pwn">&amp; "q" \'s\u2028<!--'


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def _text(requests, **kwargs) -> str:
    console = Console(record=True, width=110, file=open("/dev/null", "w"))  # noqa: SIM115
    render_terminal(requests, console, **kwargs)
    console.file.close()
    return console.export_text()


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory, llama, tokenizer) -> Path:
    """A trace file from a tiny model: a sampled request through four processor stages, a greedy speculative one
    (a draft model proposes, so there are drafts) and a beam search returning two hypotheses."""
    llm = LLM(llama, tokenizer, draft=llama, kv_cache_memory="16MiB", block_size=4)
    prompts = random_prompts(2, 5, 9, seed=41)
    sampled = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True, trace=6,
                             processors=[{"repetition_penalty": {"penalty": 1.2}}])
    spec = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, trace=3,
                          strategy={"speculative": {"proposer": "draft", "num_speculative_tokens": 3}})
    beam = SamplingParams(temperature=0, max_tokens=5, trace=3,
                          strategy={"beam_search": {"num_beams": 3, "num_return_sequences": 2}})
    outs = llm.generate([prompts[0], (prompts[1] * 3)[:20], prompts[1]], [sampled, spec, beam])
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    rows = [trace_row(rid, str(p), out) for rid, p, out in zip(("sampled", "spec", "beam"), [*prompts, prompts[1]],
                                                                outs)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _event(index, token, text, p, *, by="argmax", strategy="beam_search", **extra):
    stages = [{"stage": "model", "top": [[token, text, p], [99, "other", round(1 - p, 6)]]}]
    return {"index": index, "token": token, "text": text, "chosen_by": by, "strategy": strategy,
            "stages": stages, **extra}


@pytest.fixture
def synthetic_trace(tmp_path) -> Path:
    """Two requests written by hand: beam search with the beam keys the engine is gaining (a kept beam, a
    finished hypothesis, pruned beams) and a stop criterion; and a speculative output whose tokens have hostile
    texts, an older drafts record without a proposer, and an error stop."""
    beams0 = {"candidates": [{"parent": 0, "token": 10, "text": "A", "score": -0.1, "fate": "kept"},
                             {"parent": 0, "token": 11, "text": "B", "score": -2.3, "fate": "dropped"}],
              "pruned": []}
    beams1 = {"candidates": [{"parent": 0, "token": 12, "text": " cat", "score": -0.4, "fate": "kept"},
                             {"parent": 1, "token": 13, "text": " dog", "score": -0.9, "fate": "finished"},
                             {"parent": 0, "token": 14, "text": " <b>", "score": -5.0, "fate": "dropped"}],
              "pruned": [2, 3]}
    beam_trace = [
        _event(0, 10, "A", 0.9, beam={"parent": 0, "index": 0, "score": -0.1}, beams=beams0),
        _event(1, 12, " cat", 0.67, beam={"parent": 0, "index": 0, "score": -0.4}, beams=beams1),
        {"finished": "length", "stop_reason": None, "criterion": "max_tokens"},
    ]
    finished_trace = [
        _event(0, 10, "A", 0.9, beam={"parent": 0, "index": 1, "score": -0.1}, beams=beams0),
        _event(1, 13, " dog", 0.2, beam={"parent": 1, "index": None, "score": -0.9, "final_score": -0.45},
               beams=beams1),
        {"finished": "stop", "stop_reason": 2, "criterion": "eos"},
    ]
    spec_trace = [
        _event(0, 20, HOSTILE, 0.55, by="argmax", strategy="speculative"),
        _event(1, 21, "line\nbreak", 0.95, by="draft accepted", strategy="speculative",
               drafts={"proposed": [21, 22, 23], "accepted": 1}),
        _event(2, 24, "", 0.05, by="argmax", strategy="speculative"),
        _event(3, 25, None, 0.5, by="sampled, seed 4", strategy="speculative",
               drafts={"proposed": [26], "accepted": 0, "proposer": "ngram"}),
        {"finished": "error", "error": "a <plugin> & it \"failed\""},
    ]
    rows = [
        {"id": "beam", "prompt": "Once <upon>", "error": None, "outputs": [
            {"index": 0, "text": "A cat", "token_ids": [10, 12], "finish_reason": "length", "trace": beam_trace},
            {"index": 1, "text": "A dog", "token_ids": [10, 13], "finish_reason": "stop", "trace": finished_trace}]},
        {"id": "hostile", "prompt": HOSTILE, "error": None, "outputs": [
            {"index": 0, "text": "x", "token_ids": [20, 21, 24, 25], "finish_reason": "error", "trace": spec_trace}]},
    ]
    path = tmp_path / "synthetic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---- the terminal view ---------------------------------------------------------------------------------------------


def test_the_terminal_view_of_a_real_trace_shows_every_token_its_stages_and_the_stop(real_trace):
    requests = read_trace(real_trace)
    assert [r.id for r in requests] == ["sampled", "spec", "beam"]
    sampled, spec = (r.outputs[0] for r in requests[:2])
    assert len(sampled.steps) == 8 and len(spec.steps) == 10
    assert [s.token for s in sampled.steps] == sampled.token_ids
    assert sampled.stop is not None and sampled.stop["finished"] == "length" and sampled.stop["stop_reason"] is None
    for step in sampled.steps:  # the colour is the chosen token's probability at the last stage
        assert [s["stage"] for s in step.stages] == ["model", "repetition_penalty", "temperature", "top_k", "top_p"]
        assert step.probability is not None and 0 < step.probability <= 1
    text = _text(requests, steps=(2, 4))
    assert "request sampled" in text and "request spec" in text and "request beam" in text
    assert "output 0 · 8 tokens · sample" in text and "output 0 · 10 tokens · speculative" in text
    assert text.count("finished: length") >= 2 and "least likely:" in text
    for step in sampled.steps[2:4]:
        assert f"token {step.index} {step.text!r}" in text
    assert "token 1 " not in text and "token 4 " not in text  # only the steps asked for
    assert "p(chosen): model" in text and "→ top_p" in text
    assert "repetition_penalty" in text and "sampled, seed 3" in text
    drafted = sum(len(s.drafts["proposed"]) for s in spec.steps if s.drafts)
    accepted = sum(s.drafts["accepted"] for s in spec.steps if s.drafts)
    assert drafted > 0 and f"{accepted} of {drafted} accepted" in text
    beams = requests[2].outputs
    assert len(beams) == 2 and all(step.beam and step.beams for o in beams for step in o.steps)
    assert text.count("beam search at this step") == 2 * len(range(2, 4))  # both hypotheses, steps 2 and 3
    assert all(o.stop and o.stop.get("criterion") for o in beams)  # the stop event names what stopped it
    first_spec = next(s for s in spec.steps if s.drafts)
    detail = _text(requests, token=first_spec.index, sequence=0)
    assert f"{first_spec.drafts['accepted']} of {len(first_spec.drafts['proposed'])} accepted" in detail


def test_run_trace_then_trace_on_the_command_line(tmp_path):
    """`decodekit run RECIPE --trace FILE` on a tiny model saved to a folder, then `decodekit trace FILE`."""
    folder = tmp_path / "tiny"
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    tiny_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    trace = tmp_path / "trace.jsonl"
    sets = [f"model={folder}", "dtype=float32", "device=cpu", "engine.kv_cache_memory=16MiB", "sampling.max_tokens=6",
            "sampling.stop=[]"]
    result = _invoke("run", str(ROOT / "recipes" / "sampling.yaml"), *[a for s in sets for a in ("--set", s)],
                     "--trace", str(trace), "--quiet")
    assert result.exit_code == 0, result.output
    shown = _invoke("trace", str(trace), "--request", "1", "--token", "0")
    assert shown.exit_code == 0, shown.output
    assert "request 1" in shown.output and "request 2" not in shown.output
    assert "token 0 " in shown.output and "repetition_penalty" in shown.output and "top_p" in shown.output
    assert "finished: " in shown.output
    by_position = _invoke("trace", str(trace), "--request", "1", "--all")  # ids first: "1" is the id, not position
    assert "request 1" in by_position.output and by_position.output.count("p(chosen)") >= 1
    page = tmp_path / "page.html"
    written = _invoke("trace", str(trace), "--html", str(page), "--token", "2")
    assert written.exit_code == 0 and f"wrote {page}" in written.output.replace("\n", "")
    data = _embedded(page.read_text(encoding="utf-8"))
    assert len(data["requests"]) == 2 and data["select"] == {"request": "1", "output": 0, "token": 2}


def test_beam_decisions_drafts_and_stop_criteria_in_the_terminal(synthetic_trace):
    requests = read_trace(synthetic_trace)
    text = _text(requests, show_all=True)
    assert "continues beam 0 of the previous step → beam 0 now, running score -0.4" in text
    assert "continues beam 1 of the previous step · finished here with final score -0.45" in text
    assert "beam search at this step" in text and "pruned beams (no continuation kept): 2, 3" in text
    assert "kept ← this sequence" in text and "finished ← this sequence" in text and "dropped" in text
    assert "finished: length  criterion max_tokens" in text
    assert "finished: stop  criterion eos  stop reason 2" in text
    assert 'finished: error  error: a <plugin> & it "failed"' in text
    # drafts: an old record without a proposer, the accepted one, the refused one and the one never checked
    assert "drafts: 'line\\nbreak' #22 #23 — 1 of 3 accepted; the target refused #22 and chose '' (token 2)" in text
    assert "drafts (ngram): #26 — 0 of 1 accepted; the target refused #26 and drew #25 (token 3)" in text
    assert "from the speculative step of tokens 1 to 2:" in text
    assert "∅" in text and "⟨25⟩" in text  # an empty text and one the tokenizer could not decode alone
    only = _text(select_requests(requests, "1"), sequence=0, token=3)  # the second request, by position
    assert "request hostile" in only and "request beam" not in only and "token 3 #25" in only


# ---- the HTML page -------------------------------------------------------------------------------------------------


def _embedded(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match.group(1))


def test_the_html_page_is_self_contained_and_embeds_hostile_texts_safely(synthetic_trace, real_trace, tmp_path):
    for source in (synthetic_trace, real_trace):
        page = html_page(read_trace(source), title='a <title> & "quotes"')
        assert "http://" not in page and "https://" not in page
        assert "<link" not in page and not re.search(r"<script[^>]*\bsrc=", page) and "@import" not in page
        assert "url(" not in page
        assert page.count("<script") == 2 and page.count("</script>") == 2  # the data and the code, nothing else
        assert "<title>a &lt;title&gt; &amp; &quot;quotes&quot;</title>" in page
    page = html_page(read_trace(synthetic_trace))
    assert "<i id=" not in page and "<!--" not in page and "\u2028" not in page and "<b>" not in page
    data = _embedded(page)  # the escapes are JSON's: the texts come back exactly
    hostile = data["requests"][1]["outputs"][0]["tokens"]
    assert [t["text"] for t in hostile] == [HOSTILE, "line\nbreak", "", None]
    assert data["requests"][1]["prompt"] == HOSTILE
    assert [d["fate"] for d in hostile[1]["drafts"]["proposed"]] == ["accepted", "rejected", "unverified"]
    assert hostile[1]["drafts"]["correction"] == 2 and hostile[2]["spec"] == 1 and "spec" not in hostile[0]
    beam = data["requests"][0]["outputs"][1]["tokens"][1]
    assert beam["beam"]["final_score"] == -0.45 and beam["beams"]["pruned"] == [2, 3]
    path = write_html(read_trace(synthetic_trace), tmp_path / "page.html", source=str(synthetic_trace))
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_probability_bins_and_stage_changes():
    assert [probability_bin(p) for p in (1.0, 0.9, 0.75, 0.5, 0.2, 0.01, 0.0, None)] == [0, 0, 1, 2, 3, 4, 4, 5]
    model = [[1, "a", 0.5], [2, "b", 0.3], [3, "c", 0.1], [4, "d", 0.05]]
    penalised = [[2, "b", 0.45], [1, "a", 0.3], [5, "e", 0.12], [3, "c", 0.08]]  # d out, e new, a/b/c moved
    changes = stage_changes(model, penalised)
    assert changes["left"] == [[4, "d", 0.05]] and changes["removed"] == []
    assert changes["added"] == [[5, "e", 0.12]] and [m[0] for m in changes["moved"]] == [1, 2, 3]
    truncated = [[2, "b", 0.6], [1, "a", 0.4], [7, "z", 0.0], [8, "y", 0.0]]  # zero fillers: a complete list
    changes = stage_changes(penalised, truncated)
    assert [c[0] for c in changes["removed"]] == [5, 3] and changes["left"] == []
    assert parse_steps("3:7") == (3, 7) and parse_steps(":4") == (None, 4) and parse_steps("5") == (5, 6)
    with pytest.raises(ConfigError, match="A:B"):
        parse_steps("a:b:c")


# ---- the page's files, linted ----------------------------------------------------------------------------------------

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _TagBalance(HTMLParser):
    """Every element closed, in order (void elements excepted); `<script>` and `<style>` bodies are text to
    html.parser, as to a browser."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[tuple[str, tuple[int, int]]] = []
        self.problems: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag not in _VOID:
            self.open.append((tag, self.getpos()))

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        if tag not in _VOID:
            self.problems.append(f"<{tag}/> at {self.getpos()}: not a void element")

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            self.problems.append(f"</{tag}> at {self.getpos()}: a void element has no end tag")
        elif not self.open or self.open[-1][0] != tag:
            self.problems.append(f"</{tag}> at {self.getpos()} closes {self.open[-1] if self.open else 'nothing'}")
        else:
            self.open.pop()


def _tag_problems(markup: str) -> list[str]:
    parser = _TagBalance()
    parser.feed(markup)
    parser.close()
    return parser.problems + [f"<{tag}> at {pos} is never closed" for tag, pos in parser.open]


def test_the_page_markup_parses_with_balanced_tags(synthetic_trace):
    markup = page_file("page.html")
    assert markup.startswith("<!DOCTYPE html>")
    assert _tag_problems(markup) == []
    for slot in ("{{TITLE}}", "{{CSS}}", "{{JS}}", "{{DATA}}"):  # each filled once by html_page
        assert markup.count(slot) == 1, slot
    assert _tag_problems(html_page(read_trace(synthetic_trace), title='a </title> <b>')) == []  # filled, still


def _without_comments_and_strings(css: str) -> str:
    return re.sub(r'/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', "", css, flags=re.S)


def test_the_page_style_has_balanced_braces_and_cannot_end_its_element():
    css = page_file("page.css")
    depth = 0
    for line_number, line in enumerate(_without_comments_and_strings(css).splitlines(), start=1):
        for char in line:
            depth += {"{": 1, "}": -1}.get(char, 0)
            assert depth >= 0, f"page.css:{line_number}: a `}}` closes nothing"
    assert depth == 0, f"page.css: {depth} `{{` never closed"
    assert "/*" not in _without_comments_and_strings(css), "page.css: an unclosed comment"
    assert "</style" not in css.lower() and "{{" not in css  # it is inlined into <style> by one slot


def test_the_page_script_is_valid_javascript(tmp_path):
    js = page_file("page.js")
    # inlined into <script>: nothing in it may end the element or open a comment that hides the end
    assert "</script" not in js.lower() and "<!--" not in js and "<script" not in js.lower() and "{{" not in js
    node = shutil.which("node")
    if node is None:  # no JavaScript parser in the venv either (esprima and the like are not installed)
        pytest.skip("no JavaScript syntax checker here: node is not on PATH and the venv has no JS parser; the "
                    "markup and style checks still ran")
    script = tmp_path / "page.js"
    script.write_text(js, encoding="utf-8")
    checked = subprocess.run([node, "--check", str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stderr


def test_the_page_files_are_package_data_a_wheel_ships():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for name in PAGE_FILES:
        assert (ROOT / "decodekit" / "trace" / name).is_file()
        assert any(fnmatch(name, pattern) for pattern in declared.get("decodekit.trace", [])), name


# ---- bad files -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ("", "no requests in it"),
    ('{"id": "1", "outputs": []}\n{"id": "2", "outputs": [\n', ":2: not JSON"),
    ('\n{"id": "1", "text": "hi", "token_ids": [1]}\n', ':2: no "outputs" list (is this an --output file?'),
    ('[1, 2]\n', ":1: not a trace row"),
    ('{"outputs": [{"index": 0, "trace": [{"token": 1, "stages": [{"top": 3}]}]}]}\n',
     ":1: outputs[0].trace[0]: a malformed token event"),
    ('{"outputs": [{"index": 0, "trace": [{"what": 1}]}]}\n', ":1: outputs[0].trace[0]: neither a token event"),
])
def test_a_bad_trace_file_exits_2_with_a_message_that_names_the_line(content, message, tmp_path):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceFileError) as caught:
        read_trace(path)
    assert str(caught.value).startswith(str(path)) and message in str(caught.value)
    result = _invoke("trace", str(path))
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_html_of_one_request_and_one_sequence(synthetic_trace, tmp_path):
    page = tmp_path / "one.html"
    result = _invoke("trace", str(synthetic_trace), "--html", str(page), "--request", "beam", "--sequence", "1",
                     "--token", "1")
    assert result.exit_code == 0, result.output
    data = _embedded(page.read_text(encoding="utf-8"))
    assert [r["id"] for r in data["requests"]] == ["beam"]
    assert [o["index"] for o in data["requests"][0]["outputs"]] == [1]
    assert data["select"] == {"request": "beam", "output": 1, "token": 1}


def test_an_unknown_request_or_bad_steps_exit_2(synthetic_trace):
    result = _invoke("trace", str(synthetic_trace), "--request", "nope")
    assert result.exit_code == 2 and "no request 'nope' in the trace: its ids are beam, hostile" in result.output
    result = _invoke("trace", str(synthetic_trace), "--steps", "x")
    assert result.exit_code == 2 and "--steps 'x'" in result.output


# ---- a real browser ------------------------------------------------------------------------------------------------


def test_a_headless_browser_builds_the_tokens_and_shows_the_selected_step(synthetic_trace, real_trace, tmp_path):
    requests = read_trace(real_trace) + read_trace(synthetic_trace)
    page = write_html(requests, tmp_path / "trace.html", source="trace.jsonl")
    tokens = sum(len(o.steps) for r in requests for o in r.outputs)
    url = page.resolve().as_uri() + "#request=spec&output=0&token=3"
    dumped = chromium("--dump-dom", url, profile=tmp_path / "profile")
    dom = dumped.stdout
    assert dumped.returncode == 0 and "<body" in dom, dumped.stderr[-2000:]
    items = tokens + sum(len(r.outputs) for r in requests)  # every token, and one stop chip per output
    assert f'data-ready="{items}"' in dom  # the script ran to its end
    assert len(re.findall(r'<span class="tok[ "]', dom)) == tokens  # the script built one span per token
    assert len(re.findall(r'class="tok[^"]*\bsel\b', dom)) == 1  # the fragment selected one token
    details = dom[dom.index('<aside id="details"'):]
    assert "candidates, stage by stage" in details and "request spec · output 0" in details
    assert "token 3 of 10" in details and "DRAFTS" not in details  # the section titles are CSS-uppercased
    assert re.search(r"drafts( · proposer \w+)?</h3>", details)
    assert '<i id="pwn"' not in dom and '&lt;/script&gt;&lt;i id="pwn"&gt;' in dom  # hostile text stays text
    keys = page.read_text(encoding="utf-8").replace("</body>", '<script>["ArrowRight", "ArrowRight", "ArrowLeft"]'
                                                   '.forEach(function (k) { document.dispatchEvent('
                                                   'new KeyboardEvent("keydown", {key: k})); });</script></body>')
    moved = tmp_path / "keys.html"
    moved.write_text(keys, encoding="utf-8")
    dom = chromium("--dump-dom", moved.resolve().as_uri() + "#request=spec&output=0&token=3",
                    profile=tmp_path / "profile").stdout
    selected = re.findall(r'<span class="tok[^"]*\bsel\b[^"]*"[^>]*? title="token (\d+) ', dom)
    assert selected == ["4"], selected  # right, right, left: from token 3 to token 4
    assert "token 4 of 10" in dom[dom.index('<aside id="details"'):]
    shot = tmp_path / "trace.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1280,900", url, profile=tmp_path / "profile")
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
