"""The commands behave alike: one --tp parser, --debug anywhere, per-command interrupt messages,
output that follows the terminal width, plurals, and plan rows that do not contradict their errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from tests.conftest import QUESTIONS
from tests.rawckpt import write_raw_checkpoint
from wna16ctl.cli import cli

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)
BOX = set("┏┃━┡│└┘┌┐╇╋┳")


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def one_error_line(res, code: int) -> str:
    assert res.exit_code == code, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error: ") and len(lines) <= 2, res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def python_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wna16ctl", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


# ---- --tp: one parser ------------------------------------------------------------------------------


def test_tp_duplicates_and_spaces_are_one_size(make_ckpt):
    res = invoke("inspect", make_ckpt(**SMALL), "--tp", "2, 2,1", "--json")
    doc = json.loads(res.stdout)
    assert doc["tp"] == [2, 1] and [p["tp"] for p in doc["layers"][0]["plans"]] == [2, 1]


@pytest.mark.parametrize("value,words", [("0", "not a positive integer"), ("two", "not a positive integer"),
                                         ("1,,2", "empty entry"), ("99999", "more than 4096 ranks")])
def test_tp_errors_are_the_same_for_inspect_and_repack(make_ckpt, tmp_path, value, words):
    ck = make_ckpt(**SMALL)
    a = one_error_line(invoke("inspect", ck, "--tp", value), 2)
    b = one_error_line(invoke("repack", ck, "--tp", value, "-o", tmp_path / "o"), 2)
    assert words in a and a == b


def test_repack_takes_one_tp_size(make_ckpt, tmp_path):
    line = one_error_line(invoke("repack", make_ckpt(**SMALL), "--tp", "1,2", "-o", tmp_path / "o"), 2)
    assert "one TP size" in line and "not a valid integer" not in line


def test_tp_beyond_the_intermediate_size_is_refused(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)  # intermediate 256
    for args in (("inspect", ck, "--tp", "1024"), ("repack", ck, "--tp", "1024", "--dry-run")):
        line = one_error_line(invoke(*args), 2)
        assert "--tp 1024" in line and "intermediate size 256" in line


# ---- --debug ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_anywhere_keeps_the_exit_code(tmp_path, where):
    missing = tmp_path / "nope"
    args = ["--debug", "inspect", missing] if where == "before" else ["inspect", missing, "--debug"]
    res = python_cli(*args)
    assert res.returncode == 2, res.stderr  # as without --debug
    assert "Traceback" in res.stderr and "error: " in res.stderr and str(missing) in res.stderr
    plain = python_cli("inspect", missing)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr


# ---- interrupts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "verify", "repack", "demo"])
def test_interrupt_message_belongs_to_the_command(make_ckpt, tmp_path, monkeypatch, command):
    import wna16ctl.demo
    import wna16ctl.planning.inspection
    import wna16ctl.repacking.pipeline
    import wna16ctl.verification.checks

    def interrupt(*a, **kw):
        raise KeyboardInterrupt

    target = {"inspect": (wna16ctl.planning.inspection, "inspect_checkpoint"), "verify": (wna16ctl.verification.checks, "verify_output"),
              "repack": (wna16ctl.repacking.pipeline, "run_repack"), "demo": (wna16ctl.demo, "write_demo_output")}[command]
    monkeypatch.setattr(*target, interrupt)
    ck = make_ckpt(**SMALL)
    args = {"inspect": ["inspect", ck], "verify": ["verify", ck, tmp_path, "--samples", QUESTIONS],
            "repack": ["repack", ck, "--tp", "1", "-o", tmp_path / "o"], "demo": ["demo", tmp_path / "d"]}[command]
    res = invoke(*args)
    assert res.exit_code == 130
    line = one_error_line(res, 130)
    assert line.startswith("error: interrupted")
    assert "--resume" not in line  # repack: stopped before a staging directory existed
    assert {"verify": "nothing was verified", "inspect": "nothing was written", "repack": "nothing was left behind",
            "demo": f"nothing was written to {tmp_path / 'd'}"}[command] in line


def test_a_ctrl_c_while_a_class_is_created_is_an_interrupt(make_ckpt, monkeypatch):
    """A Ctrl-C that lands while a module being imported creates a dataclass reaches the command
    as the RuntimeError Python 3.11 wraps around an exception from `__set_name__`: it is still
    an interrupt (exit 130, the command's message), not an internal error."""
    import wna16ctl.planning.inspection

    class Interrupted:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    def import_interrupted(*a, **kw):
        try:
            type("Created", (), {"field": Interrupted()})
        except KeyboardInterrupt:  # Python 3.12 and later raise it as it is
            raise RuntimeError("Error calling __set_name__") from KeyboardInterrupt()

    monkeypatch.setattr(wna16ctl.planning.inspection, "inspect_checkpoint", import_interrupted)
    res = invoke("inspect", make_ckpt(**SMALL))
    line = one_error_line(res, 130)
    assert line.startswith("error: interrupted") and "nothing was written" in line
    assert "internal error" not in res.stderr


# ---- output width and plain output -------------------------------------------------------------------


def test_inspect_fits_columns_and_is_plain_when_piped(make_ckpt):
    ck = make_ckpt(num_bits=8, group_size=64, actorder="static", **SMALL)  # rows with hazards and long notes
    res = invoke("inspect", ck, "--tp", "1,2,4", "--gpu", "sm80", env={"COLUMNS": "100"})
    lines = res.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 100, res.stdout
    assert not BOX & set(res.stdout), res.stdout  # no box drawing in a pipe
    row = next(ln for ln in lines if ln.startswith("layers 0") or ln.startswith("layer 0") or " 0 " in ln[:12])
    assert "int8" in row and "marlin" in row and "ok" in row, res.stdout  # one row per line: nothing wrapped
    # notes wrap under their own text (a hanging indent), never back to column 0
    notes = [ln for ln in lines if ("note " in ln or "hazard " in ln) and ln.startswith("  layers")]
    assert notes, res.stdout
    start = lines.index(notes[0])
    follow = lines[start + 1]
    indent = len(follow) - len(follow.lstrip())
    assert indent > 2 and follow.strip() and notes[0][indent - 1] == " " and notes[0][indent] != " ", res.stdout
    wide = invoke("inspect", ck, "--tp", "1,2,4", "--gpu", "sm80", env={"COLUMNS": "200"})
    assert max(len(ln) for ln in wide.stdout.splitlines()) > 100  # COLUMNS is followed, not a fixed width


def test_verify_progress_steps_are_reported(make_ckpt, tmp_path):
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
    from wna16ctl.sink import RUN
    from wna16ctl.verification.checks import verify_output

    ck = make_ckpt(**SMALL)
    out = tmp_path / "out"
    starts: list[tuple[str, int, str]] = []
    done: dict[str, int] = {}

    def start(description: str, total: int, *, unit: str = "bytes"):
        starts.append((description, total, unit))
        if unit != RUN or description not in done:  # the whole run's line, started again, keeps its work
            done[description] = 0

        def advance(n: int) -> None:
            done[description] += n

        return advance

    run_repack(plan_repack(ck, RepackSettings(tp=1)), out, progress=start)
    assert [s[0] for s in starts] == ["repacking"] and done["repacking"] == starts[0][1]
    starts.clear()
    verify_output(ck, out, samples=QUESTIONS, num_samples=4, progress=start)
    names = [s[0] for s in starts if s[2] != RUN]
    assert names == ["hashing output files", "round trip and numerics"]
    for description, total, unit in starts:
        if unit != RUN:
            assert done[description] == total > 0  # every step runs to its end
    # the whole run's line spans the steps; restated once the samples are tokenized, reached at the end
    whole = [s for s in starts if s[2] == RUN]
    assert [s[0] for s in whole] == ["whole verify"] * 2 and whole[0] == starts[0]
    assert whole[-1][1] - 2 <= done["whole verify"] <= whole[-1][1]


def test_demo_progress_is_reported(tmp_path):
    from wna16ctl.demo import DemoSpec, write_demo_checkpoint

    steps: list[tuple[str, int]] = []
    advanced: list[int] = []

    def start(description: str, total: int, *, unit: str = "bytes"):
        steps.append((description, total))
        return advanced.append

    write_demo_checkpoint(tmp_path / "d", DemoSpec(**SMALL), progress=start)
    assert steps == [("writing the demo checkpoint", 4)] and sum(advanced) == 4


def test_progress_amounts_use_binary_units():
    from types import SimpleNamespace

    from wna16ctl.sink import _amount_column

    col = _amount_column()
    task = SimpleNamespace(fields={"unit": "bytes"}, completed=3 << 20, total=10 << 20, speed=2 << 20,
                           finished_speed=None)
    text = str(col.render(task))
    assert text == "3.0 MiB/10.0 MiB 2.0 MiB/s"
    task.fields = {"unit": "experts"}
    task.completed, task.total = 3, 16
    assert str(col.render(task)) == "3/16 experts"


# ---- plurals, help, dry run --------------------------------------------------------------------------


def test_plurals(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    res = invoke("inspect", ck, "--tp", "1")
    assert "1 MoE layer ·" in res.stdout and "2 experts" in res.stdout
    res = invoke("repack", ck, "--tp", "1", "-o", tmp_path / "o")
    assert res.exit_code == 0, res.output
    # a file of non-expert tensors and one per expert tensor kind (the line wraps where the tmp path is long)
    words = " ".join(res.stdout.split())
    assert "5 files written" in words and "in 1 rank directory" in words
    out = tmp_path / "o"
    (out / "rank-0" / "model-00005-of-00005.safetensors").unlink()  # then --resume rewrites one file
    res = invoke("repack", ck, "--tp", "1", "-o", out, "--resume")
    assert res.exit_code == 0, res.output
    words = " ".join(res.stdout.split())
    assert "1 file written" in words and "4 reused" in words, res.stdout


def test_help_lists_whole_command_descriptions():
    res = invoke("--help")
    commands = res.stdout.split("Commands:")[1].splitlines()
    for name in ("demo", "inspect", "repack", "verify"):
        (line,) = [ln for ln in commands if ln.strip().startswith(name + " ")]
        assert not line.rstrip().endswith("..."), line
        assert line.rstrip().endswith("."), line


def test_dry_run_json_of_a_plan_that_fails(make_ckpt):
    res = invoke("repack", make_ckpt(), "--tp", "4", "--dry-run", "--json")  # I_p 64 splits the 128 groups
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["loadable"] is False and "divisible by group_size (128)" in doc["error"]
    assert doc["settings"]["tp"] == 4
    assert res.stderr.startswith("error: ")


def test_dry_run_collapses_identical_layers_and_totals_ranks(make_ckpt):
    res = invoke("repack", make_ckpt(num_layers=3, num_experts=2, top_k=1, vocab_size=64), "--tp", "2", "--dry-run")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert sum("model.layers." in ln for ln in lines) == 0
    assert any(ln.startswith("layers 0-2") for ln in lines), res.stdout
    assert any(ln.startswith("0-1") and "each" in ln for ln in lines), res.stdout
    assert any(ln.startswith("total") for ln in lines), res.stdout


# ---- resume and staging --------------------------------------------------------------------------------


def test_resume_names_the_differing_settings(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    out = tmp_path / "out"
    assert invoke("repack", ck, "--tp", "2", "-o", out, "-q").exit_code == 0
    line = one_error_line(invoke("repack", ck, "--tp", "1", "-o", out, "--resume"), 2)
    assert "tp: 2 there, 1 now" in line and "--force" in line
    line = one_error_line(invoke("repack", ck, "--tp", "2", "--max-shard-size", "1MiB", "-o", out, "--resume"), 2)
    assert "max_shard_bytes" in line and "tp:" not in line


def test_resume_says_it_checks_what_an_earlier_run_finished(make_ckpt, tmp_path):
    """--resume over a finished output (another run may have committed it a moment ago) hashes every
    file before reusing it: one line says so, even with -q, instead of a silent wait."""
    ck = make_ckpt(**SMALL)
    out = tmp_path / "out"
    assert invoke("repack", ck, "--tp", "2", "-o", out, "-q").exit_code == 0
    res = invoke("repack", ck, "--tp", "2", "-o", out, "--resume", "-q")
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines() == [
        f"warning: --resume: checking the files an earlier run finished for {out} before reusing them"], res.stderr
    assert "0 files written" in res.stdout


def test_discarded_staging_directory_is_announced(make_ckpt, tmp_path, monkeypatch):
    import wna16ctl.repacking.pipeline as repack_mod
    import wna16ctl.repacking.native_path as repack_native

    ck = make_ckpt(**SMALL)
    out = tmp_path / "out"
    real, real_native = repack_mod.build_rank_tensors, repack_native.LayerBuilder.build_into

    def interrupt(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(repack_mod, "build_rank_tensors", interrupt)  # whichever data path the layers take
    monkeypatch.setattr(repack_native.LayerBuilder, "build_into", interrupt)
    first = invoke("repack", ck, "--tp", "1", "-o", out)
    assert first.exit_code == 130, first.output
    stage = tmp_path / ".out.wna16ctl-partial"
    assert stage.is_dir()
    assert f"interrupted; no output was committed; the staging directory {stage} is kept for --resume" in first.stderr
    monkeypatch.setattr(repack_mod, "build_rank_tensors", real)
    monkeypatch.setattr(repack_native.LayerBuilder, "build_into", real_native)
    res = invoke("repack", ck, "--tp", "1", "-o", out, "-q")  # announced even when quiet
    assert res.exit_code == 0, res.output
    assert "discarded" in res.stderr and str(stage) in res.stderr and "--resume" in res.stderr
    quiet = invoke("repack", ck, "--tp", "1", "-o", out, "--force")  # nothing to discard now
    assert "discarded" not in quiet.stderr


# ---- plan rows ----------------------------------------------------------------------------------------------


def test_failing_rows_name_no_backend(make_ckpt):
    """The release selects its backend, then refuses the layer: --json keeps the backend selected,
    but the row names none (a backend beside "fails" reads as "loads on it"); the status says it
    fails and the note says why."""
    res = invoke("inspect", make_ckpt(), "--tp", "4")  # fails: I_p 64 splits the 128-wide groups
    assert res.exit_code == 1
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("layers 0-1"))
    backend = json.loads(invoke("inspect", make_ckpt(), "--tp", "4", "--json").stdout)["layers"][0]["plans"][0]["backend"]
    assert backend and backend not in row and " — " in row and "fails" in row and "yes" not in row, row
    assert "engine refusal" in res.stdout


def _unquantized_checkpoint(out: Path) -> Path:
    out.mkdir()
    g = torch.Generator().manual_seed(0)
    H, I, E = 128, 128, 2
    t = {"model.embed_tokens.weight": torch.randn(64, H, generator=g).to(torch.bfloat16),
         "model.layers.0.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
         "model.layers.0.mlp.gate.weight": torch.randn(E, H, generator=g).to(torch.bfloat16)}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            t[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=g).to(torch.bfloat16)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
        "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 1, "num_hidden_layers": 1,
        "vocab_size": 64, "torch_dtype": "bfloat16"}))
    return out


def test_an_unquantized_moe_is_not_a_wna16_checkpoint(tmp_path):
    """A bf16 MoE loads in vLLM as it is: bad input (exit 2, one line), not "does not load" (exit 1)."""
    ck = _unquantized_checkpoint(tmp_path / "ck")
    for args in (["inspect", ck, "--tp", "1,2"], ["inspect", ck, "--json"], ["repack", ck, "--tp", "2", "-o", tmp_path / "o"]):
        res = invoke(*args)
        assert res.exit_code == 2, (args, res.output)
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and f"{ck}: not a WNA16 MoE checkpoint: its routed experts are not quantized" in errors[0]
    assert not (tmp_path / "o").exists()


def test_a_model_without_moe_layers_is_not_a_wna16_moe_checkpoint(tmp_path):
    ck = _unquantized_checkpoint(tmp_path / "ck")
    names = {"model.embed_tokens.weight": torch.zeros(64, 128, dtype=torch.bfloat16),
             "model.layers.0.mlp.down_proj.weight": torch.zeros(128, 256, dtype=torch.bfloat16)}
    save_file(names, str(ck / "model.safetensors"), metadata={"format": "pt"})
    res = invoke("inspect", ck)
    assert res.exit_code == 2 and "not a WNA16 MoE checkpoint: no routed-expert MoE layers found" in res.stderr, res.output


# ---- act-order g_idx --------------------------------------------------------------------------------------


def test_inspect_reports_differing_gate_up_g_idx_like_repack(tmp_path):
    # hand-built: every projection draws its own act-order permutation
    ck = write_raw_checkpoint(tmp_path / "ck", hidden=256, intermediate=128, group_size=64, actorder="group")
    res = invoke("inspect", ck, "--tp", "1", "--json", "--vllm", "0.29.0")  # a release with act-order
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    (plan,) = doc["layers"][0]["plans"]
    assert not plan["loadable"]
    (err,) = [e for e in plan["errors"] if "g_idx" in e]
    assert "gate_proj.weight_g_idx and" in err and "up_proj.weight_g_idx differ" in err
    repack_line = one_error_line(invoke("repack", ck, "--tp", "1", "--dry-run", "--vllm", "0.29.0"), 1)
    assert err in repack_line  # the one check, the same words


def test_progress_bars_draw_on_a_terminal(monkeypatch):
    import io

    from rich.console import Console

    from wna16ctl.sink import Sink

    sink = Sink()
    buffer = io.StringIO()
    monkeypatch.setattr(Sink, "progress_enabled", lambda self: True)
    sink.__dict__["err"] = Console(file=buffer, force_terminal=True, width=100)
    with sink.tasks() as start:
        advance = start("hashing output files", 3 << 20, unit="bytes")
        advance(3 << 20)
        step = start("round trip and numerics", 4, unit="experts")
        for _ in range(4):
            step(1)
    text = buffer.getvalue()
    assert "hashing output files" in text and "MiB" in text and "experts" in text
    assert " MB" not in text and "MB/s" not in text.replace("MiB/s", "")


def test_verify_shows_the_whole_run_time_left_on_a_terminal(make_ckpt, tmp_path, monkeypatch):
    """verify with progress on: one line gives the time left for the whole verify, from the
    hashing on, beside each step's own bar."""
    from wna16ctl.sink import Sink

    ck = make_ckpt(**SMALL)
    out = tmp_path / "o"
    assert invoke("repack", ck, "--tp", "1", "-o", out, "-q").exit_code == 0
    monkeypatch.setattr(Sink, "progress_enabled", lambda self: True)
    res = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "4",
                 env={"TTY_COMPATIBLE": "1", "COLUMNS": "160"})
    assert res.exit_code == 0, (res.stdout, res.stderr)
    assert re.search(r"about \d+:\d\d:\d\d left for the whole verify", res.stderr), res.stderr
    assert "hashing output files" in res.stderr


# ---- repack and verify refuse what inspect refuses ---------------------------------------------------------

HEADS = "Total number of attention heads (4) must be divisible by tensor parallel size (8)"


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_repack_refuses_the_model_checks_inspect_refuses(make_ckpt, tmp_path, ep):
    """The demo's 4 attention heads do not split over 8 ranks: the experts alone would load
    (group size 32 splits at TP 8), the model does not, and every command says so alike."""
    ck = make_ckpt(num_layers=1, num_experts=8, group_size=32, vocab_size=64)
    flags = ["--ep"] if ep else []
    res = invoke("inspect", ck, "--tp", "8", *flags)
    assert res.exit_code == 1 and HEADS in " ".join(res.stdout.split()), res.stdout
    out = tmp_path / "o"
    for args in (["-o", out], ["--dry-run"]):
        line = one_error_line(invoke("repack", ck, "--tp", "8", *flags, *args), 1)
        assert HEADS in line and "no known vLLM release loads it" in line, line
    assert not out.exists() and not any(tmp_path.iterdir())
    dry = invoke("repack", ck, "--tp", "8", *flags, "--dry-run", "--json")
    assert dry.exit_code == 1 and json.loads(dry.stdout)["loadable"] is False and HEADS in json.loads(dry.stdout)["error"]


def test_verify_fails_an_output_the_release_does_not_load(make_ckpt, tmp_path, monkeypatch):
    """An output written without the model-level checks (as earlier versions did) is not verified."""
    ck = make_ckpt(num_layers=1, num_experts=8, group_size=32, vocab_size=64)
    out = tmp_path / "o"
    with monkeypatch.context() as m:
        m.setattr("wna16ctl.repacking.pipeline.model_refusal", lambda *a, **k: None, raising=False)
        assert invoke("repack", ck, "--tp", "8", "-o", out, "-q").exit_code == 0
    res = invoke("verify", ck, out, "--samples", QUESTIONS, "--num-samples", "4", "--json")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    assert report["passed"] is False
    assert any(HEADS in f["message"] for f in report["findings"]), report["findings"]


# ---- verify checks its inputs in the documented order -------------------------------------------------------


def test_verify_refuses_an_unquantized_checkpoint_before_looking_for_samples(make_ckpt, tmp_path):
    """docs/verify.md: checkpoint, output, device, samples.  A bf16 MoE is named as such even where
    no samples can be found."""
    ck = _unquantized_checkpoint(tmp_path / "ck")
    out = tmp_path / "o"
    assert invoke("repack", make_ckpt(**SMALL), "--tp", "1", "-o", out, "-q").exit_code == 0
    res = invoke("verify", ck, out, env={"WNA16CTL_SAMPLES": str(tmp_path / "missing.jsonl")})
    line = one_error_line(res, 2)
    assert f"{ck}: not a WNA16 MoE checkpoint: its routed experts are not quantized" in line, line


PAD_SMALL = dict(hidden_size=128, num_experts=4, num_layers=1, intermediate_size=128, num_shards=2)


@pytest.mark.parametrize("command", ["repack", "pad"])
def test_output_under_a_file_says_not_a_directory(make_ckpt, tmp_path, command):
    """-o below something that is not a directory (a file here; /dev/full for a user) names that,
    not mkdir's "File exists"."""
    ck = make_ckpt(**PAD_SMALL)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = {"repack": ["repack", ck, "--tp", "1"], "pad": ["pad", ck, "--tp", "2", "--vllm", "0.32.0"]}[command]
    res = invoke(*args, "-o", blocker / "out")
    line = one_error_line(res, 2)
    assert "not a directory" in line and "File exists" not in line, line
    assert blocker.read_text() == "x"


def _serve_lines(text: str) -> list[str]:
    """The `vllm serve` lines of a command's output, continuation lines joined."""
    joined = " ".join(text.replace(" \\\n", " ").split())
    return ["vllm serve " + part.split(" wna16ctl ")[0].split(" next: ")[0].strip()
            for part in joined.split("vllm serve ")[1:]]


@pytest.mark.parametrize("release", ["0.32.0", "0.29.0"])
def test_inspect_repack_pad_and_verify_print_one_serve_path(make_ckpt, tmp_path, release):
    """A checkpoint that loads at TP 4 only once padded: pad's next line, inspect of the padded
    checkpoint, repack of the layout inspect names, verify of the padding and verify of the output
    all print the same serve line (planning.serving.serve_path decides it for each)."""
    ck = make_ckpt(num_layers=1, num_experts=4, top_k=1, vocab_size=64)
    padded = tmp_path / "padded"
    pad = invoke("pad", ck, "--tp", 4, "--vllm", release, "-o", padded)
    assert pad.exit_code == 0, pad.output
    step = json.loads(invoke("inspect", padded, "--tp", 4, "--vllm", release, "--json").stdout)["next_steps"]
    assert len(step) == 1, step
    step = step[0]
    assert step["layout"] is not None and step["repack"], step  # a pre-sharded layout applies to the padded one
    assert _serve_lines(pad.stdout) == [step["serve"]], pad.stdout
    proof = invoke("verify", ck, padded)
    assert proof.exit_code == 0 and _serve_lines(proof.stdout) == [step["serve"]], proof.stdout
    out = step["repack"].split(" -o ")[-1].strip("'")
    repack = invoke(*step["repack"].split()[1:-2], "-o", out)
    assert repack.exit_code == 0, repack.output
    assert _serve_lines(repack.stdout) == [step["serve"]], repack.stdout
    proved = invoke("verify", padded, out)
    assert proved.exit_code == 0 and _serve_lines(proved.stdout) == [step["serve"]], proved.stdout
