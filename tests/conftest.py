"""Shared fixtures: tiny in-process models and tokenizers, a fresh plugin manager per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from tests.helpers.tiny_folders import save_tiny_llama

# `decodekit run`, `serve` and `eval` freeze their one-engine process's heap out of the garbage collector
# (`api.startup_heap`); this process runs hundreds of them in turn and drops each engine, so it must not.
os.environ["DECODEKIT_GC_FREEZE"] = "0"


@pytest.fixture(scope="session")
def tokenizer():
    """A tiny byte-level BPE tokenizer (vocab 384)."""
    return tiny_tokenizer()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model(request):
    """A tiny random Llama- or Qwen2-style model (2 layers, GQA), float32."""
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def llama():
    """A tiny random Llama-style model."""
    return tiny_model("llama")


EXAMPLE_PLUGIN = "decodekit_example_plugin"
"""The import name of the third-party plugin package in tests/fixtures/plugin_pkg."""


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    """tests/fixtures/plugin_pkg installed (offline, no dependencies) into a private folder: its package and its
    dist-info with the `decodekit` entry point. The venv is not touched; nothing is left behind. A test puts the
    folder on `sys.path` (`monkeypatch.syspath_prepend`) to make the plugin installed for its duration."""
    work = tmp_path_factory.mktemp("plugin")
    source = Path(__file__).parent / "fixtures" / "plugin_pkg"
    # the build writes next to its sources (build/, *.egg-info): build from a copy, never from the repository
    shutil.copytree(source, work / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(work / "site"), str(work / "src")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    yield work / "site"
    for name in [m for m in sys.modules if m == EXAMPLE_PLUGIN or m.startswith(f"{EXAMPLE_PLUGIN}.")]:
        del sys.modules[name]  # the package and its modules, imported from the folder that is now gone


@pytest.fixture
def plugin_manager():
    """A fresh plugin manager (defaults only) for one test."""
    return get_plugin_manager(load_entry_points=False)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama and its tokenizer (with a chat template) saved as a local HF folder."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
