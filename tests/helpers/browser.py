"""A headless chromium for the tests of self-contained HTML pages (the trace page, the compare report): skipped when
chromium is not installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    """Run headless chromium with `args` (`--dump-dom URL`, `--screenshot=FILE URL`) and its own profile folder,
    offline; skip the test when chromium is not on PATH."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("chromium is not on PATH (Debian: apt-get install chromium); the browser test needs it")
    command = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
