#!/usr/bin/env bash
# The quantizer venv: AutoRound and GPTQModel (scripts/quantizer-requirements.txt, then
# scripts/quantizer-nodeps.txt with --no-deps) on the project's torch, in a venv of their own, built
# once per set of pins and reused.  The tests' checkpoints written by these tools come from it
# (tests/quantizers/).
#
#   scripts/quantizer_venv.sh [DIR]      prints the venv's python on stdout
#   scripts/quantizer_venv.sh --where    prints the venv's directory (a CI cache key), builds nothing
#   scripts/quantizer_venv.sh --digest   prints the digest of the pins, builds nothing
#
# DIR defaults to ${XDG_CACHE_HOME:-~/.cache}/wna16ctl/quantizer-venv-<digest of the pins and the
# Python version>.  As with scripts/engine_venv.sh: a venv counts as built only when its marker
# (bin/.installed, written last) holds that digest, builds of one DIR take turns (flock), and
# exit 3 (one line on stderr) means it has to be built and the package registry cannot be reached.
# torch is pinned for every step (a constraint), so no step can replace it with another build.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
REQS="$REPO/scripts/quantizer-requirements.txt"
NODEPS="$REPO/scripts/quantizer-nodeps.txt"
PYTHON=${PYTHON:-python3}

digest=$({ grep -h -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$REQS" "$NODEPS"; "$PYTHON" -c 'import sys; print(*sys.version_info[:2])'; } |
         sha256sum | cut -c1-16)
default_dir=${XDG_CACHE_HOME:-$HOME/.cache}/wna16ctl/quantizer-venv-$digest
case "${1:-}" in
  --digest) echo "$digest"; exit 0 ;;
  --where) echo "$default_dir"; exit 0 ;;
esac
dir=${1:-$default_dir}
marker="$dir/bin/.installed"

built() { [ -f "$marker" ] && [ "$(cat "$marker")" = "$digest" ]; }

if built; then echo "$dir/bin/python"; exit 0; fi

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if built; then echo "$dir/bin/python"; exit 0; fi  # built by the holder of the lock before us

index=${PIP_INDEX_URL:-$("$PYTHON" -m pip config get global.index-url 2>/dev/null || true)}
"$PYTHON" "$REPO/scripts/registry_probe.py" "${index:-https://pypi.org/simple}" auto-round "quantizer checkpoints" || exit $?

rm -rf "$dir"
echo "quantizer venv: building $dir (auto-round, gptqmodel; about two minutes)" >&2
"$PYTHON" -m venv "$dir"
constraint="$dir/torch-constraint.txt"
grep -E '^torch==' "$REQS" > "$constraint"
"$dir/bin/python" -m pip install -q -c "$constraint" "$(cat "$constraint")" >&2
"$dir/bin/python" -m pip install -q -c "$constraint" -r "$REQS" >&2
"$dir/bin/python" -m pip install -q --no-deps -c "$constraint" -r "$NODEPS" >&2
GPTQMODEL_CPU_WORKERS=2 "$dir/bin/python" -c 'import auto_round, gptqmodel' >/dev/null 2>&1 ||
  GPTQMODEL_CPU_WORKERS=2 "$dir/bin/python" -c 'import auto_round, gptqmodel' >&2
echo "$digest" > "$marker"
echo "$dir/bin/python"
