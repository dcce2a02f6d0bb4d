"""The servers `bench serve` compares, configured alike: `decodekit serve` on a recipe, and `transformers serve
--continuous-batching` on the same model folder with decodekit's KV cache layout; both offline, on a free loopback
port, with the same torch threads."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from decodekit.bench.serving.process import ServerProcess, free_port


def server_env(threads: int | None) -> dict[str, str]:
    """The servers' environment: offline (nothing is downloaded), and `threads` torch threads when given."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def decodekit_server(recipe: Path | str, overrides: Sequence[str] = (), *, threads: int | None = None,
                     port: int | None = None) -> ServerProcess:
    """`decodekit serve RECIPE` (not started yet) on a free loopback port."""
    port = port or free_port()
    command = [sys.executable, "-m", "decodekit", "serve", str(recipe), "--host", "127.0.0.1", "--port", str(port)]
    for override in overrides:
        command += ["--set", override]
    return ServerProcess(command, port, env=server_env(threads), name="decodekit-serve")


def transformers_executable() -> str:
    """The `transformers` command next to this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "transformers"
    return str(beside) if beside.exists() else "transformers"


def model_folder(model: str) -> Path:
    """The local HF folder of a recipe's `model` for `transformers serve`: the bundled model's (and a .gguf file's)
    converted safetensors folder, which decodekit's loader creates on first use, or the folder itself.

    Raises:
        ValueError: the model is not local (a hub id: nothing is downloaded here).
    """
    from decodekit.models import BUNDLED_MODEL_NAME
    from decodekit.models.loader import bundled_gguf_path, cache_dir, convert_gguf_to_folder

    if model.lower() == BUNDLED_MODEL_NAME or model.lower().endswith(".gguf"):
        gguf = bundled_gguf_path() if model.lower() == BUNDLED_MODEL_NAME else Path(model).expanduser().resolve()
        folder = cache_dir() / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}"  # the loader's naming
        return folder if folder.is_dir() else convert_gguf_to_folder(gguf, folder)
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    raise ValueError(f"{model!r} is not a local folder or GGUF file; transformers serve would download it")


def _kv_blocks(folder: Path, dtype_bytes: int, kv_cache_memory: int, page_size: int) -> int:
    """How many `page_size`-token blocks fit in `kv_cache_memory` bytes of the model's K and V."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(folder).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = text.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes
    return max(2, kv_cache_memory // (per_token * page_size))


def transformers_server(folder: Path, dtype: str, kv_cache_memory: int, max_batch_tokens: int, *,
                        threads: int | None = None, page_size: int = 16, port: int | None = None,
                        executable: str | None = None) -> tuple[ServerProcess, int]:
    """`transformers serve --continuous-batching` on `folder` (not started yet), its KV cache laid out like
    decodekit's: `kv_cache_memory` bytes in `page_size`-token blocks (decodekit's block size; transformers' own
    default of 256-token pages left it short of blocks at 16 clients here: 17% less throughput, TTFT p99 4x longer);
    returns the server and its number of KV blocks."""
    port = port or free_port()
    dtype_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    blocks = _kv_blocks(folder, dtype_bytes, kv_cache_memory, page_size)
    command = [executable or transformers_executable(), "serve", str(folder), "--continuous-batching",
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--device", "cpu",
               "--cb-block-size", str(page_size), "--cb-num-blocks", str(blocks),
               "--cb-max-batch-tokens", str(max_batch_tokens), "--log-level", "warning"]
    return ServerProcess(command, port, env=server_env(threads), name="transformers-serve"), blocks


__all__ = ["decodekit_server", "model_folder", "server_env", "transformers_executable",
           "transformers_server"]
