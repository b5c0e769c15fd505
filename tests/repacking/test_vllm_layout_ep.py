"""`repack --layout vllm --ep`: under --enable-expert-parallel each rank's expert buffers hold its
local experts whole, in vLLM's linear placement (determine_expert_map), and `verify` proves them;
the serve lines of repack, verify and inspect are one answer.  The key contract against vLLM's own
model build under EP is tests/conformance/test_vllm_state_contract.py."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from wna16ctl.cli import cli
from wna16ctl.output.writer import FILE_HASH, MANIFEST_NAME, hash_file

_EXP = "model.layers.0.mlp.experts.routed_experts."


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _checkpoint(ck: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(ck.glob("*.safetensors")):
        out |= _tensors(path)
    return out


def test_each_rank_holds_its_local_experts_whole_in_vllms_linear_order(make_ckpt, tmp_path):
    """5 experts on 2 ranks: rank 0 holds experts 0-2, rank 1 experts 3-4 (the first E % n ranks one
    more), each whole (the experts' TP size is 1); the router keeps every expert's row."""
    ck = make_ckpt(num_experts=5)
    out = tmp_path / "ep"
    res = invoke("repack", ck, "--tp", 2, "--ep", "--layout", "vllm", "--vllm", "0.32.0", "-o", out)
    assert res.exit_code == 0, res.output
    ranks = [_tensors(out / f"model-rank-{r}-part-0.safetensors") for r in range(2)]
    src = _checkpoint(ck)
    for r, held in ((0, [0, 1, 2]), (1, [3, 4])):
        w13 = ranks[r][_EXP + "w13_weight_packed"]
        assert w13.shape == (len(held), 2 * 256, 256 // 8)  # gate and up rows whole: 2 x 256
        assert ranks[r][_EXP + "w2_weight_packed"].shape == (len(held), 256, 256 // 8)
        assert ranks[r]["model.layers.0.mlp.experts.gate.weight"].shape == (5, 256)
        for i, e in enumerate(held):
            gate, up = (src[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight_packed"] for p in ("gate", "up"))
            assert torch.equal(w13[i], torch.cat([gate, up]))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["ep"] is True and manifest["identity"]["settings"]["ep"] is True
    serve = f"vllm serve {out} --load-format sharded_state --tensor-parallel-size 2 --enable-expert-parallel"
    assert manifest["serve"] == serve and serve in " ".join(res.output.split())
    assert "for 2 ranks (expert parallel) of vLLM 0.32.0" in " ".join(res.output.split())
    rep = invoke("verify", ck, out)
    assert rep.exit_code == 0 and "PASS" in rep.output, rep.output
    assert serve in " ".join(rep.output.split())


@pytest.mark.parametrize("arch,release", [("deepseek_v3", "0.29.0"), ("qwen3_moe", "0.27.1")])
def test_k_first_releases_and_mla_round_trip_under_ep(make_ckpt, tmp_path, arch, release):
    """Before 0.31 the expert buffers are K-first (each whole expert transposed); DeepSeek's shared
    experts and dense MLP stay split by TP while its routed experts are whole."""
    ck = make_ckpt(arch=arch)
    out = tmp_path / "o"
    res = invoke("repack", ck, "--tp", 2, "--ep", "--layout", "vllm", "--vllm", release, "-o", out, "--json")
    assert res.exit_code == 0, res.output
    layer = 1 if arch == "deepseek_v3" else 0
    keys = _tensors(out / "model-rank-1-part-0.safetensors")
    exp = f"model.layers.{layer}.mlp.experts.routed_experts."
    assert keys[exp + "w13_weight_packed"].shape == (4, 256 // 8, 2 * 256)  # 4 of 8 experts, K-first, whole
    if arch == "deepseek_v3":
        shared = keys[f"model.layers.{layer}.mlp.experts._shared_experts._layer.down_proj.weight"]
        assert shared.shape[1] * 2 == _checkpoint(ck)[f"model.layers.{layer}.mlp.shared_experts.down_proj.weight"].shape[1]
    assert json.loads(res.stdout)["ep"] is True
    rep = invoke("verify", ck, out)
    assert rep.exit_code == 0 and "PASS" in rep.output, rep.output


def test_verify_catches_experts_placed_on_the_wrong_rank(make_ckpt, tmp_path):
    """Round-robin's placement (rank 0: experts 0, 2, ...) written where vLLM builds the linear one:
    the shapes fit, the experts do not."""
    ck = make_ckpt()
    out = tmp_path / "o"
    assert invoke("repack", ck, "--tp", 2, "--ep", "--layout", "vllm", "--vllm", "0.32.0", "-o", out).exit_code == 0
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    paths = [bad / f"model-rank-{r}-part-0.safetensors" for r in range(2)]
    ranks = [_tensors(p) for p in paths]
    for key in [k for k in ranks[0] if k.startswith(_EXP) and ranks[0][k].shape[0] == 4]:
        whole = torch.cat([ranks[0][key], ranks[1][key]])
        ranks[0][key], ranks[1][key] = whole[0::2].contiguous(), whole[1::2].contiguous()
    manifest = json.loads((bad / MANIFEST_NAME).read_text())
    for path, tensors in zip(paths, ranks):
        save_file(tensors, str(path), metadata={"format": "pt"})
        manifest["files"][path.name][FILE_HASH] = hash_file(path)
        manifest["files"][path.name]["bytes"] = path.stat().st_size
    (bad / MANIFEST_NAME).write_text(json.dumps(manifest))
    res = invoke("verify", ck, bad)
    assert res.exit_code == 1 and "expert 1: differs from model.layers.0.mlp.experts.1." in " ".join(res.output.split())


def _run_repack_line(line: str, where: Path):
    """A printed repack line run with its output directory moved into `where` (same name)."""
    words = shlex.split(line)
    named = words[words.index("-o") + 1]
    out = where / Path(named).name
    return CliRunner().invoke(cli, [str(out) if w == named else w for w in words[1:]] + ["--json"]), out


@pytest.mark.parametrize("args", [("--ep",), ("--vllm", "0.29.0", "--moe-backend", "humming"),
                                  ("--ep", "--vllm", "0.29.0", "--moe-backend", "humming")])
def test_repack_verify_and_inspect_print_one_serve_line_for_the_vllm_layout(make_ckpt, tmp_path, args):
    """inspect's repack line, run as printed, writes the output its serve line names; repack and
    verify close with that same serve line (a non-auto --moe-backend included: before 0.31 the
    backend decides the expert buffers' shapes, so vLLM must be started with it)."""
    ck = make_ckpt()
    doc = json.loads(invoke("inspect", ck, "--tp", 2, *args, "--json").stdout)
    (step,) = [s for s in doc["next_steps"] if s["tp"] == 2]
    assert step["layout"] == "vllm", step
    assert ("--ep" in shlex.split(step["repack"])) == ("--ep" in args)
    assert Path(shlex.split(step["serve"])[2]).name.endswith("-vllm-tp2-ep" if "--ep" in args else "-vllm-tp2")
    res, out = _run_repack_line(step["repack"], tmp_path)
    assert res.exit_code == 0, res.output
    want = shlex.split(step["serve"])
    want[2] = str(out)
    written = json.loads(res.stdout)
    assert [shlex.split(s["serve"]) for s in written["next_steps"]] == [want]
    assert shlex.split(written["serve"]) == want
    assert ("--enable-expert-parallel" in want) == ("--ep" in args)
    assert ("humming" in want) == ("humming" in args)
    rep = invoke("verify", ck, out, "--json")
    assert rep.exit_code == 0, rep.output
    assert [shlex.split(s["serve"]) for s in json.loads(rep.stdout)["next_steps"]] == [want]
