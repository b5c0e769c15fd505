"""The quantizer venv (scripts/quantizer_venv.sh) and the fixture on top of it: named by the digest of
its pins, used only once completely built, and an unreachable package registry skips the tests
that need it with one line.  No quantizer is installed here: a finished venv is stood in by a marker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.test_engine_venv import _fake_built_venv, _run, _unreachable

VENV_SCRIPT = REPO_ROOT / "scripts" / "quantizer_venv.sh"


def test_an_unreachable_registry_is_one_line_and_exit_3(tmp_path):
    env = _unreachable(tmp_path)
    run = _run(VENV_SCRIPT, env=env)
    assert run.returncode == 3, run.stderr
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("quantizer checkpoints: skipped, the package registry "), run.stderr
    assert "cannot be reached" in lines[0]
    where = _run(VENV_SCRIPT, "--where", env=env).stdout.strip()
    assert where.startswith(str(tmp_path / "cache" / "wna16ctl" / "quantizer-venv-"))
    assert not Path(where).exists()


def test_a_built_venv_is_used_without_asking_the_registry(tmp_path):
    env = _unreachable(tmp_path)
    digest = _run(VENV_SCRIPT, "--digest", env=env).stdout.strip()
    venv = tmp_path / "cache" / "wna16ctl" / f"quantizer-venv-{digest}"
    _fake_built_venv(venv, digest)
    run = _run(VENV_SCRIPT, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(venv / "bin" / "python")
    (venv / "bin" / ".installed").write_text("0123456789abcdef\n")  # built for other pins: never taken
    assert _run(VENV_SCRIPT, env=env).returncode == 3


def test_each_pin_file_names_the_venv(tmp_path):
    copy = tmp_path / "repo" / "scripts"
    copy.mkdir(parents=True)
    for name in ("quantizer_venv.sh", "quantizer-requirements.txt", "quantizer-nodeps.txt"):
        shutil.copy2(VENV_SCRIPT.parent / name, copy / name)
    env = _unreachable(tmp_path)

    def digest() -> str:
        return _run(copy / "quantizer_venv.sh", "--digest", env=env).stdout.strip()

    before = digest()
    assert before == _run(VENV_SCRIPT, "--digest", env=env).stdout.strip()
    for name, old, new in (("quantizer-requirements.txt", "auto-round==0.16.1", "auto-round==0.16.2"),
                           ("quantizer-nodeps.txt", "gptqmodel==7.7.0", "gptqmodel==7.7.1")):
        pins = copy / name
        pins.write_text("# a comment\n" + pins.read_text())
        assert digest() == before
        pins.write_text(pins.read_text().replace(old, new))
        assert new in pins.read_text() and digest() != before
        before = digest()


def test_torch_is_pinned_for_every_install(tmp_path):
    """GPTQModel requires torch>=2.14.1: without the pin as a constraint of each step (and --no-deps
    for it), pip would replace the project's CPU torch with a CUDA build."""
    script = VENV_SCRIPT.read_text()
    installs = [line for line in script.splitlines() if "pip install" in line]
    assert len(installs) == 3 and all('-c "$constraint"' in line for line in installs)
    assert "--no-deps" in installs[-1] and "$NODEPS" in installs[-1]
    reqs = (VENV_SCRIPT.parent / "quantizer-requirements.txt").read_text().splitlines()
    pins = [line for line in reqs if line and not line.startswith("#")]
    assert "torch==2.13.0" in pins and all("==" in line for line in pins)


def test_the_fixture_skips_with_the_one_line_when_the_registry_is_unreachable(tmp_path):
    env = _unreachable(tmp_path) | {"WNA16CTL_CACHE": str(tmp_path / "quantized-cache"), "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(REPO_ROOT / "tests" / "quantizers" / "test_real_checkpoints.py::test_every_variant_is_written")],
                         capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 skipped" in run.stdout
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "quantizer checkpoints: skipped, the package registry" in skipped[0], run.stdout


def test_importing_the_writer_leaves_the_environment_alone():
    """pytest imports the writer for its variants' names: the tools' offline switches must stay in
    the tools' own process, or every Hub test that runs after in the same worker reads offline."""
    code = ("import os, sys; sys.path.insert(0, '.'); before = dict(os.environ); "
            "import tests.quantizers.write_checkpoints; "
            "print(sorted(set(os.environ.items()) ^ set(before.items())))")
    env = {k: v for k, v in os.environ.items() if "OFFLINE" not in k}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
