"""verify's sample search order has one statement (wna16ctl/verification/samples.py): `--help`
and every doc that names a sample source carry it exactly, and the code follows it."""

from __future__ import annotations

import re

from click.testing import CliRunner

from tests.conftest import REPO_ROOT
from wna16ctl.cli import cli
from wna16ctl.verification.samples import SAMPLE_SEARCH_ORDER, SAMPLES_ENV, SHARED_ENV, sample_search_order_markdown

_BLOCK = re.compile(r"<!-- samples-order:[^>]*-->\n(.*?)\n<!-- /samples-order -->", re.S)


def _docs() -> list:
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    return [p for p in files if SHARED_ENV in p.read_text(encoding="utf-8") or SAMPLES_ENV in p.read_text(encoding="utf-8")]


def test_every_doc_naming_a_sample_source_states_the_order_of_the_code():
    docs = _docs()
    names = {p.name for p in docs}
    assert {"README.md", "user-guide.md", "python-api.md", "verify.md"} <= names, names
    expected = sample_search_order_markdown()
    for path in docs:
        blocks = _BLOCK.findall(path.read_text(encoding="utf-8"))
        assert blocks, f"{path.name}: names a sample source but has no samples-order block"
        for block in blocks:
            assert block == expected, f"{path.name}: the samples-order block differs; it must read:\n{expected}"


def test_help_states_the_same_order():
    res = CliRunner().invoke(cli, ["verify", "--help"], terminal_width=2000)
    text = " ".join(res.output.split())
    positions = [text.find(step.replace("`", "")) for step in SAMPLE_SEARCH_ORDER[1:]]
    assert -1 not in positions and positions == sorted(positions), (positions, text)


def test_the_code_follows_the_order(tmp_path, monkeypatch):
    """Each step wins over every later one that is also available."""
    import shutil

    import wna16ctl.verification.samples as samples_mod
    from tests.conftest import QUESTIONS

    shared = tmp_path / "shared"
    (shared / "data" / "gsm8k").mkdir(parents=True)
    shutil.copy(QUESTIONS, shared / "data" / "gsm8k" / "test.jsonl")
    beside = tmp_path / "beside"
    (beside / "data" / "gsm8k").mkdir(parents=True)
    shutil.copy(QUESTIONS, beside / "data" / "gsm8k" / "test.jsonl")
    hub_file = tmp_path / "hub.parquet"
    monkeypatch.setattr(samples_mod, "repository_shared_dir", lambda: beside)
    import wna16ctl.sources.hub as hub

    monkeypatch.setattr(hub, "gsm8k_test_file", lambda: hub_file)
    monkeypatch.setenv(SAMPLES_ENV, str(QUESTIONS))
    monkeypatch.setenv(SHARED_ENV, str(shared))
    (tmp_path / "demo_questions.jsonl").write_text("{}\n")
    steps = [samples_mod.resolve_samples(tmp_path / "given.jsonl", tmp_path)]
    steps.append(samples_mod.resolve_samples(None, tmp_path))
    monkeypatch.delenv(SAMPLES_ENV)
    steps.append(samples_mod.resolve_samples(None, tmp_path))
    monkeypatch.delenv(SHARED_ENV)
    steps.append(samples_mod.resolve_samples(None, tmp_path))
    monkeypatch.setattr(samples_mod, "repository_shared_dir", lambda: None)
    steps.append(samples_mod.resolve_samples(None, tmp_path))

    def offline():
        from wna16ctl.errors import BadInput
        raise BadInput("no GSM8K samples: offline; pass --samples")

    monkeypatch.setattr(hub, "gsm8k_test_file", offline)
    steps.append(samples_mod.resolve_samples(None, tmp_path))
    assert steps == [tmp_path / "given.jsonl", QUESTIONS, shared / "data" / "gsm8k" / "test.jsonl",
                     beside / "data" / "gsm8k" / "test.jsonl", hub_file, tmp_path / "demo_questions.jsonl"]
    assert len(steps) == len(SAMPLE_SEARCH_ORDER)


def test_nvcc_compile_checks_run_in_ci_or_on_request(monkeypatch):
    """The CUDA compile checks (marker nvcc) take minutes: `make test` includes them in CI
    (CI=true, which .ci/run sets) or with WNA16CTL_NVCC_TESTS=1, else they skip with that reason."""
    from tests.conftest import nvcc_tests_enabled

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("WNA16CTL_NVCC_TESTS", raising=False)
    assert not nvcc_tests_enabled()
    assert nvcc_tests_enabled("nvcc")  # pytest -m nvcc
    monkeypatch.setenv("WNA16CTL_NVCC_TESTS", "1")
    assert nvcc_tests_enabled()
    monkeypatch.delenv("WNA16CTL_NVCC_TESTS")
    monkeypatch.setenv("CI", "true")
    assert nvcc_tests_enabled()
    assert 'export CI="${CI:-true}"' in (REPO_ROOT / ".ci" / "run").read_text()
