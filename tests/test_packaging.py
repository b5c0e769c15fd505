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

from tests.conftest import GSM8K_TEST, REPO_ROOT
from wna16ctl.verification.activations import SHARED_ENV, load_questions, resolve_samples
from wna16ctl.cli import cli
from wna16ctl.errors import BadInput

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WNA16CTL_") and k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


# ---- the samples resolver -------------------------------------------------------------------------------


def test_samples_argument_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nonexistent"))
    assert resolve_samples(GSM8K_TEST) == GSM8K_TEST


def test_shared_env_is_an_override_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nonexistent"))
    with pytest.raises(BadInput, match=f"{SHARED_ENV}={tmp_path / 'nonexistent'}: no such directory"):
        resolve_samples(None)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "empty"))
    with pytest.raises(BadInput, match="test.jsonl: missing"):
        resolve_samples(None)
    good = tmp_path / "good" / "data" / "gsm8k"
    good.mkdir(parents=True)
    shutil.copy(GSM8K_TEST, good / "test.jsonl")
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "good"))
    assert resolve_samples(None) == good / "test.jsonl"


def test_shared_beside_the_repository_without_env(monkeypatch):
    monkeypatch.delenv(SHARED_ENV, raising=False)
    assert Path(resolve_samples(None)).resolve() == GSM8K_TEST.resolve()


def test_no_samples_anywhere_names_the_ways(monkeypatch):
    import wna16ctl.verification.activations as act

    monkeypatch.delenv(SHARED_ENV, raising=False)
    monkeypatch.setattr(act, "repository_shared_dir", lambda: None)  # a wheel install
    with pytest.raises(BadInput) as e:
        resolve_samples(None)
    assert "--samples FILE" in e.value.message and SHARED_ENV in e.value.message and "parquet" in e.value.message


def test_verify_checks_the_checkpoint_before_the_samples(tmp_path):
    missing = tmp_path / "no-checkpoint"
    res = CliRunner().invoke(cli, ["verify", str(missing), str(tmp_path / "out")],
                             env={SHARED_ENV: str(tmp_path / "nonexistent")})
    assert res.exit_code == 2
    assert str(missing) in res.stderr and SHARED_ENV not in res.stderr, res.stderr


def test_parquet_samples(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is the optional `parquet` extra")
    import pyarrow as pa

    questions = [json.loads(line)["question"] for line in GSM8K_TEST.read_text().splitlines()[:5]]
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


def test_demo_tokenizer_needs_no_data_files_and_tokenizes_gsm8k(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    import wna16ctl.verification.activations as act
    from wna16ctl.demo import DemoSpec, write_demo_checkpoint

    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "nonexistent"))
    monkeypatch.setattr(act, "repository_shared_dir", lambda: None)
    ck = write_demo_checkpoint(tmp_path / "ck", DemoSpec(num_layers=1, num_experts=2, top_k=1, tokenizer=True))
    tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
    questions = [json.loads(line)["question"] for line in GSM8K_TEST.read_text().splitlines()[:50]]
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
    res = run("verify", "ck", "tp2", "--samples", GSM8K_TEST, "--num-samples", "8")
    assert res.stderr == "" and "verified" in res.stdout and "NOT" not in res.stdout, res.stdout
    # without --samples a wheel install has no shared/ folder: one line naming the ways
    res = run("verify", "ck", "tp2", code=2)
    assert res.stderr.startswith("error: no GSM8K samples") and "--samples" in res.stderr
    env["WNA16CTL_SHARED"] = "/nonexistent"
    res = run("verify", "ck", "tp2", code=2)
    assert "WNA16CTL_SHARED=/nonexistent" in res.stderr
