"""Test support: one vLLM release's Python sources, fetched once, and a worker that runs them.

`release_sources(version)` downloads the `vllm==version` wheel with pip (no dependencies, binary
only), keeps the `.py` files of its `vllm/` package plus its METADATA (vLLM asks
`importlib.metadata` for its own version), deletes the wheel, and does the same for the
compressed-tensors release that vLLM pins (its QuantizationArgs validation is part of the config
parse).  The cache is `$WNA16CTL_CACHE/vllm-wheels/<version>/` or
`~/.cache/wna16ctl/vllm-wheels/<version>/`; a finished copy is never fetched again.

`vllm_outcome(version, case)` sends the case to a long-lived worker subprocess for that release
(`_vllm_worker.py`: one process per release keeps each release's `vllm` package in its own
interpreter, so several releases can be compared in one pytest run).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from wna16ctl.planning import rules

RELEASES = rules.RELEASES  # the releases the rulebook plans, each compared with its own sources
DEFAULT_CI_RELEASES = (rules.OLDEST, rules.NEWEST)  # what `make test` compares
_DONE = ".complete"


class ReleaseUnavailable(Exception):
    """The release's sources could not be fetched (offline, or pip failed): tests skip."""


def cache_root() -> Path:
    base = os.environ.get("WNA16CTL_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "wna16ctl"
    return root / "vllm-wheels"


def fetch_hint(version: str) -> str:
    return (f"vLLM {version} sources not cached and could not be fetched (offline?); with network access run "
            f"`python -m tests.conformance.vllm_release {version}`")


def release_sources(version: str) -> Path:
    """The directory holding release `version`'s `vllm/` sources (`tree/`) and compressed-tensors (`ct/`)."""
    dest = cache_root() / version
    if (dest / _DONE).is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"vllm-{version}-", dir=dest) as tmp:
        wheel = _pip_download(f"vllm=={version}", Path(tmp))
        tree = dest / "tree"
        _extract(wheel, tree, keep=lambda n: (n.startswith("vllm/") and n.endswith(".py")) or n.endswith(".dist-info/METADATA"))
        pinned = _pinned_compressed_tensors(tree)
        # compiled extension modules of the wheel: the worker gives them empty stand-ins
        with zipfile.ZipFile(wheel) as zf:
            exts = sorted({n.split(".", 1)[0].replace("/", ".") for n in zf.namelist() if n.endswith(".so")})
        (dest / "extensions.txt").write_text("\n".join(exts) + "\n")
        wheel.unlink()  # the wheel is ~300 MB; only the extracted .py files are kept
        ct_wheel = _pip_download(pinned, Path(tmp))
        _extract(ct_wheel, dest / "ct", keep=lambda n: n.startswith("compressed_tensors/") or n.endswith(".dist-info/METADATA"))
        (dest / "ct-requirement.txt").write_text(pinned + "\n")
    (dest / _DONE).write_text(version + "\n")
    return dest


def _pip_download(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(into), requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReleaseUnavailable(f"pip download {requirement}: {exc}") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ReleaseUnavailable(f"pip download {requirement} failed: {last}")
    name = re.split(r"[=<>]", requirement)[0].replace("-", "_")
    wheels = sorted(into.glob(f"{name}-*.whl"))
    if not wheels:
        raise ReleaseUnavailable(f"pip download {requirement}: no wheel in {into}")
    return wheels[-1]


def _extract(wheel: Path, into: Path, keep) -> None:
    partial = into.with_name(into.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if keep(name):
                zf.extract(name, partial)
    shutil.rmtree(into, ignore_errors=True)
    partial.rename(into)


def _pinned_compressed_tensors(tree: Path) -> str:
    for meta in tree.glob("vllm-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            m = re.match(r"Requires-Dist:\s*compressed-tensors\s*([=<>!~][^;]*)", line)
            if m:
                return "compressed-tensors" + m.group(1).strip().replace(" ", "")
    return "compressed-tensors"


# -- worker processes --------------------------------------------------------------------------

_WORKERS: dict[str, "_Worker"] = {}


class _Worker:
    def __init__(self, version: str) -> None:
        src = release_sources(version)
        self.version = version
        self.log_path = src / "worker.log"
        self._log = open(self.log_path, "w")
        script = Path(__file__).with_name("_vllm_worker.py")
        # vLLM reads many VLLM_* variables (VLLM_HUMMING_MOE_GEMM_TYPE, VLLM_MARLIN_INPUT_DTYPE,
        # VLLM_BATCH_INVARIANT, ...) that change its choices: the modelled engine has them unset.
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(PYTHONDONTWRITEBYTECODE="1", VLLM_LOGGING_LEVEL="ERROR", OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="0", VLLM_CACHE_ROOT=str(src / "vllm-cache"))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(src / "tree"), str(src / "extensions.txt"), str(src / "ct")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, bufsize=1,
        )
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"vLLM {version} decision code did not import: {hello.get('error')}\n{hello.get('traceback', '')}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM {self.version} worker exited; see {self.log_path}")
        return json.loads(line)

    def ask(self, case: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
        self._log.close()


def worker(version: str) -> _Worker:
    w = _WORKERS.get(version)
    if w is None or w.proc.poll() is not None:
        w = _WORKERS[version] = _Worker(version)
    return w


def close_worker(version: str) -> None:
    """Stop the release's worker (each holds ~0.6 GB; the sweep and the tests run one at a time)."""
    w = _WORKERS.pop(version, None)
    if w is not None:
        w.close()


@atexit.register
def _close_workers() -> None:
    for w in _WORKERS.values():
        w.close()
    _WORKERS.clear()


def main(argv: list[str]) -> int:
    """`python -m tests.conformance.vllm_release VERSION... | all`: fetch release sources into the cache."""
    versions = list(RELEASES) if argv == ["all"] else argv
    if not versions:
        print("usage: python -m tests.conformance.vllm_release VERSION... | all", file=sys.stderr)
        return 2
    status = 0
    for v in versions:
        try:
            print(release_sources(v))
        except ReleaseUnavailable as exc:
            print(f"vLLM {v}: {exc}", file=sys.stderr)
            status = 1
    return status


def vllm_outcome(version: str, case: dict[str, Any]) -> dict[str, Any]:
    """What release `version` does with `case` (see `_vllm_worker.py` for how each field is read)."""
    res = worker(version).ask(case)
    if "harness_error" in res:
        raise RuntimeError(f"harness failure for vLLM {version} on {case}: {res['harness_error']}\n{res.get('traceback', '')}")
    return res


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
