"""Hostile inputs and output locations for inspect, repack and verify.

Each test reproduces one way the tools could lose data, accept stale or wrong output, hang, crash
with an internal error or mislead, and checks the one-line refusal (exit 2) or correct result.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

import wna16ctl.repacking.pipeline as repack_mod
import wna16ctl.repacking.native_path as repack_native
import wna16ctl.output.writer as writer_mod
from tests.conftest import QUESTIONS, REPO_ROOT
from tests.repacking.test_pipeline import ckpt, file_digests, leftovers, one_torch_thread, patch_tensor, snapshot  # noqa: F401 - pytest fixtures, found by name
from wna16ctl.sources.headers import read_shard_header
from wna16ctl.cli import cli
from wna16ctl.errors import BadInput, UsageError
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.verification.checks import verify_output
from wna16ctl.output.writer import MANIFEST_NAME, sha256_file

SMALL = dict(num_layers=1, num_experts=4, vocab_size=64)
TWO = dict(num_layers=2, num_experts=4, vocab_size=64)
SPLIT = RepackSettings(tp=2, max_shard_bytes=300_000)
PREFIX = "model.layers.0.mlp.experts"


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def one_line_error(res, *words: str) -> None:
    """Exit 2, one `error:` line (and at most a hint), no internal error, every word in it."""
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert lines and lines[0].startswith("error:") and len(lines) <= 2, res.stderr
    assert "internal error" not in res.stderr and "Traceback" not in res.output
    for w in words:
        assert w in res.stderr, (w, res.stderr)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def edit_config(ck: Path, **changes) -> None:
    path = ck / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def shard_of(ck: Path, name: str) -> Path:
    for p in sorted(ck.glob("*.safetensors")):
        with safe_open(p, framework="pt") as so:
            if name in so.keys():
                return p
    raise KeyError(name)


def read_tensor(ck: Path, name: str) -> torch.Tensor:
    with safe_open(shard_of(ck, name), framework="pt") as so:
        return so.get_tensor(name)


def interrupt_after(monkeypatch, n_builds: int) -> None:
    """KeyboardInterrupt at the n-th rank build, on whichever data path the layers take."""
    real, real_native = repack_mod.build_rank_tensors, repack_native.LayerBuilder.build_into
    calls = []

    def count() -> None:
        calls.append(1)
        if len(calls) == n_builds:
            raise KeyboardInterrupt

    def build(*a, **kw):
        count()
        return real(*a, **kw)

    def native_build(*a, **kw):
        count()
        return real_native(*a, **kw)

    monkeypatch.setattr(repack_mod, "build_rank_tensors", build)
    monkeypatch.setattr(repack_native.LayerBuilder, "build_into", native_build)


def tree_hash(root: Path) -> dict[str, str]:
    """Every entry under root (links as links)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


# ---- data loss or writes outside OUT ---------------------------------------------------------------


@pytest.mark.parametrize("name", [".out.wna16ctl-partial", ".out.wna16ctl-old"])
def test_checkpoint_named_like_staging_or_previous_output_is_refused(make_ckpt, tmp_path, name):
    out = tmp_path / "out"
    if name.endswith("-old"):  # the previous-output name only matters when OUT exists
        run_repack(plan_repack(make_ckpt(**SMALL), RepackSettings(tp=1)), out)
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / name)
    before = snapshot(ck)
    res = invoke("repack", str(ck), "--tp", "1", "-o", str(out), "--force")
    one_line_error(res, "checkpoint")
    assert snapshot(ck) == before


def test_user_file_named_like_the_old_lock_file_is_kept(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    mine = tmp_path / ".out.wna16ctl-lock"
    mine.write_text("my notes")
    run_repack(plan_repack(ck, RepackSettings(tp=1)), tmp_path / "out")
    assert mine.read_text() == "my notes"


def test_foreign_entries_are_never_deleted_by_force(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=1)), out)
    (out / "rank-0" / "notes.txt").write_text("mine")
    res = invoke("repack", str(ck), "--tp", "1", "-o", str(out), "--force")
    one_line_error(res, "rank-0/notes.txt", "not written by wna16ctl")
    assert (out / "rank-0" / "notes.txt").read_text() == "mine"
    # a foreign staging or previous-output directory is never deleted either
    (out / "rank-0" / "notes.txt").unlink()
    for name in (".out.wna16ctl-partial", ".out.wna16ctl-old"):
        d = tmp_path / name
        d.mkdir()
        (d / "data.bin").write_text("mine")
        res = invoke("repack", str(ck), "--tp", "1", "-o", str(out), "--force")
        one_line_error(res, name)
        assert (d / "data.bin").read_text() == "mine"
        shutil.rmtree(d)
    assert invoke("repack", str(ck), "--tp", "1", "-o", str(out), "--force").exit_code == 0
    # --resume replaces OUT at the commit too: the same rule
    (out / "user.txt").write_text("mine")
    res = invoke("repack", str(ck), "--tp", "1", "-o", str(out), "--resume")
    one_line_error(res, "user.txt", "not written by wna16ctl")
    assert (out / "user.txt").read_text() == "mine"


def test_file_added_to_out_during_the_run_is_kept_and_so_is_the_work(make_ckpt, tmp_path, monkeypatch):
    ck = make_ckpt(**SMALL)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=1)), out)
    real = repack_mod.build_manifest

    def meanwhile(*a, **kw):
        (out / "user.txt").write_text("mine")  # the user drops a file into OUT while repack runs
        return real(*a, **kw)

    monkeypatch.setattr(repack_mod, "build_manifest", meanwhile)
    with pytest.raises(UsageError, match="user.txt"):
        run_repack(plan_repack(ck, RepackSettings(tp=1)), out, force=True)
    monkeypatch.undo()
    assert (out / "user.txt").read_text() == "mine"
    assert leftovers(out) == [".out.wna16ctl-partial"]  # the finished work, for --resume
    (out / "user.txt").unlink()
    res = run_repack(plan_repack(ck, RepackSettings(tp=1)), out, resume=True)
    assert res.files_written == 0 and leftovers(out) == []


def test_resume_never_writes_through_links_in_staging(make_ckpt, tmp_path, monkeypatch):
    ck = make_ckpt(**TWO)
    out = tmp_path / "out"
    interrupt_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_repack(plan_repack(ck, SPLIT), out)
    monkeypatch.undo()
    stage = tmp_path / ".out.wna16ctl-partial"
    victims = []
    for rel in ("config.json", "rank-0/model.safetensors.index.json", "rank-1/model-00001-of-00004.safetensors"):
        victim = tmp_path / f"victim-{len(victims)}"
        victim.write_text("outside OUT")
        target = stage / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        target.symlink_to(victim)
        victims.append(victim)
    run_repack(plan_repack(ck, SPLIT), out, resume=True)
    assert all(v.read_text() == "outside OUT" for v in victims)
    fresh = tmp_path / "fresh"
    run_repack(plan_repack(ck, SPLIT), fresh)
    assert file_digests(out) == file_digests(fresh)
    assert not any(p.is_symlink() for p in out.rglob("*"))


def test_resume_never_writes_through_links_in_out(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    before = snapshot(ck)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=2)), out)
    index = out / "rank-0" / "model.safetensors.index.json"
    index.unlink()
    index.symlink_to(ck / "model.safetensors.index.json")
    res = run_repack(plan_repack(ck, RepackSettings(tp=2)), out, resume=True)
    assert res.files_written == 0
    assert snapshot(ck) == before
    assert not index.is_symlink()
    assert verify_output(ck, out, samples=QUESTIONS, num_samples=4).passed


@pytest.fixture
def other_filesystem(tmp_path):
    mnt = tmp_path / "fast"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_checkpoint_and_output_on_different_filesystems(make_ckpt, tmp_path, other_filesystem):
    ck = make_ckpt(**SMALL)
    assert os.stat(ck).st_dev != os.stat(other_filesystem).st_dev
    out = other_filesystem / "tp2"
    res = invoke("repack", str(ck), "--tp", "2", "-o", str(out), "--max-shard-size", "300000")
    assert res.exit_code == 0, res.output
    local = tmp_path / "local"
    run_repack(plan_repack(ck, SPLIT), local)
    assert file_digests(out) == file_digests(local)
    # and a resume there, hard-linking within OUT's filesystem only
    assert run_repack(plan_repack(ck, SPLIT), out, resume=True).files_written == 0


def test_copy_between_falls_back_when_the_kernel_copy_is_refused(tmp_path, monkeypatch, other_filesystem):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    dst = other_filesystem / "dst.bin"
    # whatever this kernel does across filesystems, EXDEV (older kernels) must fall back to a copy
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "Invalid cross-device link")))
    sfd, dfd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT)
    try:
        assert writer_mod.copy_between(sfd, 5, dfd, 0, (3 << 20) - 5) == (3 << 20) - 5
    finally:
        os.close(sfd)
        os.close(dfd)
    assert dst.read_bytes() == src.read_bytes()[5:]


def test_open_files_are_bounded_not_one_per_output_file(make_ckpt, tmp_path, monkeypatch):
    ck = make_ckpt(**TWO)
    plan = plan_repack(ck, RepackSettings(tp=2, max_shard_bytes=100_000))
    n_files = sum(len(f) for f in plan.files)
    peak = [0]
    real_open = writer_mod.StagedOutput.open

    def open_(self, f):
        real_open(self, f)
        peak[0] = max(peak[0], len(self._fds))

    monkeypatch.setattr(writer_mod.StagedOutput, "open", open_)
    run_repack(plan, tmp_path / "out")
    assert n_files >= 8 and peak[0] <= 2 * 2, (n_files, peak[0])


# ---- stale or wrong output accepted ------------------------------------------------------------------


def test_resume_rewrites_files_whose_source_bytes_changed(make_ckpt, tmp_path, monkeypatch):
    ck = copy_ckpt(make_ckpt(**TWO), tmp_path / "ck")
    out = tmp_path / "out"
    interrupt_after(monkeypatch, 3)  # layer 0 written on both ranks, layer 1 under way
    with pytest.raises(KeyboardInterrupt):
        run_repack(plan_repack(ck, SPLIT), out)
    monkeypatch.undo()
    # same headers, other bytes: one layer-0 expert scale and one non-expert tensor
    name = f"{PREFIX}.1.down_proj.weight_scale"
    patch_tensor(shard_of(ck, name), name, read_tensor(ck, name) * 2)
    emb = "model.embed_tokens.weight"
    patch_tensor(shard_of(ck, emb), emb, -read_tensor(ck, emb))
    res = run_repack(plan_repack(ck, SPLIT), out, resume=True)
    fresh = tmp_path / "fresh"
    run_repack(plan_repack(ck, SPLIT), fresh)
    assert file_digests(out) == file_digests(fresh)
    assert res.files_written > 0
    # a finished OUT resumed after a data change is rewritten too
    patch_tensor(shard_of(ck, name), name, read_tensor(ck, name) / 4)
    res = run_repack(plan_repack(ck, SPLIT), out, resume=True)
    assert 0 < res.files_written < sum(len(f) for f in plan_repack(ck, SPLIT).files)
    run_repack(plan_repack(ck, SPLIT), fresh, force=True)
    assert file_digests(out) == file_digests(fresh)


@pytest.mark.parametrize("dtype", ["int8", "bool", "float8_e4m3fn", "weird", 16])
def test_torch_dtype_must_be_a_float_scale_dtype(make_ckpt, tmp_path, dtype):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    edit_config(ck, torch_dtype=dtype)
    one_line_error(invoke("inspect", str(ck), "--tp", "2"), "torch_dtype")
    one_line_error(invoke("repack", str(ck), "--tp", "2", "-o", str(tmp_path / "out")), "torch_dtype")
    assert not (tmp_path / "out").exists()


def test_float32_repacks_and_verify_says_it_cannot_run_the_gemm(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    edit_config(ck, torch_dtype="float32")
    res = invoke("inspect", str(ck), "--tp", "2")
    assert res.exit_code in (0, 1) and "float32" in res.stderr
    out = tmp_path / "out"
    assert invoke("repack", str(ck), "--tp", "2", "-o", str(out)).exit_code == 0
    one_line_error(invoke("verify", str(ck), str(out), "--num-samples", "2", "--samples", str(QUESTIONS)),
                   "float16/bfloat16 only")


def _poison(ck: Path, name: str, fn) -> None:
    patch_tensor(shard_of(ck, name), name, fn(read_tensor(ck, name)))


def _set(idx, value):
    def fn(t):
        t = t.clone()
        t.view(-1)[idx] = value
        return t
    return fn


@pytest.mark.parametrize("case", ["nan", "inf", "-inf"])
def test_non_finite_scales_are_refused_before_commit(make_ckpt, tmp_path, case):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    name = f"{PREFIX}.2.up_proj.weight_scale"
    _poison(ck, name, _set(3, float(case)))
    out = tmp_path / "out"
    one_line_error(invoke("repack", str(ck), "--tp", "2", "-o", str(out)), name, "not finite")
    assert not out.exists() and leftovers(out) == []


G_IDX_CASES = {
    "out_of_range": lambda g: _set(0, int(g.max()) + 1)(g),
    "negative": lambda g: _set(5, -1)(g),
    "huge": lambda g: _set(7, 1 << 40)(g.to(torch.int64)) if g.dtype == torch.int64 else _set(7, 2**31 - 1)(g),
    "not_a_group_assignment": lambda g: _set(0, int(g[1]))(g) if int(g[0]) != int(g[1]) else _set(0, int(g[2]))(g),
    "all_zero": lambda g: torch.zeros_like(g),
}


@pytest.mark.parametrize("case", sorted(G_IDX_CASES))
def test_invalid_g_idx_is_refused_before_writing(ckpt, tmp_path, case):
    ck = copy_ckpt(ckpt(group_size=32, actorder="group", **SMALL), tmp_path / "ck")
    names = [f"{PREFIX}.1.{p}.weight_g_idx" for p in ("gate_proj", "up_proj")]
    bad = G_IDX_CASES[case](read_tensor(ck, names[0]))
    for n in names:  # gate and up share g_idx: keep them equal, so only the value check can fire
        patch_tensor(shard_of(ck, n), n, bad)
    res = invoke("repack", str(ck), "--tp", "2", "-o", str(tmp_path / "out"), "--vllm", "0.29.0")  # act-order
    one_line_error(res, names[0], "g_idx" if case in ("not_a_group_assignment", "all_zero") else "group")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


def test_legacy_unpacked_zero_point_out_of_range_is_refused(make_ckpt, tmp_path):
    from tests.sources.test_legacy_forms import SMALL as LSMALL, _rewrite
    from wna16ctl.layout.packing import unpack_codes

    src = make_ckpt(symmetric=False, **LSMALL)

    def unpack_zp(tensors):
        for name in [n for n in tensors if n.endswith("weight_zero_point")]:
            n_rows = tensors[name.replace("weight_zero_point", "weight_packed")].shape[0]
            codes = unpack_codes(tensors[name], 4, dim=0, size=n_rows)
            tensors[name] = (codes - 8).to(torch.int8)
            if ".1.gate_proj." in name:
                tensors[name][2, 0] = 9  # a 4-bit signed zero point is in [-8, 7]
        return tensors

    legacy = _rewrite(src, tmp_path / "legacy", unpack_zp)
    one_line_error(invoke("repack", str(legacy), "--tp", "2", "-o", str(tmp_path / "out")),
                   f"{PREFIX}.1.gate_proj.weight_zero_point", "outside the 4-bit range")


# verify must see every change to OUT (and to the source's side files) that a re-hashed manifest hides


def rehash(out: Path, add: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> None:
    path = out / MANIFEST_NAME
    m = json.loads(path.read_text())
    for rel in drop:
        m["files"].pop(rel, None)
    for rel in [*m["files"], *add]:
        if (out / rel).is_file():
            m["files"][rel] = {"sha256": sha256_file(out / rel), "bytes": (out / rel).stat().st_size}
    path.write_text(json.dumps(m, indent=2))


def _edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc, indent=2))


def _tamper_config(ck, out, key):
    def fn(c):
        if key == "group_size":
            c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
        else:
            c[key] = 8
    _edit_json(out / "config.json", fn)
    rehash(out)


def _metadata(ck, out):
    path = next((out / "rank-0").glob("*.safetensors"))
    with safe_open(path, framework="pt") as so:
        tensors = {k: so.get_tensor(k) for k in so.keys()}
    save_file(tensors, path, metadata={"format": "np"})
    rehash(out)


def _extra_file(ck, out):
    (out / "rank-0" / "extra.safetensors").write_bytes((out / "config.json").read_bytes())
    rehash(out, add=("rank-0/extra.safetensors",))


def _manifest_tp(ck, out):
    _edit_json(out / MANIFEST_NAME, lambda m: m.update(tp=4))


def _delete_config(ck, out):
    (out / "config.json").unlink()
    rehash(out, drop=("config.json",))


def _swap_tokenizer(ck, out):
    (out / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}))
    rehash(out)


def _source_tokenizer(ck, out):
    _edit_json(ck / "tokenizer.json", lambda t: t.update(added_tokens=[]))


def _total_size(ck, out):
    _edit_json(out / "rank-1" / "model.safetensors.index.json", lambda i: i["metadata"].update(total_size=1))
    rehash(out)


def _extra_rank_dir(ck, out):
    (out / "rank-2").mkdir()


TAMPER = {
    "config_num_experts": lambda ck, out: _tamper_config(ck, out, "num_experts"),
    "config_group_size": lambda ck, out: _tamper_config(ck, out, "group_size"),
    "config_deleted": _delete_config,
    "tokenizer_swapped": _swap_tokenizer,
    "source_tokenizer_changed": _source_tokenizer,
    "rank_index_total_size": _total_size,
    "header_metadata": _metadata,
    "extra_file": _extra_file,
    "extra_rank_dir": _extra_rank_dir,
    "manifest_tp": _manifest_tp,
}


@pytest.fixture(scope="module")
def tokenized_output(make_ckpt, tmp_path_factory):
    ck = make_ckpt(tokenizer=True, num_layers=1, num_experts=4, vocab_size=512)
    out = tmp_path_factory.mktemp("tok-out") / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=2)), out)
    assert verify_output(ck, out, samples=QUESTIONS, num_samples=4).passed
    return ck, out


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_verify_checks_everything_in_out(tokenized_output, tmp_path, case):
    src_ck, src_out = tokenized_output
    ck, out = copy_ckpt(src_ck, tmp_path / "ck"), tmp_path / "out"
    shutil.copytree(src_out, out)
    TAMPER[case](ck, out)
    try:
        report = verify_output(ck, out, samples=QUESTIONS, num_samples=4)
    except BadInput as e:  # e.g. a config that no longer matches the tensors: refused outright
        assert case.startswith("config_"), e.message
        return
    assert not report.passed
    assert report.by_check("manifest"), [f.message for f in report.findings]


def test_manifest_is_the_same_for_relative_and_absolute_checkpoint_paths(make_ckpt, tmp_path, monkeypatch):
    ck = make_ckpt(**SMALL)
    monkeypatch.chdir(ck.parent)
    run_repack(plan_repack(ck.name, RepackSettings(tp=1)), tmp_path / "rel")
    run_repack(plan_repack(ck, RepackSettings(tp=1)), tmp_path / "abs")
    assert (tmp_path / "rel" / MANIFEST_NAME).read_bytes() == (tmp_path / "abs" / MANIFEST_NAME).read_bytes()


# ---- headers: what safetensors refuses, we refuse ---------------------------------------------------


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HEADERS: dict[str, tuple[str | bytes, int]] = {  # header text, data bytes
    "plain": (json.dumps({"a": _entry()}), 8),
    "metadata": (json.dumps({"__metadata__": {"format": "pt"}, "a": _entry()}), 8),
    "metadata_null": (json.dumps({"__metadata__": None, "a": _entry()}), 8),
    "metadata_int": (json.dumps({"__metadata__": {"format": 1}, "a": _entry()}), 8),
    "metadata_list": (json.dumps({"__metadata__": [], "a": _entry()}), 8),
    "metadata_twice": ('{"__metadata__":{"a":"b"},"__metadata__":{"a":"c"},"a":' + json.dumps(_entry()) + "}", 8),
    "gap": (json.dumps({"a": _entry(offsets=(4, 12))}), 12),
    "overlap": (json.dumps({"a": _entry(), "b": _entry(offsets=(4, 12))}), 12),
    "same_range": (json.dumps({"a": _entry(), "b": _entry()}), 8),
    "empty_tensors_share_offsets": (json.dumps({"a": _entry(shape=(0,), offsets=(0, 0)), "b": _entry()}), 8),
    "trailing_data": (json.dumps({"a": _entry()}), 12),
    "short_data": (json.dumps({"a": _entry()}), 6),
    "extra_field": (json.dumps({"a": {**_entry(), "x": 1}}), 8),
    "shape_float": (json.dumps({"a": _entry(shape=(2.0,))}), 8),
    "shape_bool": (json.dumps({"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}), 8),
    "shape_negative": (json.dumps({"a": _entry(shape=(-2,))}), 8),
    "shape_str": (json.dumps({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}), 8),
    "offset_float": (json.dumps({"a": _entry(offsets=(0, 8.0))}), 8),
    "offsets_three": (json.dumps({"a": _entry(offsets=(0, 8, 9))}), 8),
    "offsets_reversed": (json.dumps({"a": _entry(shape=(0,), offsets=(8, 0))}), 8),
    "offset_beyond_u64": (json.dumps({"a": _entry(offsets=(0, 1 << 64))}), 8),
    "shape_overflow": (json.dumps({"a": _entry(shape=(1 << 32, 1 << 32), offsets=(0, 0))}), 0),
    "wrong_size": (json.dumps({"a": _entry(shape=(3,))}), 8),
    "dtype_lowercase": (json.dumps({"a": _entry(dtype="f32")}), 8),
    "dtype_unknown": (json.dumps({"a": _entry(dtype="Q4")}), 8),
    "dtype_f8_e8m0": (json.dumps({"a": _entry(dtype="F8_E8M0", offsets=(0, 2))}), 2),
    "dtype_c64": (json.dumps({"a": _entry(dtype="C64", offsets=(0, 16))}), 16),
    "dtype_f4": (json.dumps({"a": _entry(dtype="F4", offsets=(0, 1))}), 1),
    "dtype_f4_odd": (json.dumps({"a": _entry(dtype="F4", shape=(3,), offsets=(0, 2))}), 2),
    "missing_shape": (json.dumps({"a": {"dtype": "F32", "data_offsets": [0, 8]}}), 8),
    "entry_not_object": (json.dumps({"a": "x"}), 0),
    "not_object": ("[]", 0),
    "empty": ("{}", 0),
    "empty_with_data": ("{}", 2),
    "scalar": (json.dumps({"a": _entry(shape=(), offsets=(0, 4))}), 4),
    "leading_space": (" " + json.dumps({"a": _entry()}), 8),
    "trailing_newline": (json.dumps({"a": _entry()}) + "\n", 8),
    "trailing_nul": (json.dumps({"a": _entry()}) + "\0", 8),
    "trailing_garbage": (json.dumps({"a": _entry()}) + "x", 8),
    "truncated": (json.dumps({"a": _entry()})[:-3], 8),
    "nan": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,NaN]}}', 8),
    "not_utf8": (b'{"a\xff":' + json.dumps(_entry()).encode() + b"}", 8),
    "escaped_name": ('{"a\\u0062":' + json.dumps(_entry()) + "}", 8),
    "deep": ("[" * 100_000 + "]" * 100_000, 0),
    "huge_int": ('{"a":{"dtype":"F32","shape":[' + "9" * 5000 + '],"data_offsets":[0,8]}}', 8),
    "one_byte": ("{", 0),
}


def _write_st(path: Path, header: str | bytes, data_len: int, length: int | None = None) -> Path:
    blob = header.encode() if isinstance(header, str) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if length is None else length))
        f.write(blob)
        f.write(b"\x01" * data_len)
    return path


def _library_accepts(path: Path) -> bool:
    try:
        with safe_open(path, framework="pt") as so:
            for k in so.keys():
                so.get_tensor(k)
        return True
    except Exception:
        return False


def _we_accept(path: Path) -> bool:
    try:
        read_shard_header(path)
        return True
    except BadInput as e:
        assert str(path) in e.message and "\n" not in e.message
        return False


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_header_reader_agrees_with_safetensors(tmp_path, case):
    path = _write_st(tmp_path / "x.safetensors", *HEADERS[case])
    assert _we_accept(path) == _library_accepts(path), case


def test_duplicate_tensor_names_are_refused(tmp_path):
    # the library keeps the last of two equal names silently; a checkpoint holding two is corrupt
    e = json.dumps(_entry())
    path = _write_st(tmp_path / "x.safetensors", '{"a":' + e + ',"a":' + e + "}", 8)
    with pytest.raises(BadInput, match="'a' twice"):
        read_shard_header(path)


def test_header_over_the_safetensors_limit_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 600 << 20))
        f.truncate(8 + (600 << 20) + 16)  # sparse: fits the file, exceeds the limit
    with pytest.raises(BadInput, match="exceeds the safetensors limit"):
        read_shard_header(path)


INDEX_CASES = {
    "truncated": lambda text, wm: text[: len(text) // 2],
    "trailing_garbage": lambda text, wm: text + "}{",
    "renamed": lambda text, wm: json.dumps({"weight_map": {(k + "x" if i == 0 else k): v for i, (k, v) in enumerate(wm.items())}}),
    "wrong_shard": None,  # filled in below: one tensor listed in the other shard, same count
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_index_is_read_exactly(make_ckpt, tmp_path, case):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    index = ck / "model.safetensors.index.json"
    text = index.read_text()
    wm = json.loads(text)["weight_map"]
    if case == "wrong_shard":
        files = sorted(set(wm.values()))
        assert len(files) >= 2
        k = next(n for n, f in wm.items() if f == files[0])
        wm = {**wm, k: files[1]}
        new = json.dumps({"metadata": {}, "weight_map": wm})
    else:
        new = INDEX_CASES[case](text, wm)
    index.write_text(new)
    one_line_error(invoke("inspect", str(ck), "--tp", "1"), "model.safetensors.index.json")


def test_valid_index_with_a_metadata_string_naming_a_file_is_accepted(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    _edit_json(ck / "model.safetensors.index.json", lambda i: i["metadata"].update(source="old/model.safetensors"))
    assert invoke("inspect", str(ck), "--tp", "1").exit_code == 0


# ---- hangs -----------------------------------------------------------------------------------------


def run_cli(*args: str, timeout: float = 60, prelude: str = "") -> subprocess.CompletedProcess:
    code = prelude + "\nimport sys\nfrom wna16ctl.cli import main\nsys.argv = ['wna16ctl'] + sys.argv[1:]\nmain()\n"
    # started as a shell starts it, with Ctrl-C at its default: a test runner's worker may ignore
    # SIGINT (a command run in-process ends by ignoring it), and a child would inherit that
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def assert_one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def test_fifo_in_place_of_a_shard(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    shard = sorted(ck.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    assert_one_line(run_cli("inspect", str(ck), "--tp", "1"), "FIFO")
    assert_one_line(run_cli("repack", str(ck), "--tp", "1", "-o", str(tmp_path / "out")), "FIFO")


def test_catastrophic_target_regex_is_bounded(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")

    def fn(c):
        c["quantization_config"]["config_groups"]["group_0"]["targets"] = [r"re:([\w.]|[\w.])*X$"]
    _edit_json(ck / "config.json", fn)
    proc = run_cli("inspect", str(ck), "--tp", "1", prelude="import wna16ctl.sources.config as c; c.REGEX_BUDGET_S = 1")
    assert_one_line(proc, "catastrophic backtracking", r"([\w.]|[\w.])*X$")


@pytest.mark.parametrize("argv", [
    ("inspect", "{ck}", "--tp", "100000000", "--ep"),
    ("inspect", "{ck}", "--tp", "1000000"),
    ("repack", "{ck}", "--dry-run", "--tp", "1000000", "--ep"),
])
def test_parallel_sizes_beyond_the_model_are_refused_early(make_ckpt, argv):
    ck = make_ckpt(**SMALL)
    assert_one_line(run_cli(*(a.format(ck=ck) for a in argv), timeout=60), "--tp", "ranks")


def test_verify_with_a_manifest_edited_to_a_huge_tp(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=2, ep=True)), out)
    _edit_json(out / MANIFEST_NAME, lambda m: (m.update(tp=10**6), m["identity"]["settings"].update(tp=10**6)))
    assert_one_line(run_cli("verify", str(ck), str(out), "--num-samples", "2", "--samples", str(QUESTIONS)),
                    "more than 4096 ranks")


# ---- one clear line instead of an internal error --------------------------------------------------------


def _deep_header(ck: Path) -> None:
    shard = sorted(ck.glob("*.safetensors"))[0]
    _write_st(shard, '{"a":' + "[" * 50_000 + "]" * 50_000 + "}", 0)


def _deep_index(ck: Path) -> None:
    (ck / "model.safetensors.index.json").write_text('{"weight_map":' + "[" * 50_000 + "]" * 50_000 + "}")


def _deep_config(ck: Path) -> None:
    (ck / "config.json").write_text('{"a":' + "[" * 50_000 + "]" * 50_000 + "}")


def _symlink_loop(ck: Path) -> None:
    shard = sorted(ck.glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(shard)


CONFIG_FIELDS = {
    "huge_int": ('"hidden_size": ' + "9" * 5000, "5000 digits"),
    "big_int": ('"hidden_size": ' + "9" * 4000, "hidden_size"),
    "top_k_negative": ('"num_experts_per_tok": -2', "num_experts_per_tok"),
    "top_k_too_many": ('"num_experts_per_tok": 9', "num_experts_per_tok"),
    "eps_string": ('"rms_norm_eps": "1e-6"', "rms_norm_eps"),
    "n_group": ('"n_group": 3', "n_group"),
    "hidden_string": ('"hidden_size": "256"', "is not an integer"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_FIELDS))
def test_bad_config_fields_are_one_line(make_ckpt, tmp_path, case):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    text = (ck / "config.json").read_text().rstrip().rstrip("}")
    field, word = CONFIG_FIELDS[case]
    (ck / "config.json").write_text(text.rstrip().rstrip(",") + ", " + field + "}")
    one_line_error(invoke("inspect", str(ck), "--tp", "1"), word)


@pytest.mark.parametrize("mutate", [_deep_header, _deep_index, _deep_config, _symlink_loop],
                         ids=lambda f: f.__name__.strip("_"))
def test_malformed_files_are_one_line(make_ckpt, tmp_path, mutate):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    mutate(ck)
    one_line_error(invoke("inspect", str(ck), "--tp", "1"))
    one_line_error(invoke("repack", str(ck), "--tp", "1", "-o", str(tmp_path / "out")))


MANIFEST_FIELDS = {
    "tp_string": lambda m: m.update(tp="2"),
    "files_list": lambda m: m.update(files=[]),
    "file_bytes_string": lambda m: next(iter(m["files"].values())).update(bytes="1"),
    "settings_null": lambda m: m["identity"].update(settings=None),
    "settings_tp_float": lambda m: m["identity"]["settings"].update(tp=2.0),
    "layers_dict": lambda m: m.update(layers={}),
    "scale_dtype_int8": lambda m: m.update(scale_dtype="int8"),
    "source_string": lambda m: m.update(source="x"),
}


@pytest.fixture(scope="module")
def plain_output(make_ckpt, tmp_path_factory):
    ck = make_ckpt(**SMALL)
    out = tmp_path_factory.mktemp("plain") / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=2)), out)
    return ck, out


@pytest.mark.parametrize("case", sorted(MANIFEST_FIELDS))
def test_malformed_manifest_is_one_line(plain_output, tmp_path, case):
    ck, src = plain_output
    out = tmp_path / "out"
    shutil.copytree(src, out)
    _edit_json(out / MANIFEST_NAME, MANIFEST_FIELDS[case])
    one_line_error(invoke("verify", str(ck), str(out), "--num-samples", "2", "--samples", str(QUESTIONS)),
                   MANIFEST_NAME)


# ---- messages that say what is wrong -----------------------------------------------------------------


def test_missing_moe_intermediate_size_is_read_from_the_tensors(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    edit_config(ck, moe_intermediate_size=None, intermediate_size=768)  # the dense MLP's width
    res = invoke("inspect", str(ck), "--tp", "1", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["layers"][0]["intermediate_size"] == 256


def test_missing_quantization_config_is_named(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    edit_config(ck, quantization_config=None)
    one_line_error(invoke("inspect", str(ck), "--tp", "1"), "no quantization_config")


def test_hugging_face_cache_layout_repacks_and_verifies(tokenized_output, tmp_path):
    # a snapshot links every file (shards, config, tokenizer) to ../../blobs/<hash>
    src_ck, _ = tokenized_output
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for p in sorted(src_ck.iterdir()):
        blob = blobs / hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, blob)
        (snap / p.name).symlink_to(os.path.relpath(blob, snap))
    out = tmp_path / "out"
    run_repack(plan_repack(snap, RepackSettings(tp=2)), out)
    assert not any(p.is_symlink() for p in out.rglob("*"))
    report = verify_output(snap, out, samples=QUESTIONS, num_samples=4)
    assert report.passed, [f.message for f in report.findings]


def test_output_that_is_a_mount_point_is_refused_up_front(make_ckpt, other_filesystem):
    # staging must sit on OUT's filesystem, and beside a mount point it cannot
    res = invoke("repack", str(make_ckpt(**SMALL)), "--tp", "1", "-o", str(other_filesystem))
    one_line_error(res, "mount point")
    assert list(other_filesystem.iterdir()) == [] and leftovers(other_filesystem) == []


def test_verify_names_a_non_finite_scale_of_the_source(make_ckpt, tmp_path):
    ck = copy_ckpt(make_ckpt(**SMALL), tmp_path / "ck")
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(tp=2)), out)
    name = f"{PREFIX}.3.gate_proj.weight_scale"
    _poison(ck, name, _set(0, float("nan")))  # data only: the header fingerprint is unchanged
    one_line_error(invoke("verify", str(ck), str(out), "--num-samples", "2", "--samples", str(QUESTIONS)),
                   name, "not finite")


# ---- Ctrl-C at any moment ------------------------------------------------------------------------------
#
# `repack` run in a terminal (a pseudo-terminal whose foreground process group it is) and stopped
# by the Ctrl-C character typed into it at a random moment, from interpreter start-up to the last
# rename.  Every stop must be clean (exit 130 with one line, or 0 when the run had finished), and
# `--resume` must then give the bytes of an uninterrupted run.

CTRL_C = b"\x03"
BIG = dict(num_layers=4, num_experts=32, hidden_size=1024, intermediate_size=1024)  # the size users stopped


def _cli_command() -> list[str]:
    script = Path(sys.executable).parent / "wna16ctl"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "wna16ctl"]


def _in_terminal(argv: list[str], ctrl_c_after: float | None, timeout: float) -> tuple[int | None, str, float]:
    """Run argv with a pseudo-terminal as its controlling terminal; type Ctrl-C after
    `ctrl_c_after` seconds (None: never).  Returns (exit status, or None when it did not end
    within `timeout` seconds of the Ctrl-C; the terminal's text; seconds it ran)."""
    import fcntl
    import termios
    import threading
    import time

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))

    def controlling_terminal() -> None:  # in the child, after setsid: the pty becomes its terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # as a shell starts a foreground job: Ctrl-C not ignored even when this test runs in the background
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONFAULTHANDLER": "1", "TERM": "xterm"}
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=controlling_terminal, cwd=REPO_ROOT, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # a full terminal buffer would stop the child
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        if ctrl_c_after is not None:
            try:
                proc.wait(timeout=ctrl_c_after)
            except subprocess.TimeoutExpired:
                os.write(master, CTRL_C)  # the line discipline signals the foreground process group
        try:
            status: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
            os.killpg(proc.pid, signal.SIGABRT)  # faulthandler prints every thread's stack
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        ran = time.monotonic() - began
        reader.join(timeout=5)
    finally:
        os.close(master)
    return status, b"".join(chunks).decode(errors="replace"), ran


def _plain_text(text: str) -> str:
    import re

    # escape sequences go; the terminal's echo of the Ctrl-C ("^C") ends a line
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", text).replace("\r", "\n").replace("^C", "\n")


def _in_interpreter_start_up(status: int | None, plain: str) -> bool:
    """Whether the Ctrl-C stopped Python before any of wna16ctl's code ran (nothing a program
    can answer: the interpreter itself stops, killed by the signal or failing to import `site`)."""
    import re

    frames = re.findall(r'File "([^"]+)"', plain)
    ours = [f for f in frames if f"{os.sep}wna16ctl{os.sep}" in f and f.endswith(".py")]
    return not ours and (status == -signal.SIGINT or (status == 1 and "init_import_site" in plain))


def _stop_at_random_moments(ck: Path, work: Path, trials: int, seed: int, extra: list[str]) -> dict[str, list]:
    """`trials` runs of `repack ck -o OUT` stopped by Ctrl-C at seeded random moments, each
    followed by `--resume`; returns what each outcome was seen for (delay, text)."""
    import random

    out = work / "out"
    argv = [*_cli_command(), "repack", str(ck), "--tp", "2", "-o", str(out), *extra]
    status, text, _ = _in_terminal(argv, None, 600)  # the first run may build the native library
    assert status == 0, text
    want = file_digests(out)
    # how long a run takes (the moments are drawn in it): the fastest of three, since on a busy
    # machine one slow run would put most moments after the end
    runs = []
    for _ in range(3):
        shutil.rmtree(out)
        status, text, ran = _in_terminal(argv, None, 600)
        assert status == 0 and file_digests(out) == want, text
        runs.append(ran)
    whole = min(runs)
    rng = random.Random(seed)
    seen: dict[str, list] = {"run": [whole]}
    for _ in range(trials):
        shutil.rmtree(out, ignore_errors=True)
        assert leftovers(out) == []
        delay = rng.uniform(0, whole * 1.1)
        status, text, ran = _in_terminal(argv, delay, timeout=max(60.0, 10 * whole))
        plain = _plain_text(text)
        stage_kept = leftovers(out) == [f".{out.name}.wna16ctl-partial"]
        problems = []
        if status is None:
            kind = "hang"
        elif _in_interpreter_start_up(status, plain):
            kind = "stopped in interpreter start-up"
        elif status in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT) or "Fatal Python error" in plain:
            kind = "crash"
        elif status == 0:
            kind = "exit 0"
        elif status == 130:
            kind = "exit 130"
            errors = [ln for ln in plain.splitlines() if ln.startswith("error:")]
            if len(errors) != 1 or "interrupted" not in errors[0]:
                problems.append(f"not one 'error: interrupted' line: {errors}")
            elif ("kept for --resume" in errors[0]) != stage_kept:
                problems.append(f"says {errors[0]!r}, staging directory kept: {stage_kept}")
        else:
            kind = f"exit {status}"
        for bad in ("Traceback", "Aborted!", "internal error", "Exception ignored"):
            if bad in plain and kind != "stopped in interpreter start-up":
                problems.append(f"printed {bad!r}")
        if kind in ("exit 0", "exit 130", "stopped in interpreter start-up"):
            res = invoke("repack", str(ck), "--tp", "2", "-o", str(out), *extra, "--resume")
            if res.exit_code != 0:
                problems.append(f"--resume exited {res.exit_code}: {res.output}")
            elif file_digests(out) != want or leftovers(out) != []:
                problems.append("--resume gave other bytes than an uninterrupted run")
        seen.setdefault(kind, []).append((round(delay, 3), round(ran, 3), plain[-3000:] if kind != "exit 0" or problems else ""))
        if problems:
            seen.setdefault("problems", []).append((round(delay, 3), kind, problems, plain[-3000:]))
    return seen


def _summary(seen: dict[str, list], trials: int, seed: int) -> str:
    counts = {k: len(v) for k, v in seen.items() if k != "run"}
    # a run that exits 0 well after its Ctrl-C went on regardless (only the final renames may)
    late = sum(1 for delay, ran, _ in seen.get("exit 0", []) if ran > delay + 0.5)
    return (f"{trials} Ctrl-C trials (seed {seed}, a run takes {seen['run'][0]:.2f} s): {counts}; "
            f"exit 0 more than 0.5 s after the Ctrl-C: {late}")


def _require_clean(seen: dict[str, list], trials: int, seed: int) -> None:
    summary = _summary(seen, trials, seed)
    print(summary)
    bad = {k: v for k, v in seen.items() if k not in ("run", "exit 0", "exit 130", "stopped in interpreter start-up")}
    assert not bad, summary + "\n" + "\n---\n".join(repr(x) for v in bad.values() for x in v[:3])
    # the moments fall inside a run (up to 10% after it), and a good part of them must have stopped
    # it; not most: the run's last part (the output in place, the interpreter's exit, ignoring
    # SIGINT) rightly ends in 0, and on a fast machine that part is a third of a small run or more
    assert len(seen.get("exit 130", [])) >= trials // 3, summary


def test_ctrl_c_at_random_moments_is_clean_and_resumable(make_ckpt, tmp_path):
    # a short seeded slice on a small checkpoint (most moments fall in start-up and planning); the
    # full run on the larger checkpoint below
    seed = int(os.environ.get("WNA16CTL_CTRL_C_SEED", "38"))
    trials = 12
    seen = _stop_at_random_moments(make_ckpt(**TWO), tmp_path, trials, seed, ["--max-shard-size", "300000"])
    _require_clean(seen, trials, seed)


@pytest.mark.reliability
def test_ctrl_c_at_random_moments_long(make_ckpt, tmp_path):
    seed = int(os.environ.get("WNA16CTL_CTRL_C_SEED", "2026"))
    trials = int(os.environ.get("WNA16CTL_CTRL_C_TRIALS", "200"))
    seen = _stop_at_random_moments(make_ckpt(**BIG), tmp_path, trials, seed, ["--max-shard-size", "20MiB"])
    _require_clean(seen, trials, seed)


def test_ctrl_c_while_ranks_build_waits_for_every_build_under_way(make_ckpt, tmp_path, monkeypatch):
    # Ctrl-C while the main thread waits for the other rank's native build: that build reads the
    # mapped shard window and writes the output buffers, so neither may go before it returns
    import threading
    import time

    ck = make_ckpt(**TWO)
    out = tmp_path / "out"
    real_build, real_unmap = repack_native.LayerBuilder.build_into, repack_native.LayerBuilder.unmap
    lock, busy, busy_at_unmap, stale, pressed = threading.Lock(), [0], [], [], []

    def build(self, rank, n, slot, addrs):
        with lock:
            busy[0] += 1
        try:
            if threading.current_thread() is threading.main_thread():
                if not pressed:  # the first chunk: Ctrl-C once this thread waits for the other build
                    pressed.append(threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)))
                    pressed[0].start()
            else:
                time.sleep(0.5)
            if slot not in self._maps:  # unmapped meanwhile: building now would crash the process
                stale.append(rank)
                return None
            return real_build(self, rank, n, slot, addrs)
        finally:
            with lock:
                busy[0] -= 1

    def unmap(self, slot):
        with lock:
            busy_at_unmap.append(busy[0])
        return real_unmap(self, slot)

    monkeypatch.setattr(repack_native.LayerBuilder, "build_into", build)
    monkeypatch.setattr(repack_native.LayerBuilder, "unmap", unmap)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a test runner's worker may ignore it
    try:
        with pytest.raises(KeyboardInterrupt):
            run_repack(plan_repack(ck, SPLIT), out)
    finally:
        signal.signal(signal.SIGINT, previous)
        if pressed:
            pressed[0].join()
    monkeypatch.undo()
    assert busy_at_unmap and max(busy_at_unmap) == 0 and not stale, (busy_at_unmap, stale)
    assert leftovers(out) == [".out.wna16ctl-partial"]
    run_repack(plan_repack(ck, SPLIT), out, resume=True)
    fresh = tmp_path / "fresh"
    run_repack(plan_repack(ck, SPLIT), fresh)
    assert file_digests(out) == file_digests(fresh)


def _one_interrupted_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted"), proc.stderr
    return lines[0]


def test_ctrl_c_while_the_options_are_read_is_130_not_aborted(make_ckpt, tmp_path):
    # click turns a KeyboardInterrupt outside the command's body into "Aborted!" and exit 1
    prelude = ("import wna16ctl.cli as c\n"
               "def stop(value):\n    raise KeyboardInterrupt\n"
               "c._parse_size = stop\n")
    proc = run_cli("repack", str(make_ckpt(**SMALL)), "--tp", "1", "-o", str(tmp_path / "out"), prelude=prelude)
    assert "nothing was done" in _one_interrupted_line(proc)
    assert leftovers(tmp_path / "out") == [] and not (tmp_path / "out").exists()


# inspect's body drops the last reference of an object whose weakref callback raises KeyboardInterrupt
CTRL_C_IN_A_WEAKREF_CALLBACK = (
    "import weakref\n"
    "import wna16ctl.planning.inspection as i\n"
    "real = i.inspect_checkpoint\n"
    "class Lock:\n    pass\n"
    "def cb(_):\n    raise KeyboardInterrupt\n"
    "def stop(*a, **kw):\n"
    "    lock = Lock()\n    ref = weakref.ref(lock, cb)\n    del lock\n"
    "    return real(*a, **kw)\n"
    "i.inspect_checkpoint = stop\n")


def test_ctrl_c_inside_a_weakref_callback_is_not_lost(make_ckpt, tmp_path):
    # Python only prints a KeyboardInterrupt raised in a weakref callback or __del__ ("Exception
    # ignored in ...": an import's module-lock cleanup, typically) and goes on: the command must
    # still stop with its one line and 130, not finish after a traceback
    prelude = CTRL_C_IN_A_WEAKREF_CALLBACK
    proc = run_cli("inspect", str(make_ckpt(**SMALL)), "--tp", "1", prelude=prelude)
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "nothing was written" in _one_interrupted_line(proc)


def test_a_ctrl_c_sent_again_late_still_stops_the_command(make_ckpt, tmp_path):
    # on a busy machine the thread that sends the lost Ctrl-C again may run only after the rest of
    # a short command: the command still ends with its one line and 130, not 0
    prelude = ("import threading\n"
               "Timer = threading.Timer\n"
               "class Late(Timer):\n"
               "    def __init__(self, interval, *a, **kw):\n"
               "        super().__init__(interval + 0.5, *a, **kw)\n"
               "threading.Timer = Late\n") + CTRL_C_IN_A_WEAKREF_CALLBACK
    proc = run_cli("inspect", str(make_ckpt(**SMALL)), "--tp", "1", prelude=prelude)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "nothing was written" in _one_interrupted_line(proc)


def test_ctrl_c_while_the_command_line_imports_is_130_not_a_traceback():
    prelude = ("import builtins\n"
               "real = builtins.__import__\n"
               "def imp(name, *a, **kw):\n"
               "    if name == 'click':\n        raise KeyboardInterrupt\n"
               "    return real(name, *a, **kw)\n"
               "builtins.__import__ = imp\n")
    proc = run_cli("inspect", "x", prelude=prelude)
    assert "nothing was done" in _one_interrupted_line(proc)
