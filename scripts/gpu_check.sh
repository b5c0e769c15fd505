#!/usr/bin/env bash
# One unattended GPU check of the wna16ctl kernels: build, correctness against the CPU path,
# benchmarks. Needs one NVIDIA GPU, nvcc, and a python whose torch is a CUDA build; nothing else
# (no network, no install: the package runs from this checkout). Writes $OUT/gpu_check.json (or
# ./gpu_check.json) and prints a short summary. Exit: 0 passed, 1 a check failed, 2 could not run.
#
#   scripts/gpu_check.sh [--vllm-moe-lib PATH] [--budget SECONDS] [--gemm-cases N] [--no-pytest] [--no-sanitizer]
#
# The whole run, the build included, fits $WNA16_GPU_CHECK_TOTAL seconds (default 480: 8 minutes).
# The plan: the CUDA library is built first (cached by digest: a second run only loads it) under
# at most WNA16_GPU_CHECK_BUILD_LIMIT seconds (default 300); what is left, less 25 s for the hard
# stop, is the checks' budget (--budget overrides it). The checks run in order of what the run is
# for (wna16ctl/native/gpucheck.py STEPS): kernels against the CPU path and the fp32 reference,
# vLLM's Marlin on our layout, the repack wall time on both devices, the benchmarks, the product
# (demo -> repack --device cuda -> verify --e2e), vLLM's load format, engine start-up with a normal
# load against sharded_state (bench/bench_engine_load.py --device cuda), compute-sanitizer, pytest;
# a step that finds too little time left is reported "not run: no time left". They stop 20 s
# before the budget ends to write the report. The JSON is rewritten after every step and case,
# so the hard stop keeps what was measured.
set -u
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
OUT_DIR=${OUT:-$REPO}
JSON="$OUT_DIR/gpu_check.json"
mkdir -p "$OUT_DIR"
rm -f "$JSON"  # never mistake an old report for this run's

# nvcc: PATH, then the usual install locations
if ! command -v nvcc >/dev/null 2>&1; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi

# python: $PYTHON, the checkout's venv, python3 -- the first one whose torch imports
PY=""
for cand in "${PYTHON:-}" "$REPO/.venv/bin/python" python3 python; do
  [ -n "$cand" ] || continue
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch' >/dev/null 2>&1; then PY=$cand; break; fi
done

not_run() {  # write a minimal report without torch (plain printf: no python may be usable)
  reason=$1
  nvcc_v=$(nvcc --version 2>/dev/null | tail -n 1 | tr -d '"\\')
  smi=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '"\\')
  printf '{\n  "status": "not-run",\n  "reason": "%s",\n  "env": {"nvcc_version": "%s", "nvidia_smi": "%s"}\n}\n' \
    "$reason" "$nvcc_v" "$smi" > "$JSON"
  echo "wna16ctl GPU check: not-run ($reason)"
  echo "  report: $JSON"
  exit 2
}

[ -n "$PY" ] || not_run "no python with an importable torch (tried \$PYTHON, .venv/bin/python, python3, python)"
command -v nvcc >/dev/null 2>&1 || echo "note: nvcc not found; the check will report it" >&2

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
TOTAL=${WNA16_GPU_CHECK_TOTAL:-480}
BUILD_LIMIT=${WNA16_GPU_CHECK_BUILD_LIMIT:-300}
[ "$BUILD_LIMIT" -gt $(( TOTAL - 60 )) ] && BUILD_LIMIT=$(( TOTAL - 60 ))
BUDGET=""
prev=""
for a in "$@"; do  # an explicit checks' budget, for the hard stop below
  case "$a" in --budget=*) BUDGET=${a#--budget=} ;; esac
  [ "$prev" = "--budget" ] && BUDGET=$a
  prev=$a
done

# the build (a failure here is reported by the check run below)
t0=$(date +%s)
timeout --signal=TERM --kill-after=10 "$BUILD_LIMIT" "$PY" -m wna16ctl.native.gpucheck --out "$JSON" --build-only >/dev/null
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  not_run "the CUDA build took longer than ${BUILD_LIMIT} s"
fi
built=$(( $(date +%s) - t0 ))
[ -n "$BUDGET" ] || BUDGET=$(( TOTAL - built - 25 ))
BUDGET=${BUDGET%.*}
[ $rc -eq 0 ] && echo "build: ${built} s; the checks get ${BUDGET} s (whole run: ${TOTAL} s)"

# hard stop a little above the python budget, so a hung kernel still leaves a report behind
LIMIT=$(( BUDGET + 15 ))
timeout --signal=TERM --kill-after=10 "$LIMIT" "$PY" -m wna16ctl.native.gpucheck --out "$JSON" --budget "$BUDGET" "$@"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  [ -s "$JSON" ] || not_run "timed out after ${LIMIT} s before writing a report"
  echo "wna16ctl GPU check: timed out after ${LIMIT} s (partial report kept)" >&2
  exit 1
fi
exit $rc
