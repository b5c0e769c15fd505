"""inspect's verdict: hazard severities decide the exit code with refusals, and every table ends
with one summary line that `--json` carries as data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from wna16ctl.cli import cli
from wna16ctl.planning.inspection import CORRECTNESS, INFO, hazard_severity
from wna16ctl.planning.rules import NEWEST, OLDEST, RELEASES, span

# the demo's shape: hidden 256, intermediate 256, int4 g128; TP 2 gives 128 per rank (<= group 128)
DEMO = dict(num_layers=2, num_experts=8, top_k=2)


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_a_correctness_hazard_is_not_ok(make_ckpt):
    """vLLM 0.30.0 at TP 2 permutes the w13 scales wrongly (vllm PR #50196): it loads, but outputs
    would be wrong, so inspect exits 1 and says so; the JSON names the hazard's severity."""
    ck = make_ckpt(**DEMO)
    res = invoke("inspect", ck, "--tp", "2", "--vllm", "0.30.0")
    assert res.exit_code == 1, res.output
    assert "correctness hazard" in res.stdout and "verdict: loads, but outputs would be wrong" in res.stdout
    assert res.stdout.splitlines()[-1] == "summary: TP 2 loads but outputs would be wrong (correctness hazard above)"
    res = invoke("inspect", ck, "--tp", "2", "--vllm", "0.30.0", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and doc["loadable"] and not doc["ok"]
    (wrong,) = [h for h in doc["hazards"] if h["severity"] == CORRECTNESS]
    assert "#50196" in wrong["text"] and wrong["tp"] == [2] and len(wrong["layers"]) == 2
    assert doc["summary"]["wrong_outputs"] == [2] and doc["summary"]["loads"] == []


def test_informational_hazards_keep_exit_0(make_ckpt):
    ck = make_ckpt(**DEMO)
    res = invoke("inspect", ck, "--tp", "1", "--vllm", "0.30.0", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["ok"], res.output
    assert doc["hazards"] and {h["severity"] for h in doc["hazards"]} == {INFO}  # other releases' outcomes


def test_summary_line_ends_every_table(make_ckpt):
    ck = make_ckpt(**DEMO)
    res = invoke("inspect", ck, "--tp", "1,2,4")
    assert res.exit_code == 1
    line = "summary: loads at TP 1, 2; TP 4 needs --ep (I_p % group without it)"
    lines = res.stdout.splitlines()
    # the summary ends the tables; only the next steps (what to run) follow it
    assert lines[lines.index("next steps:") - 1] == line, res.stdout
    doc = json.loads(invoke("inspect", ck, "--tp", "1,2,4", "--json").stdout)
    assert doc["summary"] == {"vllm": NEWEST, "loads": [1, 2], "wrong_outputs": [], "fails": {"4": ["I_p % group"]},
                              "loads_with_ep": [4], "text": line.removeprefix("summary: ")}
    matrix = invoke("inspect", ck, "--tp", "1,2,4", "--vllm", "all")
    assert matrix.stdout.splitlines()[-1].startswith("summary (vLLM ") and line[9:] in matrix.stdout
    ep = json.loads(invoke("inspect", ck, "--tp", "4", "--ep", "--json").stdout)
    assert ep["summary"]["loads"] == [4] and ep["summary"]["text"] == "loads at TP 4"


@pytest.mark.parametrize("text, severity", [
    ("vLLM 0.27.0–0.29.0: loads on marlin", INFO),
    ("vLLM 0.32.0: fails (outputs are wrong elsewhere)", INFO),  # another release's outcome
    ("needs Marlin tile padding of the intermediate size per partition from 96 to 128", INFO),
    ("with expert parallelism (wna16ctl --ep, vLLM --enable-expert-parallel) this layer loads at 4 ranks", INFO),
    ("vLLM permutes w13 scales ... the channel-wise permutation and outputs are wrong (vllm PR #50196, open)", CORRECTNESS),
    ("actorder 'dynamic' ... it loads the layer and ignores g_idx, so outputs are wrong", CORRECTNESS),
    ("actorder 'dynamic' ... so the layer loads and computes wrong outputs.", CORRECTNESS),
    ("per-expert mixed precision in one MoE layer: ... (load failure or garbage)", CORRECTNESS),
    ("zero points are packed along N: an output shard ... starts inside a packed word when loaded", CORRECTNESS),
])
def test_hazard_severity(text, severity):
    assert hazard_severity(text) == severity


def test_piped_tables_have_no_trailing_spaces_and_keep_words_whole(make_ckpt):
    ck = make_ckpt(**DEMO)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WNA16CTL_")} | {"COLUMNS": "80"}
    res = subprocess.run([sys.executable, "-m", "wna16ctl", "inspect", str(ck), "--tp", "1,2,4"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    lines = res.stdout.splitlines()
    assert not [ln for ln in lines if ln != ln.rstrip()], res.stdout
    assert all(len(ln) <= 80 for ln in lines), res.stdout
    header = next(ln for ln in lines if ln.startswith("layers"))
    assert header.split()[:3] == ["layers", "scheme", "TP"], res.stdout  # never "laye" / "rs", "sch…"
    assert "…" not in res.stdout.split("plan per TP size")[1].split("\n  ")[0]


def test_the_release_matrix_gives_each_release_its_own_verdict(make_ckpt):
    """`--vllm all` decides each cell as the release's own table does: where a release loads TP 2
    with the w13 scale hazard (vllm PR #50196, on Marlin), the cell says "wrong outputs", not the
    backend; that release is not among those that load, and the matrix exits 1."""
    ck = make_ckpt(**DEMO)
    single = {}
    for v in RELEASES:
        res = invoke("inspect", ck, "--tp", "1,2", "--vllm", v, "--json")
        single[v] = (res.exit_code, json.loads(res.stdout))
    wrong = [v for v in RELEASES if single[v][1]["summary"]["wrong_outputs"]]
    right = [v for v in RELEASES if single[v][0] == 0]
    assert wrong and right and "0.30.0" in wrong  # the demo's TP 2 on Marlin (test above)
    res = invoke("inspect", ck, "--tp", "1,2", "--vllm", "all")
    assert res.exit_code == 1, res.output
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in res.stdout.splitlines() if ln.split()[:1] in ([v] for v in RELEASES)}
    for v in RELEASES:
        assert ("wrong outputs" in rows[v]) == (v in wrong), (v, rows[v])
    assert f"loads at every requested TP size on: {span(right)}" in res.stdout
    assert f"outputs would be wrong on: {span(wrong)} at TP 2" in res.stdout
    doc = json.loads(invoke("inspect", ck, "--tp", "1,2", "--vllm", "all", "--json").stdout)
    assert not doc["ok"]
    for entry in doc["versions"]:
        code, own = single[entry["vllm"]]
        assert (entry["ok"], entry["wrong_outputs"]) == (code == 0, own["summary"]["wrong_outputs"]), entry["vllm"]


def test_a_release_the_rulebook_does_not_know_is_named_with_the_verdict(make_ckpt):
    """`--vllm 0.26.0` is planned as the oldest known release: the summary line and the JSON say
    which release the verdict is for, not only a warning on stderr."""
    ck = make_ckpt(**DEMO)
    res = invoke("inspect", ck, "--tp", "1", "--vllm", "0.26.0")
    assert res.exit_code == 0, res.output
    summary = next(ln for ln in res.stdout.splitlines() if ln.startswith("summary:"))
    assert summary == f"summary: for vLLM {OLDEST} (the known release planned for 0.26.0): loads at TP 1"
    doc = json.loads(invoke("inspect", ck, "--tp", "1", "--vllm", "0.26.0", "--json").stdout)
    assert doc["summary"]["vllm"] == OLDEST and doc["summary"]["text"] == summary.removeprefix("summary: ")
    # a known release is named as asked, and its line stays as it was
    doc = json.loads(invoke("inspect", ck, "--tp", "1", "--vllm", "0.30.0", "--json").stdout)
    assert doc["summary"]["vllm"] == "0.30.0" and doc["summary"]["text"] == "loads at TP 1"
