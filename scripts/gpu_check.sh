#!/usr/bin/env bash
# GPU tier on CUDA, the check, and optionally benchmarks. Logs go to $OUT (the device tool's
# output folder) or ./gpu-results. Usage: scripts/gpu_check.sh [tests] [slow] [check] [bench]
# [long] [tune] [e2e] [examples] [tangent] [host] [hopper]
#   tests: the fast GPU tier, every test not marked slow (299 s on the H200 at ca40da8)
#   slow:  the launch-config sweeps and the rest of the dtype x head-dim cross products (295 s);
#          tests + slow = the full tier
#   e2e: benchmarks/e2e.py with $E2E_ARGS (e.g. "--rows dit256,dit1024 --budget-s 560": every
#        row of two models; the default budget skips the last compile rows)
#   examples: MeanFlow and sCM on the digits with --device cuda, ~2-3 min each, needing
#        scikit-learn and matplotlib; tangent: benchmarks/tangent_bwd.py with $TANGENT_ARGS
#   hopper: benchmarks/hopper_fwd.py --sweep with $HOPPER_ARGS (default "--lengths 8192"):
#        each Gluon forward candidate against the Triton forward (Hopper only)
#   host: benchmarks/host_time.py with $HOST_ARGS (e.g. "--tree after=. --tree
#        before=scratch/before", an untracked copy of an older src/ carried with the tree)
# TESTS: test paths for the test steps (default: tests). Compiled kernels are cached under
# gpu-results/ (ignored by git), so consecutive calls on a still-warm device reuse them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/gpu-results/triton-cache}
steps=${*:-tests check}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
for step in $steps; do
  case $step in
    tests|slow) [ "$step" = tests ] && marks="not slow" || marks=slow
             # the slow tier's cross products peak at ~4-8 GB a worker: 16 fit the H200's
             # 141 GB, not the H100's 80 (out-of-memory failures at 16 there, none at 4)
             workers=${WORKERS:-16}
             [ "$step" = slow ] && [ -z "${WORKERS:-}" ] && [ "${mem_mib:-0}" -lt 120000 ] && workers=8
             # one thread per test process: 16 processes on 16 cores compile (Triton,
             # Inductor) and are CPU-bound; torch's and Inductor's own pools oversubscribe
             OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 timeout "${TESTS_TIMEOUT:-900}" \
               python3 -m pytest ${TESTS:-tests} -m "$marks" -q -n "$workers" \
               -p no:cacheprovider --durations=25 2>&1 \
               | tee "$out/gpu-$step.txt" || status=1 ;;
    check) python3 -m flash_jvp check --json "$out/check.json" 2>&1 \
             | tee "$out/check.txt" || status=1 ;;
    bench) python3 -m flash_jvp bench --out "$out" 2>&1 | tee "$out/bench-log.txt" || status=1 ;;
    long) python3 benchmarks/long_context.py 2>&1 | tee "$out/long.txt" || status=1 ;;
    tune) python3 benchmarks/tune.py --out "$out/tune.json" 2>&1 | tee "$out/tune.txt" ;;
    tangent) python3 benchmarks/tangent_bwd.py --out "$out" ${TANGENT_ARGS:-} 2>&1 \
               | tee "$out/tangent-bwd.txt" || status=1 ;;
    hopper) python3 benchmarks/hopper_fwd.py --out "$out" --sweep ${HOPPER_ARGS:---lengths 8192} \
              2>&1 | tee "$out/hopper-sweep.txt" || status=1 ;;
    host) python3 benchmarks/host_time.py --out "$out" ${HOST_ARGS:-} 2>&1 \
            | tee "$out/host-time.txt" || status=1 ;;
    e2e) python3 -m benchmarks.e2e --out "$out" ${E2E_ARGS:-} 2>&1 | tee "$out/e2e-log.txt" \
           || status=1 ;;
    examples) for ex in meanflow scm; do
                python3 -m examples.$ex --device cuda --out "$out/examples/$ex" 2>&1 \
                  | tee "$out/examples-$ex.txt" || status=1
              done ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
