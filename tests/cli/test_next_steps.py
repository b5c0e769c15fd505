"""Every command ends with what to run next: inspect per TP size that loads (the layout, the
`repack` and `vllm serve` lines), repack and verify with the serve command of what they wrote or
proved; `--json` carries the same lines as `next_steps`.  The lines are run here as printed."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

from click.testing import CliRunner

from tests.conftest import QUESTIONS
from wna16ctl.cli import cli
from wna16ctl.planning import rules

DEMO = dict(num_layers=2, num_experts=8, top_k=2)  # hidden 256, intermediate 256, int4 g128, 4 heads


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def run_line(line: str, cwd: Path):
    """A printed `wna16ctl ...` line, split as a shell would, run from `cwd`."""
    words = shlex.split(line)
    assert words[0] == "wna16ctl"
    words = [str(cwd / w) if w == words[words.index("-o") + 1] else w for w in words[1:]]
    return CliRunner().invoke(cli, words)


def test_inspect_gives_a_step_for_each_tp_size_that_loads_even_when_others_do_not(make_ckpt):
    ck = make_ckpt(**DEMO)
    res = invoke("inspect", ck, "--tp", "1,2,4,8", "--json")
    assert res.exit_code == 1  # TP 4 and 8 do not load
    steps = json.loads(res.stdout)["next_steps"]
    assert [s["tp"] for s in steps] == [1, 2]
    for s in steps:
        assert s["layout"] == "vllm" and f"--tp {s['tp']} --layout vllm --vllm {rules.NEWEST}" in s["repack"]
        assert s["serve"].startswith("vllm serve ") and f"--tensor-parallel-size {s['tp']}" in s["serve"]
    human = invoke("inspect", ck, "--tp", "1,2,4,8").stdout
    commands = pasted(human.split("next steps:")[1])
    assert [shlex.split(c) for c in commands if c.startswith(("wna16ctl", "vllm"))] == \
        [shlex.split(line) for s in steps for line in (s["repack"], s["serve"])]


def pasted(text: str) -> list[str]:
    """The commands in printed lines as a shell reads them: a trailing backslash continues a line."""
    out, current = [], ""
    for line in text.splitlines():
        current += line.strip()
        if current.endswith("\\"):
            current = current[:-1]
            continue
        out.append(current)
        current = ""
    return out


def test_commands_wider_than_the_terminal_are_continued_not_cut(make_ckpt, monkeypatch):
    # named from its folder, as people type it: the paths stay short enough for a 60-column line
    full = make_ckpt(**DEMO)
    monkeypatch.chdir(full.parent)
    ck = Path(full.name)
    for width in ("60", "80"):
        res = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "2"], env={"COLUMNS": width})
        tail = res.stdout.split("next steps:")[1]
        assert all(len(line) <= int(width) for line in tail.splitlines()), tail
        (step,) = json.loads(invoke("inspect", ck, "--tp", "2", "--json").stdout)["next_steps"]
        assert [shlex.split(step["repack"]), shlex.split(step["serve"])] == \
            [shlex.split(c) for c in pasted(tail) if c.startswith(("wna16ctl", "vllm"))]


def test_the_printed_repack_line_runs_and_its_serve_line_names_the_output(make_ckpt, tmp_path):
    src = make_ckpt(**DEMO)
    odd = tmp_path / "模型 ckpt é"  # spaces and non-ASCII: one shell word once quoted
    shutil.copytree(src, odd)
    (step,) = json.loads(invoke("inspect", odd, "--tp", "2", "--json").stdout)["next_steps"]
    assert shlex.split(step["repack"])[2] == str(odd)
    res = run_line(step["repack"], tmp_path)
    assert res.exit_code == 0, res.output
    out = tmp_path / shlex.split(step["serve"])[2]
    assert (out / "wna16ctl.json").is_file()
    assert "next: serve it with stock vLLM" in res.stdout


def test_the_w13_scale_hazard_offers_the_plugin_first(make_ckpt):
    """A100 at TP 2 with Marlin: vLLM's own processing permutes the w13 scales wrongly; the Marlin
    layout served by the wna16ctl load format is the fix, offered first by --suggest."""
    ck = make_ckpt(**DEMO)
    res = invoke("inspect", ck, "--tp", "2", "--gpu", "a100", "--vllm", "0.32.0", "--suggest", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and not doc["ok"]
    first = doc["suggestions"][0]
    assert first["kind"] == "load_format" and first["for_tp"] == 2
    assert "--layout marlin" in first["flags"] and "--load-format wna16ctl" in first["vllm_flags"]
    (step,) = doc["next_steps"]
    assert step["layout"] == "marlin" and "--gpu sm80" in step["repack"]
    assert "--load-format wna16ctl" in step["serve"] and "--moe-backend marlin" in step["serve"]
    human = invoke("inspect", ck, "--tp", "2", "--gpu", "a100", "--vllm", "0.32.0", "--suggest").stdout
    human = " ".join(human.split())  # suggestions wrap to the console's width
    assert "suggest write the Marlin layout" in human and "outputs right" in human


def test_repack_and_verify_end_with_the_serve_command(make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=1, num_experts=2, top_k=1, vocab_size=64)
    out = tmp_path / "marlin"
    res = invoke("repack", ck, "--tp", "1", "--layout", "marlin", "--vllm", "0.32.0", "-o", out, "-q")
    assert res.exit_code == 0, res.output
    serve = f"vllm serve {out} --load-format wna16ctl --tensor-parallel-size 1 --moe-backend marlin"
    assert serve in pasted(res.stdout)
    j = json.loads(invoke("repack", ck, "--tp", "1", "--layout", "marlin", "--vllm", "0.32.0", "-o", out,
                          "--force", "--json").stdout)
    assert [s["serve"] for s in j["next_steps"]] == [serve]
    rep = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "2", "--json")
    assert rep.exit_code == 0, rep.output
    assert [s["serve"] for s in json.loads(rep.stdout)["next_steps"]] == [serve]


def test_a_hub_checkpoint_is_named_by_its_repo_id_not_the_cache_snapshot():
    from wna16ctl.planning.next_steps import checkpoint_ref, serve_command

    ck = SimpleNamespace(root=Path("/cache/models--org--m/snapshots/abc"),
                         source={"repo_id": "org/m", "revision": "main", "commit": "abc"})
    assert checkpoint_ref(ck) == ("org/m", None)
    ck.source["revision"] = "v2"
    assert checkpoint_ref(ck) == ("org/m@v2", "v2")
    assert serve_command("org/m", None, 2, revision="v2") == "vllm serve org/m --revision v2 --tensor-parallel-size 2"


def test_the_summary_promises_ep_only_where_the_ep_replan_loads(make_ckpt):
    """TP 4 loads with --ep; TP 8 does not (4 attention heads), so it is not said to need --ep."""
    ck = make_ckpt(**DEMO)
    doc = json.loads(invoke("inspect", ck, "--tp", "1,2,4,8", "--json").stdout)
    assert doc["summary"]["loads_with_ep"] == [4]
    assert "TP 8 does not load" in doc["summary"]["text"] and "TP 4 needs --ep" in doc["summary"]["text"]
    ep = invoke("inspect", ck, "--tp", "4", "--ep", "--json")
    assert ep.exit_code == 0, ep.output


def test_verify_of_some_layers_is_partial_never_a_full_pass(make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=2, num_experts=2, top_k=1, vocab_size=64)
    out = tmp_path / "o"
    assert invoke("repack", ck, "--tp", "1", "-o", out, "-q").exit_code == 0
    res = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "2", "--layers", "1", "--json")
    doc = json.loads(res.stdout)
    assert doc["partial"] and doc["layers_selected"] == [1] and doc["layers_not_checked"] == [0], res.output
    assert [n["layer"] for n in doc["numerics"]] == ["model.layers.1.mlp.experts"]
    assert {c["name"]: c["status"] for c in doc["checks"]}["all_layers"] == "not run"
    assert doc["next_steps"] == []  # nothing is offered to serve on a partial proof
    human = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "2", "--layers", "1").stdout
    verdict = next(ln for ln in human.splitlines() if ln.startswith("verdict:"))
    assert "verified in part" in verdict and "layer 0 not checked" in verdict, human
    bad = invoke("verify", ck, out, "--layers", "5")
    assert bad.exit_code == 2 and "no MoE layer 5" in bad.output


def test_demo_ends_with_the_inspect_line_and_it_runs(tmp_path):
    out = tmp_path / "demo ckpt"
    res = invoke("demo", out, "--layers", "1", "--experts", "2", "--no-tokenizer")
    assert res.exit_code == 0, res.output
    line = res.stdout.splitlines()[-1].strip()
    assert line == shlex.join(["wna16ctl", "inspect", str(out), "--tp", "1,2"])
    ran = CliRunner().invoke(cli, shlex.split(line)[1:])
    assert ran.exit_code in (0, 1) and "next steps:" in ran.stdout, ran.output


def test_assemble_ends_with_the_verify_line_and_it_passes(make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=1, num_experts=2, top_k=1, vocab_size=64)
    for r in (0, 1):
        res = invoke("repack", ck, "--tp", "2", "--ranks", r, "-o", tmp_path / f"p{r}", "-q")
        assert res.exit_code == 0, res.output
        shutil.copytree(tmp_path / f"p{r}", tmp_path / "all", dirs_exist_ok=True)
    res = invoke("assemble", tmp_path / "all")
    assert res.exit_code == 0, res.output
    line = res.stdout.splitlines()[-1].strip()
    assert shlex.split(line) == ["wna16ctl", "verify", str(ck), str(tmp_path / "all")]
    ran = CliRunner().invoke(cli, shlex.split(line)[1:] + ["--samples", str(QUESTIONS), "--num-samples", "2"])
    assert ran.exit_code == 0 and "verdict: verified" in ran.stdout, ran.output


def test_the_suggested_output_is_a_sibling_of_the_checkpoint_wherever_inspect_runs(make_ckpt, tmp_path, monkeypatch):
    """Run inside the checkpoint (`inspect .`), the repack line's -o is the checkpoint's sibling
    (`../NAME-vllm-tp2`, never `.-vllm-tp2`), and the line runs as printed from there; from another
    directory a relative checkpoint path gives a relative sibling, an absolute one an absolute."""
    ck = tmp_path / "models" / "q3"
    shutil.copytree(make_ckpt(**DEMO), ck)

    def step(path: str) -> dict:
        (s,) = json.loads(invoke("inspect", path, "--tp", "2", "--json").stdout)["next_steps"]
        assert shlex.split(s["serve"])[2] == shlex.split(s["repack"])[-1]
        return s

    assert shlex.split(step(str(ck))["repack"])[-1] == str(tmp_path / "models" / "q3-vllm-tp2")
    monkeypatch.chdir(tmp_path)
    assert shlex.split(step("models/q3/")["repack"])[-1] == "models/q3-vllm-tp2"
    monkeypatch.chdir(ck)
    line = step(".")["repack"]
    assert shlex.split(line)[-1] == "../q3-vllm-tp2"
    res = CliRunner().invoke(cli, shlex.split(line)[1:] + ["-q"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "models" / "q3-vllm-tp2" / "wna16ctl.json").is_file()
