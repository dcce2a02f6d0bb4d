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
        jsonschema jsonschema-specifications referencing rpds-py openai httpx2 httpcore2 truststore distro jiter sniffio fastapi starlette uvicorn opentelemetry-api gguf \
        "transformers==${GPU_TRANSFORMERS:-5.23.0}"  # newer ones need a huggingface-hub >= 2.4 the device lacks
    local converted
    converted=$(ls -d "${DECODEKIT_CACHE:-$HOME/.cache/decodekit}"/gguf/*/ 2>/dev/null | head -1)
    [ -n "$converted" ] || { echo "run decodekit once first: the bundled model is converted on first use" >&2; exit 1; }
    cp "$converted"/{tokenizer.json,tokenizer_config.json,config.json,generation_config.json} .gpu/tok/
    cp "$converted"/chat_template.jinja .gpu/tok/ 2>/dev/null || true
    du -sh .gpu
}

run() {
    # Most telling first, each part under its own timeout, every log under $OUT as it is written:
    # 1. gpu_step.py on both shapes (STEP=0 skips it): batch-1 per decode-path variant (VARIANTS: a comma-separated
    #    choice of gpu_step's, default all) against the weight-read
    #    bound, the batch-1 graph's kernels (--profile), throughput at BATCHES (default 256; empty: none) requests
    #    of 16..1024 tokens (HOST_PROFILE=1: and where the host time of the largest goes);
    # 2. the one-row products over tile choices against cuBLAS, a layer's four back to back with and without
    #    programmatic dependent launches, and the decode attention launch over its splits (LINEAR=0 skips them,
    #    LINEAR_ARGS=--no-sweep skips the products' sweep, --no-products them all);
    # 3. every `pytest -m cuda` test that runs without the bundled weights (TESTS=0 skips them; the kernels' own
    #    tests run before 1, the rest after 2);
    # 4. the mixed workload at MIXED (default 32,128,256; empty: none) requests against transformers'
    #    continuous batching (`generate_batch`), same engine limits.
    local out="${OUT:-gpu-out}"
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl 2>&1 | grep -v "WARNING: Target directory" || true
    export PYTHONPATH="/tmp/site:$PWD:$PWD/plugins" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/machine.log"
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
        "transformers", transformers.__version__)' | tee -a "$out/machine.log"
    for shape in smollm2-135m llama-1b; do  # random weights in the two shapes (the bundled ones stay here)
        [ "${STEP:-1}" = 1 ] || [ -n "${MIXED-32 128 256}" ] || break
        python3 benchmarks/random_model.py --shape "$shape" --tokenizer .gpu/tok --output "/tmp/$shape" >/dev/null
    done
    local pytest=(python3 -m pytest -v -p no:randomly -p no:cacheprovider -m cuda --tb=short)
    local kernel_tests=(tests/execution/test_gpu_ops.py tests/execution/test_gpu_layer.py
        tests/execution/test_cuda_path.py::test_the_triton_kernel_equals_the_torch_reference_and_zeroes_padding)
    if [ "${TESTS:-1}" = 1 ]; then  # the kernels' own tests first: a kernel that fails makes the timings moot
        timeout "${KERNEL_TEST_TIMEOUT:-90}" "${pytest[@]}" "${kernel_tests[@]}" 2>&1 | tee "$out/kernel-tests.log" \
            | grep -vE " PASSED " | tail -30 || true
    fi
    local variants=(${VARIANTS:+--variants "$VARIANTS"})
    if [ "${STEP:-1}" = 1 ]; then
        timeout "${STEP_TIMEOUT:-150}" python3 benchmarks/gpu_step.py --model /tmp/llama-1b --tokens 256 \
            --repeats 3 --profile --batches "${BATCHES-256}" ${HOST_PROFILE:+--host-profile} "${variants[@]}" 2>&1 \
            | grep -v Loading | tee -a "$out/step.log" || true
        timeout "${STEP_TIMEOUT:-150}" python3 benchmarks/gpu_step.py --model /tmp/smollm2-135m --tokens 256 \
            --repeats 3 --profile "${variants[@]}" 2>&1 | grep -v Loading | tee -a "$out/step.log" || true
    fi
    if [ "${LINEAR:-1}" = 1 ]; then
        timeout "${LINEAR_TIMEOUT:-150}" python3 benchmarks/gpu_linear.py ${LINEAR_ARGS:-} 2>&1 | tee "$out/linear.log" || true
    fi
    if [ "${TESTS:-1}" = 1 ]; then
        # -v into the log: a run cut by its timeout still says which tests passed
        timeout "${TEST_TIMEOUT:-200}" "${pytest[@]}" --continue-on-collection-errors \
            tests/execution/test_tensor_parallel.py tests/execution/test_cuda_path.py \
            tests/execution/test_cuda_strategies.py tests/processors/test_structured.py 2>&1 \
            | tee "$out/tests.log" | grep -vE " PASSED " | tail -60 || true
    fi
    cat > /tmp/gpu_mixed.yaml <<YAML
model: /tmp/smollm2-135m
dtype: bfloat16
engine: {max_num_seqs: 256, max_num_batched_tokens: 4096, kv_cache_memory: 8GiB}
YAML
    for requests in ${MIXED-32 128 256}; do
        timeout "${MIXED_TIMEOUT:-100}" python3 -m decodekit bench mixed --recipe /tmp/gpu_mixed.yaml \
            --num-requests "$requests" --repeats 1 --baseline hf-cb 2>&1 | grep -E "│|machine|rror" \
            | tee -a "$out/mixed.log" || true
    done
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
