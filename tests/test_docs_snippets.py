"""The docs' snippets and claims held to the code: the user guide's "What to do with the output"
snippet runs as written on a repacked demo, its `inspect` console blocks are the real output, and
the README says what `make test` and inspect's text output do."""

from __future__ import annotations

import json
import re
import shlex
import textwrap

from click.testing import CliRunner

from tests import modelckpt as m
from tests.conftest import REPO_ROOT
from wna16ctl.cli import cli
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack

GUIDE = REPO_ROOT / "docs" / "user-guide.md"
README = REPO_ROOT / "README.md"


def test_output_snippet_runs(make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=1, num_experts=4, top_k=2, vocab_size=64)
    run_repack(plan_repack(ck, RepackSettings(tp=2)), tmp_path / "tp2")
    guide = GUIDE.read_text()
    code = textwrap.dedent(guide.split("## What to do with the output today")[1].split("```python")[1].split("```")[0])
    assert '"/fast/q3-tp2"' in code
    scope: dict = {}
    exec(compile(code.replace('"/fast/q3-tp2"', repr(str(tmp_path / "tp2"))), "user-guide.md", "exec"), scope)
    y = scope["y"]
    assert tuple(y.shape) == (4, scope["layer"]["hidden_size"]) and bool(y.isfinite().all())


def _inspect_blocks(text: str) -> list[tuple[list[str], list[str]]]:
    """Each console block that runs `wna16ctl inspect`: its arguments and the lines it shows after `...`."""
    blocks = []
    for body in re.findall(r"^```console\n(.*?)^```", text, re.M | re.S):
        lines = body.rstrip("\n").split("\n")
        if lines[0].startswith("$ wna16ctl inspect "):
            assert lines[1] == "...", f"the block shows the end of the output after a '...' line: {lines[:2]}"
            blocks.append((shlex.split(lines[0][2:])[1:], lines[2:]))
    return blocks


def test_the_guides_inspect_blocks_are_the_real_output(tmp_path, monkeypatch):
    """The blocks run on the checkpoint the guide names (a Qwen3-30B-A3B W4A16 g128 checkpoint's
    headers, 48 layers of 128 experts) in an 80-column terminal end the real output line for line."""
    q = m.qwen3_30b_a3b(layers=48)
    m.write(tmp_path / "Qwen3-30B-A3B-W4A16", q, m.qwen3_moe(q, q["quantization_config"]), shards=16)
    monkeypatch.chdir(tmp_path)
    blocks = _inspect_blocks(GUIDE.read_text())
    assert any("--suggest" in args for args, _ in blocks), "the --suggest block is checked"
    for args, shown in blocks:
        res = CliRunner().invoke(cli, args, env={"COLUMNS": "80"})
        assert res.exit_code in (0, 1), res.output
        out = res.stdout
        for root in {str(tmp_path.resolve()), str(tmp_path)}:
            out = out.replace(root, ".")
        real = [line.rstrip() for line in out.splitlines()]
        tail = real[max(i for i, line in enumerate(real) if line.startswith("summary")):]
        assert real[-len(shown):] == shown, (f"docs/user-guide.md: the block of `wna16ctl {shlex.join(args)}` should "
                                             "show, after its '...' line:\n" + "\n".join(tail))
    # the --suggest section: "at TP 4 is told EP, then convert --to gptq, then TP 2, then `wna16ctl pad`",
    # 768 -> 1024
    res = CliRunner().invoke(cli, ["inspect", "./Qwen3-30B-A3B-W4A16", "--tp", "4", "--vllm", "0.31.0", "--suggest",
                                   "--json"])
    found = json.loads(res.stdout)["suggestions"]
    assert [s["kind"] for s in found[:3]] == ["ep", "convert", "tp"], found
    pad = next(s for s in found if s["kind"] == "pad")
    assert pad["pad"]["fields"]["moe_intermediate_size"] == {"from": 768, "to": 1024}
    guide = " ".join(GUIDE.read_text().split())
    assert ("`--tensor-parallel-size 4 --enable-expert-parallel`, then `wna16ctl convert --to gptq`, then TP 2, "
            "then `wna16ctl pad`") in guide
    assert "The third is `wna16ctl pad` (768 → 1024;" in guide


def test_the_readme_says_how_many_workers_make_test_runs():
    make = (REPO_ROOT / "Makefile").read_text()
    workers = re.search(r"^TEST_WORKERS \?= (\S+)$", make, re.M)
    cap = re.search(r"^test:.*\n\t.*-n \$\(TEST_WORKERS\) --maxprocesses (\d+)", make, re.M)
    assert workers and workers.group(1) == "logical" and cap, "make test: -n logical (one per core), --maxprocesses N"
    readme = " ".join(README.read_text().split())
    assert f"`make test` is what CI runs (`.ci/run`), with one worker process per core, up to {cap.group(1)}" in readme


def test_the_readme_says_what_follows_an_inspect_table(make_ckpt):
    """After the summary line come only the suggestions and, for one release, the next steps."""
    ck = str(make_ckpt())
    for args, steps in ((["--vllm", "0.32.0"], True), (["--vllm", "all"], False)):
        res = CliRunner().invoke(cli, ["inspect", ck, "--tp", "1,2,4", "--suggest", *args])
        assert res.exit_code == 1, res.output  # TP 4 does not load: suggestions
        lines = res.stdout.splitlines()
        at = [i for i, line in enumerate(lines) if line.startswith("summary")]
        assert len(at) == 1 and at[0] > 3, res.stdout
        after = lines[at[0] + 1:]
        assert any("suggest" in line for line in after), res.stdout
        assert ("next steps:" in after) == steps, res.stdout
        assert all(line == "next steps:" or line.startswith("  ") for line in after), res.stdout
    readme = " ".join(README.read_text().split())
    assert ("Every inspect table is followed by a `summary` line (`summary: loads at TP 1, 2; TP 4 needs --ep ...`), "
            "after which come only the changes `--suggest` finds and, for one release, the next steps") in readme
