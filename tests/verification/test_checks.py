"""`verify` against outputs with one injected fault each.

Every fault is injected two ways where that makes sense:
(a) plain corruption of a finished output: the manifest's hashes catch it;
(b) a buggy repack: the tensor is wrong AND the manifest's sha256/bytes are rewritten to match, so
    only the deeper checks (bit-exact round trip, numerics) can catch it.
Each finding must name what is wrong: layer, expert, rank, tensor."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

import wna16ctl.verification.checks as verify_mod
from tests.conftest import ACT_ORDER_RELEASE, QUESTIONS
from tests.repacking.test_pipeline import BASE, ckpt, one_torch_thread, patch_tensor, read_dir  # noqa: F401 - pytest fixtures, found by name
from wna16ctl.cli import cli
from wna16ctl.errors import BadInput
from wna16ctl.layout.marlin import marlin_permute_scales, marlin_unpermute_scales
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.verification.checks import VerifyReport, verify_output
from wna16ctl.output.writer import MANIFEST_NAME, sha256_file

PREFIX = "model.layers.0.mlp.experts"
H, I = 256, 256


# ---- outputs (repacked once per module; tests mutate copies) ------------------------------------------


@pytest.fixture(scope="module")
def outputs(ckpt, tmp_path_factory):
    """name -> (checkpoint, pristine repack output)."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            spec, settings = {
                "g128": (dict(**BASE), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)),  # I_p == group_size: the w13 scale quirk case
                "actorder": (dict(group_size=32, actorder="group", **BASE), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)),
                "static": (dict(group_size=32, actorder="static", **BASE), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)),
            }[name]
            ck = ckpt(**spec)
            out = tmp_path_factory.mktemp(f"out-{name}") / "out"
            run_repack(plan_repack(ck, settings), out)
            made[name] = (ck, out)
        return made[name]

    return get


@pytest.fixture
def fresh(outputs, tmp_path):
    """A private copy of one of the module's outputs: `fresh("g128") -> (ckpt, out)`."""

    def get(name: str) -> tuple[Path, Path]:
        ck, out = outputs(name)
        dst = tmp_path / name
        shutil.copytree(out, dst)
        return ck, dst

    return get


# ---- helpers ----------------------------------------------------------------------------------------------


def _full(name: str) -> str:
    return name if name.startswith("model.") else f"{PREFIX}.{name}"


def rank_file(out: Path, r: int, name: str = "w13_weight_packed") -> Path:
    """The file of rank r holding tensor `name` (by the rank's index; a name the index does not
    know: the file of the layer's w13_weight_packed)."""
    wm = json.loads((out / f"rank-{r}" / "model.safetensors.index.json").read_text())["weight_map"]
    return out / f"rank-{r}" / (wm[_full(name)] if _full(name) in wm else wm[_full("w13_weight_packed")])


def _rel(out: Path, r: int, name: str) -> str:
    return rank_file(out, r, name).relative_to(out).as_posix()


def read(out: Path, r: int, name: str) -> torch.Tensor:
    with safe_open(rank_file(out, r, name), framework="pt") as so:
        return so.get_tensor(_full(name))


def rewrite(out: Path, r: int, **tensors: torch.Tensor) -> None:
    """Rewrite the rank files holding some expert tensors with them replaced (any shape)."""
    for path in {rank_file(out, r, name) for name in tensors}:
        with safe_open(path, framework="pt") as so:
            all_tensors = {k: so.get_tensor(k) for k in so.keys()}
        for name, t in tensors.items():
            if rank_file(out, r, name) == path:
                all_tensors[_full(name)] = t.contiguous()
        save_file(all_tensors, path, metadata={"format": "pt"})


def patch(out: Path, r: int, name: str, t: torch.Tensor) -> None:
    patch_tensor(rank_file(out, r, name), _full(name), t)


def rehash(out: Path) -> None:
    """What a buggy repack would write: a manifest whose hashes match the (wrong) files."""
    path = out / MANIFEST_NAME
    m = json.loads(path.read_text())
    for rel in m["files"]:
        m["files"][rel] = {"sha256": sha256_file(out / rel), "bytes": (out / rel).stat().st_size}
    path.write_text(json.dumps(m, indent=2) + "\n")


def verify(ck: Path, out: Path) -> VerifyReport:
    return verify_output(ck, out, samples=QUESTIONS, num_samples=8)


def findings(report: VerifyReport, check: str) -> list:
    return report.by_check(check)


def assert_manifest_only_names(report: VerifyReport, *words: str) -> None:
    msgs = [f.message for f in findings(report, "manifest")]
    assert msgs and all(any(w in m for m in msgs) for w in words), msgs


def assert_round_trip(report: VerifyReport, *, expert: int | None, rank: int | None, words: tuple[str, ...]):
    """Some round-trip finding names this expert, rank, the layer and every word."""
    rt = findings(report, "round_trip")
    hit = [f for f in rt if (expert is None or f.expert == expert) and (rank is None or f.rank == rank)
           and all(w in f.message for w in words)]
    assert hit, [f.to_json() for f in rt]
    f = hit[0]
    if expert is not None:
        assert f.layer == PREFIX and PREFIX in f.message and f"expert {expert}" in f.message
    if rank is not None:
        assert f"rank {rank}" in f.message
    return f


def numerics_failed(report: VerifyReport) -> bool:
    (n,) = report.numerics
    assert n.layer == PREFIX
    return not n.passed


# ---- the baseline passes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["g128", "actorder", "static"])
def test_pristine_outputs_pass(outputs, name):
    report = verify(*outputs(name))
    assert report.passed, [f.to_json() for f in report.findings]
    # every file of the manifest: per rank its safetensors files and index, and config.json
    ck, out = outputs(name)
    manifest = json.loads((out / "wna16ctl.json").read_text())
    assert report.files_checked == len(manifest["files"]) == 2 * (len(list((out / "rank-0").glob("*.safetensors"))) + 1) + 1
    assert report.layers_checked == 1 and report.experts_checked == 4
    # the margin: the kernel's GEMM outputs use a small part of the derived accumulation bound
    # beyond their own rounding (a wrong scale reads many bounds: test_numerics_alone_catch_...)
    (n,) = report.numerics
    assert n.bound_used is not None and n.bound_used < 0.1, n.bound_used


def test_the_numerics_check_names_the_questions_it_ran_on(outputs, tmp_path):
    """The demo's generated questions (verify's last fallback) or a user's file are never reported
    as GSM8K."""
    ck, out = outputs("g128")
    for name, said in (("demo_questions.jsonl", "the demo's generated questions"), ("mine.jsonl", "mine.jsonl"),
                       ("gsm8k-test.jsonl", "GSM8K")):
        samples = tmp_path / name
        shutil.copyfile(QUESTIONS, samples)
        report = verify_output(ck, out, samples=samples, num_samples=2)
        assert report.passed
        assert report.check("numerics").description.startswith(f"activations of {said} through"), name


# ---- weight faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "buggy_repack"])
def test_flipped_nibble_in_w2(fresh, mode):
    ck, out = fresh("g128")
    w2 = read(out, 1, "w2_weight_packed")
    w2.view(-1, w2.shape[-1])[2 * w2.shape[1] + 3, 17] ^= 0xF0  # expert 2, one nibble
    patch(out, 1, "w2_weight_packed", w2)
    if mode == "buggy_repack":
        rehash(out)
    report = verify(ck, out)
    assert not report.passed
    if mode == "plain":
        assert_manifest_only_names(report, _rel(out, 1, "w2_weight_packed"), "modified after repack")
    else:
        assert not findings(report, "manifest")
    f = assert_round_trip(report, expert=2, rank=1, words=("w2_weight_packed", "down_proj"))
    assert all(x.expert == 2 and x.rank in (1, None) for x in findings(report, "round_trip")), f


@pytest.mark.parametrize("mode", ["plain", "buggy_repack"])
def test_swapped_experts(fresh, mode):
    ck, out = fresh("g128")
    for name in ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale"):
        t = read(out, 0, name)
        patch(out, 0, name, t[[0, 2, 1, 3]])
    if mode == "buggy_repack":
        rehash(out)
    report = verify(ck, out)
    assert not report.passed
    assert bool(findings(report, "manifest")) == (mode == "plain")
    for e in (1, 2):
        assert_round_trip(report, expert=e, rank=0, words=("differs",))
    assert {f.expert for f in findings(report, "round_trip")} == {1, 2}


@pytest.mark.parametrize("mode", ["plain", "buggy_repack"])
def test_swapped_gate_and_up(fresh, mode):
    ck, out = fresh("g128")
    for name in ("w13_weight_packed", "w13_weight_scale"):  # Marlin keeps the gate | up halves of N
        t = read(out, 1, name)
        half = t.shape[-1] // 2
        t[0] = torch.cat([t[0, ..., half:], t[0, ..., :half]], dim=-1)
        patch(out, 1, name, t)
    if mode == "buggy_repack":
        rehash(out)
    report = verify(ck, out)
    assert not report.passed
    assert_round_trip(report, expert=0, rank=1, words=("w13_weight_packed", "gate_proj"))
    assert numerics_failed(report)


def _w2_scales(out: Path, r: int) -> torch.Tensor:
    return read(out, r, "w2_weight_scale")


@pytest.mark.parametrize("mode", ["plain", "buggy_repack"])
def test_act_order_w2_scales_sharded_by_rank(fresh, mode):
    # vllm #41161 class: act-order needs all I/gs w2 scale rows on every rank; write the rank's slice.
    ck, out = fresh("actorder")
    full = _w2_scales(out, 1)
    assert full.shape == (4, I // 32, H)
    rewrite(out, 1, w2_weight_scale=full[:, 4:8])  # the rows rank 1 would get if sharded
    if mode == "buggy_repack":
        rehash(out)
    report = verify(ck, out)
    assert not report.passed
    assert bool(findings(report, "manifest")) == (mode == "plain")
    for e in range(4):
        assert_round_trip(report, expert=e, rank=1, words=("w2_weight_scale", "(4, 256)"))


@pytest.mark.parametrize("mode", ["plain", "buggy_repack"])
def test_static_actorder_w2_scales_loaded_full(fresh, mode):
    # the converse: actorder static shards like no act-order; full rows are the pre-#41161 bug
    ck, out = fresh("static")
    parts = [_w2_scales(out, r) for r in range(2)]
    assert parts[0].shape == (4, I // 2 // 32, H)
    full = torch.cat(parts, dim=1)
    for r in range(2):
        rewrite(out, r, w2_weight_scale=full)
    if mode == "buggy_repack":
        rehash(out)
    report = verify(ck, out)
    assert not report.passed
    for r in range(2):
        assert_round_trip(report, expert=0, rank=r, words=("w2_weight_scale", "(8, 256)"))


@pytest.mark.parametrize("mode", ["plain", "buggy_repack"])
def test_w13_scales_with_engine_size_k_quirk(fresh, mode):
    # size_k = I_p (128) == group_size: the single permutation instead of the grouped one
    ck, out = fresh("g128")
    p, gs = 128, 128
    for r in range(2):
        s = read(out, r, "w13_weight_scale")
        quirk = torch.stack([marlin_permute_scales(marlin_unpermute_scales(s[e], H, 2 * p, gs), p, 2 * p, gs)
                             for e in range(4)])
        assert not quirk.equal(s)
        patch(out, r, "w13_weight_scale", quirk)
    if mode == "buggy_repack":
        rehash(out)
    report = verify(ck, out)
    assert not report.passed
    for r in range(2):
        for e in range(4):
            assert_round_trip(report, expert=e, rank=r, words=("w13_weight_scale",))
    assert numerics_failed(report)


@pytest.mark.parametrize("mode", ["plain", "buggy_repack"])
def test_ranks_reordered(fresh, mode):
    ck, out = fresh("g128")
    (out / "rank-0").rename(out / "tmp")
    (out / "rank-1").rename(out / "rank-0")
    (out / "tmp").rename(out / "rank-1")
    if mode == "buggy_repack":
        rehash(out)
    report = verify(ck, out)
    assert not report.passed
    if mode == "plain":
        # every expert tensor file of both ranks differs from what the manifest records at its
        # path (the files of non-expert tensors are the same in every rank)
        assert_manifest_only_names(report, *(_rel(out, r, k) for r in range(2) for k in (
            "w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale")))
    for r in range(2):
        assert_round_trip(report, expert=0, rank=r, words=("differs",))


def test_wrong_scale_caught_by_round_trip_and_by_numerics(fresh):
    ck, out = fresh("g128")
    s = read(out, 0, "w2_weight_scale")
    s[3] = (s[3].float() * 1.05).to(s.dtype)
    patch(out, 0, "w2_weight_scale", s)
    rehash(out)
    report = verify(ck, out)
    assert not findings(report, "manifest")
    assert_round_trip(report, expert=3, rank=0, words=("w2_weight_scale", "down_proj"))
    assert numerics_failed(report)


def test_numerics_alone_catch_a_wrong_scale(fresh, monkeypatch):
    # Silence both bit-exact comparisons: the per-rank one and the re-assembly one.
    monkeypatch.setattr(verify_mod, "_compare", lambda expected, got, spec: None)
    monkeypatch.setattr(verify_mod, "first_difference", lambda a, b: None)
    ck, out = fresh("g128")
    assert verify(ck, out).passed  # the silenced verify still passes a correct output
    s = read(out, 0, "w2_weight_scale")
    s[3] = (s[3].float() * 1.05).to(s.dtype)
    patch(out, 0, "w2_weight_scale", s)
    rehash(out)
    report = verify(ck, out)
    assert not report.findings
    (n,) = report.numerics
    assert not n.passed and n.layer == PREFIX
    assert n.violations > 0 and n.max_error_over_bound > 1
    assert n.bound_used > 1  # the margin figure says so too: far beyond the bound


# ---- file-level faults --------------------------------------------------------------------------------------


def test_non_expert_tensor_modified(fresh):
    ck, out = fresh("g128")
    name = "model.embed_tokens.weight"
    t = read(out, 0, name)
    t.view(torch.int16)[5, 7] ^= 1  # one byte
    patch(out, 0, name, t)
    report = verify(ck, out)
    assert_manifest_only_names(report, _rel(out, 0, name), "blake3 differs")
    rehash(out)  # the buggy-repack variant: only the copied-tensor check can see it
    report = verify(ck, out)
    assert not report.passed and not findings(report, "manifest")
    (f,) = findings(report, "round_trip")
    assert f.rank == 0 and name in f.message and "rank 0" in f.message


def test_side_file_modified(fresh):
    ck, out = fresh("g128")
    cfg = out / "config.json"
    data = bytearray(cfg.read_bytes())
    data[10] ^= 0x20
    cfg.write_bytes(bytes(data))
    report = verify(ck, out)
    assert not report.passed
    assert_manifest_only_names(report, "config.json", "blake3 differs")
    assert not findings(report, "round_trip")


def test_tensor_added_to_rank_file(fresh):
    ck, out = fresh("g128")
    rewrite(out, 1, extra=torch.zeros(4))
    index_path = out / "rank-1" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][f"{PREFIX}.extra"] = rank_file(out, 1).name
    index_path.write_text(json.dumps(index))
    rehash(out)
    report = verify(ck, out)
    assert not report.passed
    assert any(f.rank == 1 and f"{PREFIX}.extra" in f.message and "not part of the planned output" in f.message
               for f in findings(report, "round_trip")), [f.to_json() for f in report.findings]


def test_file_added(fresh):
    ck, out = fresh("g128")
    (out / "rank-0" / "extra.safetensors").write_bytes(b"x")
    report = verify(ck, out)
    assert not report.passed
    assert_manifest_only_names(report, "rank-0/extra.safetensors", "not listed in the manifest")


def test_file_missing(fresh):
    ck, out = fresh("g128")
    (out / "rank-1" / "model.safetensors.index.json").unlink()
    report = verify(ck, out)
    assert not report.passed
    assert_manifest_only_names(report, "rank-1/model.safetensors.index.json", "missing")


def test_checkpoint_changed_after_repack(outputs, tmp_path):
    src, _ = outputs("g128")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)), out)
    assert verify(ck, out).passed
    # header-level change: the fingerprint
    cfg = json.loads((ck / "config.json").read_text())
    cfg["note"] = "edited"
    (ck / "config.json").write_text(json.dumps(cfg))
    report = verify(ck, out)
    assert not report.passed
    assert_manifest_only_names(report, "fingerprint mismatch")
    # data-level change (headers intact, so the fingerprint cannot see it): the round trip does
    shutil.rmtree(ck)
    shutil.copytree(src, ck)
    name = f"{PREFIX}.1.down_proj.weight_packed"
    shard = next(p for p in ck.glob("*.safetensors") if name in read_dir_names(p))
    t = read_dir(ck)[name]
    t[0, 0] ^= 0x0F  # down's K columns 0..7: rank 0
    t[0, -1] ^= 0x0F  # and 248..255: rank 1
    patch_tensor(shard, name, t)
    report = verify(ck, out)
    assert not findings(report, "manifest")
    for r in range(2):
        assert_round_trip(report, expert=1, rank=r, words=("w2_weight_packed", "down_proj"))


def read_dir_names(path: Path) -> list[str]:
    with safe_open(path, framework="pt") as so:
        return list(so.keys())


# ---- every demo variant verifies -----------------------------------------------------------------------------

# The round-trip matrix of tests/repacking/test_pipeline.py verifies int4/int8, every group size, asym,
# act-order, TP 1/2/4 and EP; these add the other architectures, mixed precision and dtypes.
VARIANTS = [
    # the demo targets Mixtral's experts by their names w1/w3/w2, which vLLM looks up only from 0.32.0
    (dict(arch="mixtral", **BASE), RepackSettings(vllm="0.32.0", tp=2)),
    (dict(arch="deepseek_v3", num_layers=2, num_experts=4, vocab_size=64), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2, ep=True)),
    (dict(arch="qwen2_moe", group_size=64, **BASE), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=4)),
    (dict(mixed="layer", num_layers=2, num_experts=4, vocab_size=64), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)),
    (dict(actorder="weight", group_size=64, symmetric=False, **BASE), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)),
    (dict(group_size=-1, channel_group_size_null=True, **BASE), RepackSettings(vllm="0.30.0", tp=2)),  # fixed there
    (dict(dtype="float16", num_bits=8, group_size=32, **BASE), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=1)),
    (dict(arch="mixtral", actorder="group", group_size=64, **BASE), RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)),
]


@pytest.mark.parametrize("spec,settings", VARIANTS,
                         ids=["mixtral", "deepseek_v3-ep", "qwen2_moe-tp4", "mixed-layer", "weight-asym",
                              "channel-null", "fp16-int8", "mixtral-actorder"])
def test_correct_repack_of_demo_variants_passes(ckpt, tmp_path, spec, settings):
    ck = ckpt(**spec)
    if spec.get("arch") == "mixtral" and spec.get("actorder") == "group":
        # act-order loads only before 0.30.0, where vLLM looks expert 0 up under gate_proj/up_proj/
        # down_proj: a config whose target also matches those names is one such a release loads
        ck = _also_target_gate_up_down_names(ck, tmp_path / "ckpt")
    plan = plan_repack(ck, settings)
    run_repack(plan, tmp_path / "out")
    report = verify(ck, tmp_path / "out")
    assert report.passed, [f.to_json() for f in report.findings] + [n.to_json() for n in report.numerics]
    assert report.layers_checked == len(plan.jobs) >= 1
    assert all(n.experts_exercised == n.num_experts for n in report.numerics)


def _also_target_gate_up_down_names(ck: Path, dst: Path) -> Path:
    shutil.copytree(ck, dst)
    config = json.loads((dst / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = [t.replace("(w1|w2|w3)", "(w1|w2|w3|gate_proj|up_proj|down_proj)") for t in group["targets"]]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_cli_verify_json(outputs):
    ck, out = outputs("actorder")
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(QUESTIONS),
                                   "--num-samples", "8", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["passed"] and doc["manifest_ok"] and doc["round_trip_ok"] and doc["numerics_ok"]
    assert doc["findings"] == [] and doc["numerics"][0]["layer"] == PREFIX


def test_cli_verify_failure_exit_1(fresh):
    ck, out = fresh("g128")
    w2 = read(out, 1, "w2_weight_packed")
    w2[2, 0, 0] ^= 1
    patch(out, 1, "w2_weight_packed", w2)
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(QUESTIONS),
                                   "--num-samples", "8", "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert not doc["passed"] and not doc["manifest_ok"] and not doc["round_trip_ok"]
    assert any(f["expert"] == 2 and f["rank"] == 1 for f in doc["findings"])


# ---- bad input ------------------------------------------------------------------------------------------------


def _one_line_error(res, code: int = 2) -> str:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error:") and len(lines) <= 2, res.stderr
    assert all(ln.startswith(("error:", "hint:")) for ln in lines), res.stderr
    return lines[0]


def test_output_without_manifest(outputs, tmp_path):
    ck, _ = outputs("g128")
    (tmp_path / "out").mkdir()
    res = CliRunner().invoke(cli, ["verify", str(ck), str(tmp_path / "out"), "--samples", str(QUESTIONS)])
    line = _one_line_error(res)
    assert "wna16ctl.json" in line and "missing" in line


def test_partial_output_points_at_resume(fresh):
    ck, out = fresh("g128")
    (out / MANIFEST_NAME).unlink()
    (out / ".wna16ctl-journal.json").write_text("{}")
    with pytest.raises(BadInput, match="--resume"):
        verify(ck, out)


def test_samples_file_missing(outputs, tmp_path):
    ck, out = outputs("g128")
    missing = tmp_path / "data" / "nope.jsonl"  # a path, never a dataset id to look up online
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(missing)])
    line = _one_line_error(res)
    assert str(missing) in line and "no such file" in line


@pytest.mark.parametrize("content,words", [
    ("", "no samples"),
    ('{"question": "one?"}\nnot json\n', ":2: not a JSON line"),
    ('{"answer": "4"}\n', ":1: has no string 'question' field"),
])
def test_samples_file_unusable(outputs, tmp_path, content, words):
    ck, out = outputs("g128")
    samples = tmp_path / "s.jsonl"
    samples.write_text(content)
    with pytest.raises(BadInput, match=re.escape(words)):
        verify_output(ck, out, samples=samples, num_samples=8)


def test_numerics_run_torch_on_every_core(outputs, monkeypatch):
    """The reference, the interval and the torch twin run with one torch thread per core the
    process may use (its affinity, not the machine's count), and the caller's setting comes back."""
    import os

    seen: list[int] = []
    real = verify_mod.judge

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_mod, "judge", counting)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert verify(*outputs("g128")).passed
        assert seen and set(seen) == {3}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# ---- the sharding re-assembles the checkpoint ---------------------------------------------------------


@pytest.mark.parametrize("name", ["g128", "actorder"])
def test_a_reassembly_that_moves_elements_is_a_finding(outputs, monkeypatch, name):
    """The ranks' slices must re-assemble the checkpoint's experts.  Sharding only moves elements,
    the same way for every expert of a layer, so it is proven once per layer on an expert whose
    elements are their own indices: a re-assembly that swaps gate and up (values the random codes
    of one expert could repeat) is a finding of the round trip, and the correct one is none."""
    ck, out = outputs(name)
    assert verify_output(ck, out, numerics=False).passed
    real = verify_mod.unshard_expert

    def gate_up_swapped(*args, **kwargs):
        back = real(*args, **kwargs)
        back["gate"], back["up"] = back["up"], back["gate"]
        return back

    monkeypatch.setattr(verify_mod, "unshard_expert", gate_up_swapped)
    report = verify_output(ck, out, numerics=False)
    bad = report.by_check("round_trip")
    assert not report.passed and bad
    assert all("re-assembled" in f.message and f.expert is None and f.layer for f in bad), bad


def test_a_sharding_that_repeats_a_slice_does_not_reassemble(outputs, monkeypatch):
    """Every rank given rank 0's columns: each element of rank 1's share is lost."""
    from wna16ctl.layout import shard

    ck, out = outputs("g128")
    plan = plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2))
    job = plan.jobs[0]
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader

    checkpoint = open_checkpoint(ck)
    with TensorReader(checkpoint.files) as reader:
        expert = reader.read_expert(job.layer, 0)
    assert verify_mod._sharding_reassembles(expert, job) is None
    real = shard.shard_expert
    monkeypatch.setattr(verify_mod, "shard_expert", lambda e, **kw: real(e, **{**kw, "rank": 0}))
    assert "differs from the checkpoint" in (verify_mod._sharding_reassembles(expert, job) or "")
