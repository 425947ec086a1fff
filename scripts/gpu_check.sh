#!/usr/bin/env bash
# One GPU check of Crescent in under 9 minutes on one H200 (docs/benchmarks.md, "GPU runs"):
#   preflight     nvidia-smi, torch/CUDA/Triton versions, the device's peak bf16 TFLOP/s and HBM GB/s
#   env           a Python that imports torch (CUDA), Triton and Crescent; installs carried wheels
#   kernel_tests  pytest tests/kernels on CUDA (every kernel against its reference, plus the GPU-only
#                 test_gpu.py: K3 shapes, bf16, fla-core's chunk_kda; skips count as failures), and the
#                 kvstore's GPU tier with CUDA IPC between two processes (tests/kvstore/test_cuda_ipc.py,
#                 test_gpu_tier.py, and test_cuda_ipc_node.py's …_cuda: a client putting and getting
#                 device blocks through a real node's PutRegion/GetRegion; a few seconds each), and
#                 tests/prefill/test_device_kvstore.py's …_cuda: a prefill on CUDA exporting a prompt's
#                 blocks into a real node's GPU tier and another loading them back, device to device; and
#                 the engine's own [cuda] cases (tests/engine/test_device.py: bf16 weights and the pool on
#                 the device, fp32 against the dense reference, a bf16 decode row's bits alone and in a
#                 batch) and its copy stream (test_device_staging.py: a layer copied after a long
#                 queued kernel gives its final bytes)
#   models        scripts/gpu_model_checks.py: SmolLM2 single process vs prefill -> handoff -> decode
#                 token for token; batch 1 vs batch 8 bitwise; the tiny K3 through the Triton kernels vs
#                 the CPU reference (and host syncs in a decode forward); the layer-wise handoff between
#                 two processes, the decode stream's tokens equal to one process's, then
#                 bench_layerwise.py; a decode step's bf16 logits to the host and through the sampler (ms).
#   bench         loadtest/bench_gpu_kernels.py: KDA vs fla-core chunk_kda, MLA paged decode,
#                 MoE grouped matmul, MXFP4 matmul, as fractions of the peaks (one JSON line)
#   smoke         scripts/gpu_serving_smoke.py: crescent up --device cuda with the kvstore's GPU tier,
#                 a chat request and a prefix served back from the GPU tier
# Each stage has a share of GPU_CHECK_BUDGET_S (default 530 s; SHARES below) plus what earlier stages
# left unused, so a slow stage cannot starve the later ones of their shares. Everything
# goes to ${OUT:-./gpu-check-out}: gpu_check.log, summary.txt, bench_gpu_kernels.json, models.jsonl,
# smoke.json, smoke-up.log, kernel_tests.xml. Exits non-zero when any stage failed.
#
#   scripts/gpu_check.sh                on the GPU machine, from anywhere in the repo
#   scripts/gpu_check.sh --prepare      on a machine with PyPI: scripts/gpu_wheelhouse.sh (the wheels
#                                       in .whl/ and the Kimi vocabulary in .gpu-carry/, <= 64 MiB)
#   scripts/gpu_check.sh --device cuda:N  the N-th visible GPU only (sets CUDA_VISIBLE_DEVICES for every stage)
#   scripts/gpu_check.sh --device cpu   no GPU: the same stages on the CPU (Triton interpreter, tiny
#                                       fp32 shapes, host tier): checks this script, measures nothing
#                                       (--dry-run is the same)
# Environment: GPU_CHECK_STAGES=preflight,env,kernel_tests,models,bench,smoke (a subset runs only those),
# GPU_MODEL_CHECKS (default: all of smollm2,batch,k3,sampling,handoff), CRESCENT_PYTHON (use this interpreter
# as it is), GPU_CHECK_WHEELS (default .whl), GPU_CHECK_MAKE_INSTALL=1 (no wheels and no usable .venv:
# run `make install`, needs PyPI).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-./gpu-check-out}
BUDGET_S=${GPU_CHECK_BUDGET_S:-530}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
CARRY=.gpu-carry
SITE=${GPU_CHECK_SITE:-/tmp/crescent-gpu-site}
STAGES=${GPU_CHECK_STAGES:-preflight,env,kernel_tests,models,bench,smoke}
MODEL_CHECKS=${GPU_MODEL_CHECKS:-smollm2,batch,k3,sampling,handoff}
DRY_RUN=0

case "${1:-}" in
    --prepare) exec bash scripts/gpu_wheelhouse.sh ;;
    --dry-run) DRY_RUN=1 ;;
    --device)
        case "${2:-}" in
            cpu) DRY_RUN=1 ;;
            cuda) ;;
            cuda:*)
                # every stage (pytest, the model checks, the benchmark, crescent up) uses "cuda", so
                # the N-th visible GPU becomes the only one they see
                n=${2#cuda:}
                [[ $n =~ ^[0-9]+$ ]] || { echo "usage: $0 [--prepare | --device cpu|cuda|cuda:N | --dry-run]" >&2; exit 2; }
                if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
                    IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
                    [ -n "${visible[$n]:-}" ] || { echo "--device cuda:$n: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES has no entry $n" >&2; exit 2; }
                    n=${visible[$n]}
                fi
                export CUDA_VISIBLE_DEVICES=$n ;;
            *) echo "usage: $0 [--prepare | --device cpu|cuda|cuda:N | --dry-run]" >&2; exit 2 ;;
        esac ;;
    "") ;;
    *) echo "usage: $0 [--prepare | --device cpu|cuda|cuda:N | --dry-run]" >&2; exit 2 ;;
esac

mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/{gpu_check.log,bench_gpu_kernels.json,models.jsonl,smoke.json,smoke-up.log,kernel_tests.xml}  # a last run's
: >"$OUT/summary.txt"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$(date +%s)
FAILED=0
PY=${CRESCENT_PYTHON:-python3}

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

wanted() { [[ ",$STAGES," == *",$1,"* ]]; }

# Each stage's share of the 530 s (they sum to it); a stage may also use what earlier stages left
# unused, but never the shares of the wanted stages after it. Guesses for one H200, not measured.
SHARES=(preflight:20 env:60 kernel_tests:130 models:150 bench:90 smoke:80)

# the shares of the wanted stages after NAME
reserved_after() {
    local entry after=0 total=0
    for entry in "${SHARES[@]}"; do
        if [ $after -eq 1 ] && wanted "${entry%%:*}"; then total=$((total + ${entry#*:})); fi
        [ "${entry%%:*}" = "$1" ] && after=1
    done
    echo $total
}

# run_stage NAME FUNCTION: runs FUNCTION under what is left of the budget less the later stages'
# shares, records PASS/FAIL
run_stage() {
    local name=$1 fn=$2 limit t0 rc
    wanted "$name" || return 0
    limit=$((BUDGET_S - ($(date +%s) - START) - $(reserved_after "$name")))
    if [ "$limit" -lt 15 ]; then
        note "FAIL  $name: not started, the ${BUDGET_S} s budget is spent"; FAILED=1; return
    fi
    echo "=== $name (timeout ${limit} s) ==="
    t0=$(date +%s)
    STAGE_LIMIT=$limit "$fn"
    rc=$?
    if [ "$rc" -eq 0 ]; then note "PASS  $name ($(($(date +%s) - t0)) s)"
    else
        [ "$rc" -eq 124 ] && rc="timed out after ${limit} s"
        note "FAIL  $name ($(($(date +%s) - t0)) s): $rc"; FAILED=1
    fi
}

stage_preflight() {
    local ok=0
    date -u +"time: %Y-%m-%dT%H:%M:%SZ"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if command -v nvidia-smi >/dev/null; then
        timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || ok=1
    else
        echo "nvidia-smi: not found"; [ $DRY_RUN -eq 1 ] || ok=1
    fi
    timeout "$STAGE_LIMIT" "$PY" - "$DRY_RUN" <<'EOF' || ok=1
import subprocess, sys
import torch
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not importable")
if torch.cuda.is_available():
    name = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(0)
    print(f"device: {name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
          f"capability {props.major}.{props.minor}")
    subprocess.run([sys.executable, "loadtest/gpu_peaks.py", name], check=True)
elif sys.argv[1] != "1":
    sys.exit("torch sees no CUDA device")
EOF
    return $ok
}

stage_env() {
    if [ -n "${CRESCENT_PYTHON:-}" ]; then
        echo "using CRESCENT_PYTHON=$PY as it is"
    elif [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, crescent.kernels; assert torch.cuda.is_available()' 2>/dev/null; then
        PY=.venv/bin/python; echo "using .venv (torch sees CUDA)"
    elif compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels and Crescent into $SITE for $PY"
        timeout "$STAGE_LIMIT" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl || return 1
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        timeout "$STAGE_LIMIT" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
            --upgrade --target "$SITE" . || return 1
    elif [ "${GPU_CHECK_MAKE_INSTALL:-0}" = 1 ]; then
        timeout "$STAGE_LIMIT" make install || return 1
        PY=.venv/bin/python
    else
        echo "no usable .venv and no wheels in $WHEELS: run scripts/gpu_check.sh --prepare on a machine with" \
             "PyPI and carry $WHEELS and $CARRY, or set GPU_CHECK_MAKE_INSTALL=1 where PyPI is reachable"
        return 1
    fi
    [ -d "$CARRY/kimi-tokenizer" ] && export CRESCENT_KIMI_TOKENIZER_DIR="$PWD/$CARRY/kimi-tokenizer"
    # every module the later stages import, so a missing package is named here and not mid-run
    timeout 120 "$PY" - <<'EOF'
import importlib
missing = []
for module in ("torch", "triton", "crescent.kernels.kda", "crescent.kernels.mla", "crescent.kernels.moe",
               "crescent.kernels.mxfp4", "crescent.kernels.mxfp4.grouped", "crescent.services.engine.kimi_k3.model",
               "fla.ops.kda", "pytest", "pytest_asyncio", "pytest_timeout", "httpx", "crescent.services.cli",
               "crescent.services.kvstore.server", "crescent.services.gateway.server",
               "crescent.services.prefill.server", "crescent.services.decode.server",
               "crescent.services.scheduler.server"):
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{module} ({type(exc).__name__}: {exc})")
print("\n".join(f"cannot import {m}" for m in missing) or "every module imports")
raise SystemExit(1 if missing else 0)
EOF
    [ $? -eq 0 ] || return 1
    # the async device tests need pytest-asyncio (carried, 1.5.0) to load into this pytest (>= 8.4)
    timeout 120 "$PY" -m pytest --collect-only -q -p no:cacheprovider tests/kvstore/test_cuda_ipc.py >/dev/null || {
        echo "pytest cannot collect the async device tests: $("$PY" -m pytest --version 2>&1)," \
             "pytest-asyncio 1.5.0 needs pytest >= 8.4 (add pytest to scripts/gpu_wheels.txt)"; return 1; }
}

stage_kernel_tests() {
    local log="$OUT/kernel_tests.out" device_tests=(tests/kvstore/test_cuda_ipc.py tests/kvstore/test_gpu_tier.py
        tests/kvstore/test_cuda_ipc_node.py::test_device_blocks_go_device_to_device_through_a_real_node_cuda
        tests/prefill/test_device_kvstore.py::test_a_prompts_blocks_go_device_to_device_into_the_gpu_tier_and_back_cuda
        tests/prefill/test_device_kvstore_k3.py::test_a_k3_prompts_blocks_and_states_go_device_to_device_into_the_gpu_tier_and_back_cuda
        "tests/engine/test_device.py::test_bf16_weights_load_as_bf16_and_the_pool_lives_on_the_device[cuda]"
        "tests/engine/test_device.py::test_float32_matches_the_dense_reference_through_prefill_and_decode[torch-attention-cuda]"
        "tests/engine/test_device.py::test_float32_matches_the_dense_reference_through_prefill_and_decode[cpp-decode-on-cpu-cuda]"
        "tests/engine/test_device.py::test_a_decode_row_in_bf16_has_the_same_bits_alone_and_in_a_batch[cuda]"
        tests/engine/test_device.py::test_cuda_takes_the_triton_kernels_where_they_import_else_the_torch_path
        tests/engine/test_device_staging.py::test_on_cuda_a_layer_copied_after_a_long_queued_kernel_gives_its_final_bytes)
    # test_no_cpu_tensor_reaches_triton.py is the CPU's stand-in for this stage: it would only skip here
    local tests=(tests/kernels --ignore=tests/kernels/test_no_cpu_tensor_reaches_triton.py "${device_tests[@]}")
    # the CPU runs the GPU-only files (they skip; CUDA IPC's shared-memory stand-in runs) and the
    # grouped MXFP4 kernel: the rest is `make test`'s
    [ $DRY_RUN -eq 1 ] && tests=(tests/kernels/test_gpu.py tests/kernels/test_mxfp4_grouped.py "${device_tests[@]}")
    timeout "$STAGE_LIMIT" "$PY" -m pytest "${tests[@]}" -q -rs -p no:cacheprovider \
        --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ] && grep -q " skipped" "$log" && [ $DRY_RUN -eq 0 ]; then
        echo "tests were skipped on a GPU machine (reasons above): that check did not run"; rc=1
    fi
    rm -f "$log"
    return "$rc"
}

stage_models() {
    local device=cuda
    [ $DRY_RUN -eq 1 ] && device=cpu
    timeout "$STAGE_LIMIT" "$PY" scripts/gpu_model_checks.py ${MODEL_CHECKS//,/ } --device "$device" \
        --json "$OUT/models.jsonl" --budget-s $((STAGE_LIMIT - 5))
}

stage_bench() {
    local args=(--json "$OUT/bench_gpu_kernels.json")
    [ $DRY_RUN -eq 1 ] && args+=(--dry-run)
    timeout "$STAGE_LIMIT" "$PY" loadtest/bench_gpu_kernels.py "${args[@]}"
}

stage_smoke() {
    local tier=gpu device=cuda
    [ $DRY_RUN -eq 1 ] && tier=host device=cpu
    timeout "$STAGE_LIMIT" "$PY" scripts/gpu_serving_smoke.py --out "$OUT" --tier "$tier" --device "$device" \
        --timeout $((STAGE_LIMIT - 15))
}

echo "gpu_check: stages $STAGES, budget ${BUDGET_S} s, output in $OUT$([ $DRY_RUN -eq 1 ] && echo ', DRY RUN (CPU)')${CUDA_VISIBLE_DEVICES:+, CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}"
run_stage preflight stage_preflight
run_stage env stage_env
run_stage kernel_tests stage_kernel_tests
run_stage models stage_models
run_stage bench stage_bench
run_stage smoke stage_smoke

# the figures worth reading first, from the benchmark's JSON
if [ -s "$OUT/bench_gpu_kernels.json" ]; then
    "$PY" - "$OUT/bench_gpu_kernels.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"bench{'' if r.get('complete') else ' (INCOMPLETE)'}: {r['device']} ({r['kda_compared_with']}); "
      f"KDA prefill >= fla-core chunk_kda: {r.get('kda_prefill_ge_fla')}")
for kernel in ("kda", "mla", "moe", "mxfp4"):
    for row in r.get(kernel, []):
        fla = f", x{row['speedup_vs_fla']} vs fla" if "speedup_vs_fla" in row else ""
        print(f"  {kernel} {row['case']}: {row.get('ms')} ms, {row.get('tflops')} TFLOP/s "
              f"({row.get('frac_peak_tflops')} of peak), {row.get('gbs')} GB/s ({row.get('frac_peak_gbs')}){fla}"
              f"{'' if row.get('ok') else ' FAILED: ' + str(row.get('error', 'check'))}")
EOF
fi
if [ -s "$OUT/models.jsonl" ]; then
    "$PY" - "$OUT/models.jsonl" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    figures = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("check", "status", "reason"))
    print(f"  model {r['status']:<4} {r['check']}: {r['reason'] + '; ' if r['reason'] else ''}{figures}")
EOF
fi
if [ -s "$OUT/smoke.json" ]; then
    "$PY" - "$OUT/smoke.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"smoke: {r['model']} on {r.get('device', '?')}, kvstore {r['tier']} tier: {'ok' if r['ok'] else 'FAILED: ' + r.get('error', '?')}; "
      f"startup {r.get('startup_s')} s, blocks in the tier {r.get('kvstore_blocks_in_tier')}, "
      f"cached prompt tokens {r.get('warm_cached_tokens')}, reads from the tier {r.get('kvstore_hits_in_tier')}")
EOF
fi
note "total $(($(date +%s) - START)) s; $([ $FAILED -eq 0 ] && echo 'all stages passed' || echo 'SOME STAGES FAILED')"
echo "=== summary ($OUT/summary.txt) ==="
cat "$OUT/summary.txt"
exit $FAILED
