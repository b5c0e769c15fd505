#!/usr/bin/env bash
# The engine tier of CI: the tests marked `engine_ci` (the fastest cases that show stock vLLM
# serving what `repack --layout vllm` writes) against vLLM's CPU build, in the cached engine venv
# of scripts/engine_venv.sh.
#
#   scripts/engine_tier.sh PROJECT_PYTHON [PYTEST ARGS...]
#
# Where the venv has to be built and the package registry cannot be reached, the tier is skipped
# with the one line engine_venv.sh prints, and exits 0.  Every other failure (the build, a test, no
# test selected) exits non-zero.  In the tier a missing engine fails instead of skipping
# (WNA16CTL_ENGINE_REQUIRED).
set -uo pipefail
cd "$(dirname "$0")/.."
project_python=${1:?usage: scripts/engine_tier.sh PROJECT_PYTHON [PYTEST ARGS...]}
shift
engine_python=$(scripts/engine_venv.sh)
status=$?
if [ "$status" -eq 3 ]; then exit 0; fi
if [ "$status" -ne 0 ]; then
  echo "engine tier: FAILED, the engine venv could not be built (exit $status)" >&2
  exit "$status"
fi
# Two test files at a time: a vLLM start keeps about one core busy (imports, the model build, one
# process after another), so two engines side by side (each worker with a 1 GiB KV cache) use both
# cores of a 2-core machine.
started=$(date +%s)
WNA16CTL_ENGINE_PYTHON=$engine_python WNA16CTL_ENGINE_REQUIRED=1 \
  "$project_python" -m pytest -q -rs -n 2 --dist loadfile -p no:cacheprovider -m engine_ci "$@"
status=$?
echo "engine tier: exit $status after $(( $(date +%s) - started )) s of tests (vLLM from $engine_python)" >&2
exit "$status"
