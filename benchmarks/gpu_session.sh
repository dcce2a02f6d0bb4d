#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("The GPU path"), in as few device calls as possible.
#
#   bash benchmarks/gpu_session.sh prepare   # here, with network: wheels and the tokenizer into .gpu/ (git-ignored)
#   bash benchmarks/gpu_session.sh run       # on the GPU machine (the device tool, carrying .gpu): tests + benchmarks
#
# The GPU machine can fetch nothing. Its python3 has torch (2.11+cu130 when this was written), Triton and an older
# transformers, but not decodekit's other dependencies: `prepare` downloads those as wheels for its Python 3.12,
# and copies the bundled model's tokenizer and config (random-weight models in its shapes are built there; the
# bundled weights are not carried). `run` writes its logs to $OUT (the device tool's output folder) or ./gpu-out.
set -euo pipefail
cd "$(dirname "$0")/.."

prepare() {
    grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.gpu/" >> .git/info/exclude; }
    rm -rf .gpu/whl && mkdir -p .gpu/whl .gpu/tok  # one version of each wheel
    local platforms=()
    for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .gpu/whl pydantic pydantic-core annotated-types typing-inspection llguidance \
        jsonschema jsonschema-specifications referencing rpds-py "transformers==$(python3 -c \
        'import transformers; print(transformers.__version__)' 2>/dev/null || echo 5.23.0)"
    local converted
    converted=$(ls -d "${DECODEKIT_CACHE:-$HOME/.cache/decodekit}"/gguf/*/ 2>/dev/null | head -1)
    [ -n "$converted" ] || { echo "run decodekit once first: the bundled model is converted on first use" >&2; exit 1; }
    cp "$converted"/{tokenizer.json,tokenizer_config.json,config.json,generation_config.json} .gpu/tok/
    cp "$converted"/chat_template.jinja .gpu/tok/ 2>/dev/null || true
    du -sh .gpu
}

run() {
    # BATCHES (default 64,128,256; empty: none) sizes the throughput rows; TESTS=0 skips the tests, MIXED=0 the mixed run
    local out="${OUT:-gpu-out}"
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD:$PWD/plugins" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.log"
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
        | tee -a "$out/machine.log"
    for shape in smollm2-135m llama-1b; do
        python3 benchmarks/random_model.py --shape "$shape" --tokenizer .gpu/tok --output "/tmp/$shape" >/dev/null
    done
    if [ "${TESTS:-1}" = 1 ]; then
        timeout 300 python3 -m pytest -q -p no:randomly -p no:cacheprovider -m cuda --tb=short \
            tests/execution/test_cuda_path.py tests/execution/test_cuda_strategies.py tests/execution/test_gpu_ops.py \
            tests/execution/test_gpu_layer.py tests/processors/test_structured.py 2>&1 | tail -60 | tee "$out/tests.log" || true
    fi
    for shape in smollm2-135m llama-1b; do
        timeout 240 python3 benchmarks/gpu_step.py --model "/tmp/$shape" --tokens 256 --repeats 3 \
            --batches "${BATCHES-64,128,256}" 2>&1 | grep -v Loading | tail -16 | tee -a "$out/step.log" || true
    done
    if [ "${MIXED:-1}" = 1 ]; then
        timeout 200 python3 -m decodekit bench mixed --model /tmp/smollm2-135m --num-requests 32 \
            --baseline hf-cb 2>&1 | grep -E "│|machine" | tee -a "$out/mixed.log" || true
    fi
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
