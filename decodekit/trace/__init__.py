"""`decodekit trace`: looking at a decoding trace (`decodekit run RECIPE --trace FILE.jsonl`), in the terminal and as
one self-contained HTML page.

The package's parts, each imported from its own module (this file imports nothing, so `decodekit.trace.format`,
which `decodekit run` writes rows with, stays light):

- `format`: the trace file's row, both ways: `trace_row` writes one, `read_trace` reads a file back into
  `TraceRequest`s (errors name the line);
- `selection`: which requests, outputs and steps to show (`select_requests`, `only_sequence`, `parse_steps`);
- `analysis`: what both views compute from a trace: the probability colour scale, what each stage changed, the
  drafts' fates, per-output figures;
- `terminal`: `render_terminal`, the rich view;
- `page`: `html_page` and `write_html`, the page, built from the package data files `page.html`, `page.css` and
  `page.js` with the trace embedded as JSON.

The engine side, which records the events, is `decodekit/core/trace.py`.
"""
