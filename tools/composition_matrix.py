"""Run the whole composition matrix (tests/helpers/composition_matrix.py) and print or write its table.

    PYTHONPATH=.:plugins python tools/composition_matrix.py            # print the section
    PYTHONPATH=.:plugins python tools/composition_matrix.py --write     # put it in docs/speculative.md

A cell that breaks a rule stops the run with its error (the test suite's `-m matrix` run reports the same cells).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the section into --doc")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "speculative.md")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]
    from tests.helpers import composition_matrix as cm

    torch.set_num_threads(1)  # the tiny models gain nothing from more threads
    with tempfile.TemporaryDirectory() as folder:
        models = cm.build_models(Path(folder))
        outcomes = cm.run_cells(models, cm.all_cells(cm.registry()))
    section = cm.render(outcomes)
    if args.write:
        cm.write_section(args.doc, section)
        print(f"wrote {len(outcomes)} cells to {args.doc}")
    else:
        print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
