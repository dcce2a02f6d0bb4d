"""`DECODEKIT_CPU_ISA` makes an AVX-512 machine take an AVX2-only CPU's paths, and they stay exact.

The cap hides the flags above it from every path choice, compiles the native kernels without them and caps torch's
and oneDNN's kernels; a capped process is a fresh one (the kernels library and torch's dispatch are chosen once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from decodekit.api.cpu import (
    CPU_ISA_VARIABLE,
    cpu_flags,
    cpu_isa_cap,
    cpu_vendor,
    hardware_cpu_flags,
    kernel_compile_flags,
)
from decodekit.bench.machine import cpu_description, machine_line
from decodekit.execution.kernels.native import find_compiler

_HAS_AVX512 = "avx512f" in hardware_cpu_flags()


def test_the_avx2_cap_hides_every_avx512_and_amx_flag_and_builds_without_them(monkeypatch):
    monkeypatch.setenv(CPU_ISA_VARIABLE, "avx2")
    assert cpu_isa_cap() == "avx2"
    assert not any(flag.startswith(("avx512", "amx")) for flag in cpu_flags())
    assert cpu_flags() == {f for f in hardware_cpu_flags() if not f.startswith(("avx512", "amx"))}
    assert "-mno-avx512f" in kernel_compile_flags()
    description = cpu_description()
    if _HAS_AVX512:  # the machine line says what was hidden, so a capped figure is never taken for the hardware's
        assert description["cpu_isa_cap"] == "avx2" and "avx512f" in description["cpu_flags_hidden"]
        assert "avx512f" in description["cpu_flags_absent"]
        assert "capped to avx2 by DECODEKIT_CPU_ISA, hiding avx512f" in machine_line(description)


def test_uncapped_flags_are_the_hardware_flags(monkeypatch):
    monkeypatch.delenv(CPU_ISA_VARIABLE, raising=False)
    assert cpu_isa_cap() == "native" and cpu_flags() == hardware_cpu_flags()
    # no cap's flags; only the vendor's measured choice (AMD: the GGUF scales broadcast in registers)
    assert kernel_compile_flags() == (("-DDK_SPLAT_FROM_REGISTERS",) if cpu_vendor() == "AuthenticAMD" else ())
    assert "cpu_isa_cap" not in cpu_description()


def test_an_unknown_cap_is_refused_with_the_known_ones(monkeypatch):
    monkeypatch.setenv(CPU_ISA_VARIABLE, "sse2")
    with pytest.raises(ValueError, match="DECODEKIT_CPU_ISA='sse2': the known caps are native, avx2, portable"):
        cpu_flags()


_CAPPED_RUN = """
import decodekit  # before torch, as the command line imports them: its import caps torch's kernels
import json, torch
from decodekit import LLM, SamplingParams
from decodekit.execution.kernels.native import load_kernels
from decodekit.models.loader import auto_dtype
from decodekit.models.tiny import tiny_model, tiny_tokenizer
from tests.helpers.reference import hf_greedy, random_prompts

torch.manual_seed(0)
model = tiny_model("llama", seed=0)
llm = LLM(model, tiny_tokenizer(), dtype="float32", device="cpu", fused_decoder=True, native_kernels=True,
          max_num_batched_tokens=48, block_size=8)
native = llm.engine.model.runner.fused.native
prompts = random_prompts(8, 3, 60, seed=3)
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
exact = all(out.token_ids == hf_greedy(model, prompt, 24) for prompt, out in zip(prompts, outs))
print(json.dumps({"torch": torch.backends.cpu.get_cpu_capability(), "quant_isa": native.quant.best_isa,
                  "auto": str(auto_dtype(torch.device("cpu"))[0]), "exact": exact}))
"""


@pytest.mark.skipif(not _HAS_AVX512 or find_compiler() is None,
                    reason="the cap is tested where there is something to hide (AVX-512) and a compiler")
def test_an_avx2_capped_process_runs_avx2_kernels_and_torch_and_stays_exact_with_transformers():
    env = {**os.environ, CPU_ISA_VARIABLE: "avx2"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", _CAPPED_RUN], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # torch's and oneDNN's kernels are capped by `import decodekit` (it came before torch), decodekit's are built
    # for AVX2, `auto` is float32 as on a CPU without bf16 dot products, and greedy tokens equal transformers'
    assert result == {"torch": "AVX2", "quant_isa": "avx2", "auto": "torch.float32", "exact": True}


@pytest.mark.skipif(not _HAS_AVX512, reason="torch dispatches above AVX2 only on an AVX-512 CPU")
def test_torch_imported_before_decodekit_keeps_its_kernels_and_a_warning_says_how_to_cap_them():
    env = {**os.environ, CPU_ISA_VARIABLE: "avx2"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run([sys.executable, "-W", "always", "-c", "import torch; import decodekit"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "set ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 too" in done.stderr
