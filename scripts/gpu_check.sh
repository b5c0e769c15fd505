#!/usr/bin/env bash
# One unattended GPU check of the wna16ctl kernels: build, correctness against the CPU path,
# benchmarks. Needs one NVIDIA GPU, nvcc, and a python whose torch is a CUDA build; nothing else
# (no network, no install: the package runs from this checkout). Writes $OUT/gpu_check.json (or
# ./gpu_check.json), each step's own $OUT/gpu_check.steps/NN-STEP.json as that step ends, and
# prints a short summary. Exit: 0 passed, 1 a check failed (or was cut), 2 could not run.
#
#   scripts/gpu_check.sh [--vllm-moe-lib PATH] [--budget SECONDS] [--gemm-cases N] [--no-pytest] [--no-sanitizer]
#
# The whole run, the build included, fits $WNA16_GPU_CHECK_TOTAL seconds (default 480: 8 minutes).
# The plan: the CUDA library is built first (cached by digest: a second run only loads it) under
# at most WNA16_GPU_CHECK_BUILD_LIMIT seconds (default 300). The checks then get a deadline: this
# script's start + the total less 20 s for the hard stop (--budget SECONDS instead gives them that
# many seconds from the end of the build). They run in order of value (wna16ctl/native/gpucheck.py
# STEP_GROUPS): 1. correctness (kernels against the CPU path and the fp32 reference) and the
# product flow (demo -> repack --device cuda and cpu -> verify --e2e); 2. the repack kernel against
# 70 % of HBM; 3. the M = 1 step sweep; 4. GEMM v3 and v2 against vLLM's Marlin; 5. compute-sanitizer;
# then, with the time left, the repack wall time on both devices, pytest, vLLM's load format and
# engine start-up. Each step has a time budget (STEP_TIME_S); one that would not fit what is left
# is reported "not run: no time left", one that runs past its budget is stopped and reported
# "cut", never passed. The checks stop 10 s before the deadline to write the report; the JSON is
# rewritten after every step and case and each step's file is written whole as it ends, so the
# hard stop keeps what was measured.
set -u
T_START=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
OUT_DIR=${OUT:-$REPO}
JSON="$OUT_DIR/gpu_check.json"
mkdir -p "$OUT_DIR"
rm -f "$JSON"  # never mistake an old report for this run's
rm -f "$OUT_DIR"/gpu_check.steps/[0-9][0-9]-*.json

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
DEADLINE=$(( T_START + TOTAL - 20 ))  # the checks' end; 20 s for the hard stop below
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
if [ -n "$BUDGET" ]; then
  BUDGET=${BUDGET%.*}
  LIMIT=$(( BUDGET + 15 ))
  TIME_ARGS=()  # the explicit --budget is among "$@"
else
  BUDGET=$(( DEADLINE - $(date +%s) ))
  LIMIT=$(( BUDGET + 10 ))
  TIME_ARGS=(--deadline "$DEADLINE")
fi
[ "$LIMIT" -ge 5 ] || LIMIT=5  # timeout 0 would mean no limit
[ $rc -eq 0 ] && echo "build: ${built} s; the checks get ${BUDGET} s (whole run: ${TOTAL} s)"

# hard stop a little past the checks' end, so a hung kernel still leaves a report behind
timeout --signal=TERM --kill-after=5 "$LIMIT" "$PY" -m wna16ctl.native.gpucheck --out "$JSON" ${TIME_ARGS[@]+"${TIME_ARGS[@]}"} "$@"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  [ -s "$JSON" ] || not_run "timed out after ${LIMIT} s before writing a report"
  echo "wna16ctl GPU check: timed out after ${LIMIT} s (partial report kept)" >&2
  exit 1
fi
exit $rc
