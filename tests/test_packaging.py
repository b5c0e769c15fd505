"""A wheel install is the product: everything the commands need ships in the package, and the
GSM8K samples are found the documented ways, in order, with inputs checked checkpoint first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import QUESTIONS, REPO_ROOT
from wna16ctl.verification.activations import load_questions
from wna16ctl.verification.samples import DEMO_QUESTIONS, SAMPLES_ENV, SHARED_ENV, resolve_samples
from wna16ctl.cli import cli
from wna16ctl.errors import BadInput

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WNA16CTL_") and k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


# ---- the samples resolver -------------------------------------------------------------------------------


def _no_gsm8k_anywhere(monkeypatch) -> None:
    """No environment override, no shared/ beside the repository (a wheel install), Hub offline."""
    import wna16ctl.verification.samples as samples_mod

    monkeypatch.delenv(SHARED_ENV, raising=False)
    monkeypatch.delenv(SAMPLES_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(samples_mod, "repository_shared_dir", lambda: None)


def test_samples_argument_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nonexistent"))
    monkeypatch.setenv(SAMPLES_ENV, str(tmp_path / "nonexistent.jsonl"))
    assert resolve_samples(QUESTIONS) == QUESTIONS


def test_samples_env_is_a_file_before_the_shared_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nonexistent"))
    monkeypatch.setenv(SAMPLES_ENV, str(QUESTIONS))
    assert resolve_samples(None) == QUESTIONS
    monkeypatch.setenv(SAMPLES_ENV, str(tmp_path / "missing.jsonl"))
    with pytest.raises(BadInput, match=f"{SAMPLES_ENV}={tmp_path / 'missing.jsonl'}: no such file"):
        resolve_samples(None)


def test_shared_env_is_an_override_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv(SAMPLES_ENV, raising=False)
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nonexistent"))
    with pytest.raises(BadInput, match=f"{SHARED_ENV}={tmp_path / 'nonexistent'}: no such directory"):
        resolve_samples(None)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "empty"))
    with pytest.raises(BadInput, match="test.jsonl: missing"):
        resolve_samples(None)
    good = tmp_path / "good" / "data" / "gsm8k"
    good.mkdir(parents=True)
    shutil.copy(QUESTIONS, good / "test.jsonl")
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "good"))
    assert resolve_samples(None) == good / "test.jsonl"


def test_shared_beside_the_repository_without_env(tmp_path, monkeypatch):
    import wna16ctl.verification.samples as samples_mod

    # the folder the package looks at is the checkout's sibling, whatever the checkout is called
    beside = REPO_ROOT.parent / "shared"
    assert samples_mod.repository_shared_dir() == (beside if beside.is_dir() else None)
    monkeypatch.delenv(SHARED_ENV, raising=False)
    monkeypatch.delenv(SAMPLES_ENV, raising=False)
    shared = tmp_path / "shared"
    (shared / "data" / "gsm8k").mkdir(parents=True)
    shutil.copy(QUESTIONS, shared / "data" / "gsm8k" / "test.jsonl")
    monkeypatch.setattr(samples_mod, "repository_shared_dir", lambda: shared)
    assert resolve_samples(None) == shared / "data" / "gsm8k" / "test.jsonl"


def test_no_samples_anywhere_names_the_ways(monkeypatch, tmp_path):
    _no_gsm8k_anywhere(monkeypatch)
    with pytest.raises(BadInput) as e:
        resolve_samples(None, tmp_path)  # a checkpoint folder without the demo's questions: no fallback
    assert e.value.message.startswith("no GSM8K samples")
    for word in ("--samples FILE", SAMPLES_ENV, SHARED_ENV, "HF_HUB_OFFLINE"):
        assert word in e.value.message, e.value.message


def test_a_demo_checkpoint_falls_back_to_its_questions_with_one_line(monkeypatch, tmp_path):
    _no_gsm8k_anywhere(monkeypatch)
    (tmp_path / DEMO_QUESTIONS).write_text(QUESTIONS.read_text())
    lines: list[str] = []
    assert resolve_samples(None, tmp_path, lines.append) == tmp_path / DEMO_QUESTIONS
    assert len(lines) == 1 and lines[0].startswith("GSM8K not found") and "--samples FILE" in lines[0], lines
    assert SAMPLES_ENV in lines[0] and "\n" not in lines[0]


def test_verify_checks_the_checkpoint_before_the_samples(tmp_path):
    missing = tmp_path / "no-checkpoint"
    res = CliRunner().invoke(cli, ["verify", str(missing), str(tmp_path / "out")],
                             env={SHARED_ENV: str(tmp_path / "nonexistent")})
    assert res.exit_code == 2
    assert str(missing) in res.stderr and SHARED_ENV not in res.stderr, res.stderr


def test_parquet_samples(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is the optional `parquet` extra")
    import pyarrow as pa

    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines()[:5]]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.table({"question": questions, "answer": ["x"] * 5}), path)
    assert load_questions(path, 3) == questions[:3]


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *a, **kw):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    path = tmp_path / "test.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(BadInput, match=r"test.parquet: reading .parquet needs pyarrow"):
        load_questions(path, 3)


def test_demo_tokenizer_needs_no_data_files_and_tokenizes_gsm8k(tmp_path, monkeypatch, gsm8k_test):
    from tokenizers import Tokenizer

    import wna16ctl.verification.samples as samples_mod
    from wna16ctl.demo import DemoSpec, write_demo_checkpoint

    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nonexistent"))
    monkeypatch.setattr(samples_mod, "repository_shared_dir", lambda: None)
    ck = write_demo_checkpoint(tmp_path / "ck", DemoSpec(num_layers=1, num_experts=2, top_k=1, tokenizer=True))
    tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
    questions = [json.loads(line)["question"] for line in gsm8k_test.read_text().splitlines()[:50]]
    n_bytes = sum(len(q.encode()) for q in questions)
    n_tokens = sum(len(tok.encode(q).ids) for q in questions)
    assert n_bytes / n_tokens > 1.5  # word pieces, not bytes
    assert all(tok.decode(tok.encode(q).ids) == q for q in questions)


def test_kernel_sources_dir_override_and_checkout(monkeypatch, tmp_path):
    from wna16ctl.native import ops as kernels

    monkeypatch.setenv("WNA16CTL_KERNELS_DIR", str(tmp_path))
    assert kernels.kernels_dir() == tmp_path
    monkeypatch.delenv("WNA16CTL_KERNELS_DIR")
    assert (kernels.kernels_dir() / "capi.h").is_file()


# ---- the wheel, installed into a fresh virtual environment ------------------------------------------------


def _fresh_venv(root: Path) -> Path:
    """A venv without the system site-packages; the dependencies (torch, compressed-tensors, ...)
    are the ones this test run uses, made visible by a .pth line, so the test needs no network
    and no minutes of installing torch.  Only the package itself comes from the wheel."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return root / "bin"


@pytest.mark.slow
def test_wheel_install_runs_demo_inspect_repack_verify(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO_ROOT), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(dist)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("wna16ctl-*.whl")
    bin_dir = _fresh_venv(tmp_path / "venv")
    inst = subprocess.run([str(bin_dir / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr
    work = tmp_path / "work"  # outside the repository: nothing of the checkout is in reach
    work.mkdir()
    env = clean_env()

    def run(*args: str | Path, code: int = 0) -> subprocess.CompletedProcess:
        res = subprocess.run([str(bin_dir / "wna16ctl"), *map(str, args)], cwd=work, env=env, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == code, (args, res.stdout, res.stderr)
        return res

    where = subprocess.run([str(bin_dir / "python"), "-c", "import wna16ctl, wna16ctl.native.ops as k; "
                            "print(wna16ctl.__file__); print(k.kernels_dir())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()
    installed = Path(where[0]).parent
    assert tmp_path / "venv" in installed.parents
    assert Path(where[1]) == installed / "kernel_sources" and (Path(where[1]) / "capi.h").is_file()
    assert (Path(where[1]) / "emu" / "intrinsics_host.h").is_file()  # the host side of intrinsics.cuh

    for res in (run("demo", "ck"), run("inspect", "ck", "--tp", "1,2")):
        assert res.stderr == "", res.stderr
    res = run("repack", "ck", "--tp", "2", "-o", "tp2")
    if shutil.which(os.environ.get("CXX") or "g++"):
        assert res.stderr == "", res.stderr  # the native host build from the wheel's sources: no fallback notice
    # without --samples a wheel install has no shared/ folder: the demo's own questions, after one line
    # (the only line on stderr: the emulated kernel builds from the wheel's sources without a word)
    env["HF_HUB_OFFLINE"] = "1"
    res = run("verify", "ck", "tp2", "--num-samples", "8")
    assert res.stderr.startswith("warning: GSM8K not found") and res.stderr.count("\n") == 1, res.stderr
    assert "verified" in res.stdout and "NOT" not in res.stdout, res.stdout
    # a user's checkpoint (no demo questions): one line naming the ways, exit 2
    (work / "ck" / DEMO_QUESTIONS).unlink()
    res = run("verify", "ck", "tp2", code=2)
    assert res.stderr.startswith("error: no GSM8K samples") and "--samples" in res.stderr
    env["WNA16CTL_SHARED"] = "/nonexistent"
    res = run("verify", "ck", "tp2", code=2)
    assert "WNA16CTL_SHARED=/nonexistent" in res.stderr


def test_verify_of_the_demo_without_gsm8k_passes_after_one_line(tmp_path, monkeypatch, make_ckpt):
    """`make demo` on a fresh offline machine: verify ends passing on the demo's own questions;
    a checkpoint without them (a user's) stays exit 2 with the line naming the ways."""
    _no_gsm8k_anywhere(monkeypatch)
    ck = tmp_path / "ck"
    shutil.copytree(make_ckpt(**{**SMALL, "vocab_size": 320}, tokenizer=True), ck)
    runner = CliRunner()
    assert runner.invoke(cli, ["repack", str(ck), "--tp", "1", "-o", str(tmp_path / "tp1"), "-q"]).exit_code == 0
    res = runner.invoke(cli, ["verify", str(ck), str(tmp_path / "tp1"), "--num-samples", "8"])
    assert res.exit_code == 0, res.output
    assert res.stderr.startswith("warning: GSM8K not found") and len(res.stderr.splitlines()) == 1, res.stderr
    assert "--samples FILE" in res.stderr and "verified" in res.stdout
    (ck / DEMO_QUESTIONS).unlink()
    res = runner.invoke(cli, ["verify", str(ck), str(tmp_path / "tp1"), "--num-samples", "8"])
    assert res.exit_code == 2 and res.stderr.startswith("error: no GSM8K samples"), res.output
    assert len(res.stderr.splitlines()) == 1


def test_license_is_an_spdx_expression():
    """A license table warns on every install with current setuptools; the SPDX string does not."""
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert any(req.replace(" ", "").startswith("setuptools>=77") for req in project["build-system"]["requires"])
