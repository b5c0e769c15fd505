"""How results and refusals read: byte counts in the same human units everywhere, counts with
their plural, sentences joined without stray full stops, a directory called a directory."""

from __future__ import annotations

import re

from click.testing import CliRunner

from tests.conftest import QUESTIONS
from wna16ctl.cli import cli

DEMO = dict(num_layers=2, num_experts=8, top_k=2)
SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64)
HUMAN_BYTES = re.compile(r"\d+(\.\d)? (B|KiB|MiB|GiB|TiB)\b")


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_every_dry_run_prints_byte_counts_in_human_units(make_ckpt):
    ck = make_ckpt(**DEMO)
    for layout in ("marlin", "vllm"):
        res = invoke("repack", ck, "--tp", "2", "--layout", layout, "--vllm", "0.33.0", "--dry-run")
        assert res.exit_code == 0, res.output
        assert not re.search(r"\d{4,} bytes", res.stdout), (layout, res.stdout)
        assert HUMAN_BYTES.search(res.stdout), (layout, res.stdout)
        assert "(s)" not in res.stdout, res.stdout


def test_vllm_layout_result_counts_read_as_words(make_ckpt, tmp_path):
    res = invoke("repack", make_ckpt(**SMALL), "--tp", "1", "--layout", "vllm", "--vllm", "0.33.0",
                 "-o", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert "(s)" not in res.stdout and re.search(r"wrote 1 file for 1 rank of vLLM", res.stdout), res.stdout


def test_a_refusal_joins_the_engine_sentence_without_its_full_stop(make_ckpt):
    res = invoke("repack", make_ckpt(**DEMO), "--tp", "4", "--dry-run")
    assert res.exit_code == 1
    assert ".;" not in res.output and "expert parallelism; " in res.output, res.output


def test_one_option_without_scheme_is_named_in_the_singular(make_ckpt):
    res = invoke("inspect", make_ckpt(**DEMO), "--group-size", "64")
    assert res.exit_code == 2
    assert "--group-size applies only to a proposed quantization" in res.output, res.output


def test_samples_that_is_a_directory_is_called_one(make_ckpt, tmp_path):
    ck = make_ckpt(**SMALL)
    invoke("repack", ck, "--tp", "1", "-o", tmp_path / "o", "-q")
    res = invoke("verify", ck, tmp_path / "o", "--samples", QUESTIONS.parent, "--num-samples", "2")
    assert res.exit_code == 2
    assert "is a directory" in res.output and "no such file" not in res.output, res.output


def test_every_usage_error_is_one_line_naming_the_option_and_the_fix(tmp_path):
    """click's own usage errors (an unknown option, a bad value, a missing argument, an unknown
    command) and the commands' (options that exclude each other) read like every other refusal:
    one `error:` line on stderr, exit 2, naming the option and where the fix is; --debug adds the
    traceback only."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    cases = [
        (("repack", ck, "--tp", "2", "-o", out, "--max-shard-size", "0"),
         "Invalid value for '--max-shard-size': '0': size must be positive (e.g. 4GiB, 500MB); "
         "see 'wna16ctl repack --help'"),
        (("inspect", ck, "--bogus"), "No such option '--bogus'"),
        (("inspect", "--tp"), "Option '--tp' requires an argument; see 'wna16ctl inspect --help'"),
        (("demo",), "Missing argument 'OUT'; usage: wna16ctl demo [OPTIONS] OUT"),
        (("demo", out, "--bits", "9"), "Invalid value for '--bits': '9' is not one of"),
        (("verify", ck), "Missing argument 'OUT'; usage: wna16ctl verify [OPTIONS] CKPT OUT"),
        (("pad", ck, "--tp", "2"), "-o/--output is required (or pass --dry-run); see 'wna16ctl pad --help'"),
        (("repack", ck, "--tp", "2", "-o", out, "--force", "--resume"), "--force and --resume exclude each other"),
        (("inspect", ck, "extra"), "Got unexpected extra argument (extra); usage: wna16ctl inspect [OPTIONS] CKPT"),
        (("nosuch",), "No such command 'nosuch'; see 'wna16ctl --help'"),
    ]
    for args, said in cases:
        res = CliRunner().invoke(cli, [str(a) for a in args], prog_name="wna16ctl")
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and res.stdout == "", (args, res.output)
        assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], (args, res.stderr)
        assert "Usage:" not in res.stderr and "Try '" not in res.stderr, (args, res.stderr)
    res = CliRunner().invoke(cli, ["demo", "--debug"], prog_name="wna16ctl")
    assert res.exit_code == 2 and "Traceback" in res.stderr, res.output
    assert res.stderr.strip().splitlines()[-1] == "error: Missing argument 'OUT'; usage: wna16ctl demo [OPTIONS] OUT"


def test_usage_errors_of_the_program_are_one_line_too(tmp_path):
    """The installed program (click's standalone handling in `main`), not only the test runner's call."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "wna16ctl", "repack", str(tmp_path), "--tp", "2", "-o",
                          str(tmp_path / "o"), "--max-shard-size", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.splitlines() == ["error: Invalid value for '--max-shard-size': '0': size must be positive "
                                       "(e.g. 4GiB, 500MB); see 'wna16ctl repack --help'"], res.stderr
