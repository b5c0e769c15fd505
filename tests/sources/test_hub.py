"""Checkpoints and GSM8K samples from the Hugging Face Hub, against a local stand-in for the Hub
(tests/hubserver.py) with the real huggingface_hub client.

Every command runs in a subprocess: huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE,
HF_TOKEN and its timeouts when it is imported."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUESTIONS, REPO_ROOT
from tests.hubserver import FakeHub
from wna16ctl.errors import BadInput, UsageError
from wna16ctl.sources.hub import HubRef, parse_ref

sys.path.insert(0, str(REPO_ROOT / "bench"))
import synthetic_headers

_HF_VARS = ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_HOME", "HUGGINGFACE_HUB_CACHE",
            "WNA16CTL_SAMPLES", "WNA16CTL_SHARED", "HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_ETAG_TIMEOUT")


def without_names(doc: dict, repo_id: str | None = None) -> dict:
    """An inspect JSON object less what names the checkpoint (its path, the Hub source and the next
    steps' commands): what a Hub repo's inspect must share with the same files' on disk. With
    `repo_id`, the next steps must name the repo by that id, not by its cache snapshot."""
    steps = doc.pop("next_steps", [])
    if repo_id is not None:
        assert steps and all(f" {repo_id} " in s["repack"] for s in steps), steps
    doc.pop("checkpoint", None)
    doc.pop("source", None)
    return {**doc, "next_steps": [(s["tp"], s["ep"], s["layout"]) for s in steps]}


@pytest.fixture(scope="module")
def hub():
    h = FakeHub()
    yield h
    h.close()


def wna16ctl(hub: FakeHub, hf_home: Path, *args: str, env: dict | None = None, pythonpath: Path | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in _HF_VARS}
    e.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", **(env or {}))
    if pythonpath is not None:
        e["PYTHONPATH"] = str(pythonpath)
        e["WNA16CTL_KERNELS_DIR"] = str(REPO_ROOT / "kernels")
    return subprocess.run([sys.executable, "-m", "wna16ctl", *args], capture_output=True, text=True, env=e,
                          timeout=300, cwd=cwd)


def one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stdout == "" and "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    return lines[0]


# ---- a Kimi-K2-sized checkpoint: headers only ------------------------------------------------------


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    """61 layers, 384 experts, H 7168, 60 shards: ~550 GiB apparent, ~45 MB on disk (sparse)."""
    return synthetic_headers.write(tmp_path_factory.mktemp("kimi") / "Kimi-K2")


def test_kimi_sized_inspect_fetches_headers_only_and_equals_local(hub, kimi, tmp_path):
    repo = hub.add("moonshotai/Kimi-K2-W4A16", kimi)
    apparent = sum(p.stat().st_size for p in kimi.iterdir())
    assert apparent > 500 << 30
    local = wna16ctl(hub, tmp_path / "unused", "inspect", str(kimi), "--tp", "1,8", "--json")
    assert local.returncode == 0, local.stderr
    hf_home = tmp_path / "hf"

    hub.reset_counts()
    res = wna16ctl(hub, hf_home, "inspect", "moonshotai/Kimi-K2-W4A16", "--tp", "1,8", "--json")
    assert res.returncode == 0, res.stderr
    remote, expected = json.loads(res.stdout), json.loads(local.stdout)
    assert remote.pop("source") == {"repo_id": "moonshotai/Kimi-K2-W4A16", "revision": "main", "commit": repo.commit}
    snapshot = hf_home / "hub" / "models--moonshotai--Kimi-K2-W4A16" / "snapshots" / repo.commit
    assert remote.pop("checkpoint") == str(snapshot)
    expected = without_names(expected)
    assert without_names(remote, "moonshotai/Kimi-K2-W4A16") == expected
    assert len(remote["layers"]) == 60
    # config, index and 60 headers (~46 MB): far under 0.1 % of the apparent size
    assert 0 < hub.bytes_served < apparent / 1000, (hub.bytes_served, apparent)
    shard_gets = hub.range_gets()
    assert shard_gets and all(rng is not None for _, _, rng in shard_gets)
    assert {p.rsplit("/", 1)[1] for _, p, _ in shard_gets} == {p.name for p in kimi.glob("*.safetensors")}
    assert not any(p.suffix == ".safetensors" for p in snapshot.iterdir())  # no shard was downloaded

    hub.reset_counts()  # a second run offline answers from the cache without a request
    res = wna16ctl(hub, hf_home, "inspect", "moonshotai/Kimi-K2-W4A16", "--tp", "1,8", "--json",
                   env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    assert again.pop("source")["commit"] == repo.commit
    assert without_names(again, "moonshotai/Kimi-K2-W4A16") == expected
    assert hub.requests == [] and hub.bytes_served == 0


# ---- errors -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return synthetic_headers.write(tmp_path_factory.mktemp("small") / "ck", layers=3, experts=4, hidden=256,
                                   inter=128, shards=3, vocab=64)


@pytest.fixture(scope="module")
def error_repos(hub, small):
    hub.add("acme/small", small)
    hub.add("acme/gated", small, access="gated", token="hf_allowed")
    hub.add("acme/forbidden", small, access="forbidden")
    hub.add("acme/private", small, access="private", token="hf_allowed")
    hub.add("acme/slow", small, slow_suffix=".safetensors", delay=4.0)
    return hub


@pytest.mark.parametrize("arg,env,expect", [
    ("acme/gated", {}, "set HF_TOKEN"),  # 401 GatedRepo
    ("acme/gated", {"HF_TOKEN": "hf_wrong"}, "set HF_TOKEN"),  # 403 GatedRepo
    ("acme/forbidden", {}, "HTTP 403"),
    ("acme/private", {}, "set HF_TOKEN"),  # 401 RepoNotFound: not found, or private
    ("acme/no-such-model", {}, "no such repository"),
    ("acme/small@no-such-branch", {}, "no such revision"),
    ("acme/slow", {"HF_HUB_DOWNLOAD_TIMEOUT": "1"}, "did not answer in time"),
    ("acme/small", {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE"),  # nothing cached yet
])
def test_hub_errors_are_one_line_and_exit_2(error_repos, tmp_path, arg, env, expect):
    line = one_error_line(wna16ctl(error_repos, tmp_path / "hf", "inspect", arg, "--json", env=env))
    assert expect in line and arg.split("@")[0] in line
    if "HTTP 403" in expect:
        assert "HF_TOKEN" in line


def test_a_missing_path_says_so_first_and_asks_the_hub_only_when_it_can_be_a_repo_id(error_repos, tmp_path):
    """A mistyped local path: one line that starts with "no such local directory". One that cannot be
    a repo id (./x, a/b/c, a trailing slash) never reaches the Hub; one that can is looked up there,
    and offline the line still names the path first."""
    error_repos.reset_counts()
    for arg in ("./modles/qwen3", "modles/qwen3/", "models/x/qwen3"):
        line = one_error_line(wna16ctl(error_repos, tmp_path / "hf", "inspect", arg, "--tp", "1"))
        assert line.startswith(f"error: {arg}: no such local directory; check the path"), line
    assert error_repos.requests == []
    line = one_error_line(wna16ctl(error_repos, tmp_path / "hf", "inspect", "modles/qwen3", "--tp", "1",
                                   env={"HF_HUB_OFFLINE": "1"}))
    assert line.startswith("error: modles/qwen3: no such local directory; as a Hub repo id, config.json: not in "
                           "the local Hugging Face cache and HF_HUB_OFFLINE is set; check the path"), line
    assert error_repos.requests == []


def test_token_opens_a_gated_repo_and_revision_option(error_repos, tmp_path):
    res = wna16ctl(error_repos, tmp_path / "hf", "inspect", "acme/gated", "--tp", "1", "--json",
                   env={"HF_TOKEN": "hf_allowed"})
    assert res.returncode == 0, res.stderr
    commit = error_repos.repos[("model", "acme/gated")].commit
    assert json.loads(res.stdout)["source"] == {"repo_id": "acme/gated", "revision": "main", "commit": commit}
    res = wna16ctl(error_repos, tmp_path / "hf", "inspect", "acme/small", "--revision", "no-such-tag", "--json")
    assert "no such revision" in one_error_line(res)
    small_commit = error_repos.repos[("model", "acme/small")].commit
    res = wna16ctl(error_repos, tmp_path / "hf", "inspect", f"acme/small@{small_commit}", "--tp", "1", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["source"]["revision"] == small_commit


def test_parse_ref(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_ref("org/name") == HubRef("org/name")
    assert parse_ref("org/name@v1.0") == HubRef("org/name", "v1.0")
    assert parse_ref("org/name", "dev") == HubRef("org/name", "dev")
    assert parse_ref("org/name@refs/pr/3") == HubRef("org/name", "refs/pr/3")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_ref("org/name") is None  # an existing directory is a local checkpoint
    for missing in ("/abs/missing", "a/b/c", "x--/y", "./org/other"):  # not a repo id: refused before the Hub
        with pytest.raises(BadInput, match=f"{re.escape(missing)}: no such local directory"):
            parse_ref(missing)
    for arg, rev in (("org/other@a", "b"), ("org/name", "main"), ("org/other@", None), ("a/b/c", "main")):
        with pytest.raises(UsageError):
            parse_ref(arg, rev)


# ---- repack / verify from the Hub, GSM8K from the Hub ------------------------------------------------------


def _gsm8k_dataset(root: Path, n: int = 16) -> Path:
    """The dataset repo's layout with a parquet made at test time from the generated GSM8K-style questions."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for _, line in zip(range(n), QUESTIONS.open(encoding="utf-8"))]
    (root / "main").mkdir(parents=True)
    table = pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]})
    pq.write_table(table, root / "main" / "test-00000-of-00001.parquet")
    return root


def test_repack_verify_and_inspect_a_hub_repo_with_gsm8k_from_the_hub(hub, make_ckpt, tmp_path):
    ck = make_ckpt(num_layers=1, num_experts=4, vocab_size=64)
    hub.add("acme/tiny-moe", ck)
    hub.add("openai/gsm8k", _gsm8k_dataset(tmp_path / "gsm8k"), repo_type="dataset")
    # an installed copy of the package: no shared/ folder beside it, so the Hub is the last source
    site = tmp_path / "site"
    shutil.copytree(REPO_ROOT / "wna16ctl", site / "wna16ctl", ignore=shutil.ignore_patterns("__pycache__"))
    hf_home, out = tmp_path / "hf", tmp_path / "tp2"

    def run(*args: str, **kw) -> subprocess.CompletedProcess:
        return wna16ctl(hub, kw.pop("hf_home", hf_home), *args, pythonpath=site, cwd=tmp_path, **kw)

    res = run("repack", "acme/tiny-moe", "--tp", "2", "-o", str(out), "--json")
    assert res.returncode == 0, res.stderr
    snapshot = hf_home / "hub" / "models--acme--tiny-moe" / "snapshots" / hub.repos[("model", "acme/tiny-moe")].commit
    assert {p.name for p in ck.iterdir()} <= {p.name for p in snapshot.iterdir()}

    hub.reset_counts()
    res = run("verify", "acme/tiny-moe", str(out), "--num-samples", "4", "--device", "cpu", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["passed"] and report["samples"] == 4
    assert any(m == "GET" and p.endswith("/main/test-00000-of-00001.parquet") for m, p, _ in hub.requests)

    gsm8k = hf_home / "hub" / "datasets--openai--gsm8k" / "snapshots" / hub.repos[("dataset", "openai/gsm8k")].commit
    assert (gsm8k / "main" / "test-00000-of-00001.parquet").is_file()  # in the Hugging Face cache

    hub.reset_counts()  # the repository is cached now: inspect reads its headers from disk
    res = run("inspect", "acme/tiny-moe", "--tp", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert hub.range_gets() == []
    local = wna16ctl(hub, hf_home, "inspect", str(snapshot), "--tp", "2", "--json")
    doc = json.loads(res.stdout)
    assert doc.pop("source")["repo_id"] == "acme/tiny-moe"
    assert without_names(doc, "acme/tiny-moe") == without_names(json.loads(local.stdout))



def test_gsm8k_offline_and_not_cached_names_the_other_sources(hub, tmp_path):
    # verify's last sample source, called as default_samples() calls it (without importing torch)
    code = ("from wna16ctl.errors import BadInput\nfrom wna16ctl.sources.hub import gsm8k_test_file\n"
            "try:\n    gsm8k_test_file()\nexcept BadInput as e:\n    print(e.message)\n")
    e = {k: v for k, v in os.environ.items() if k not in _HF_VARS}
    e.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 1, (res.stdout, res.stderr)
    for word in ("no GSM8K samples", "--samples", "WNA16CTL_SHARED", "HF_HUB_OFFLINE", "openai/gsm8k"):
        assert word in res.stdout


def test_parquet_samples_file(tmp_path):
    root = _gsm8k_dataset(tmp_path / "d", n=5)
    from wna16ctl.verification.activations import load_questions

    qs = load_questions(root / "main" / "test-00000-of-00001.parquet", 3)
    first = [json.loads(line)["question"] for _, line in zip(range(3), QUESTIONS.open(encoding="utf-8"))]
    assert qs == first


def test_entries_of_shards_scanned_by_the_worker_come_from_the_hub_headers(hub, tmp_path):
    # 12 shards: the scan is split over two processes; the parent re-reads a worker shard's
    # entries on demand through the Hub header source (the shard itself is not on disk)
    ck = synthetic_headers.write(tmp_path / "ck", layers=9, experts=16, hidden=512, inter=256, shards=12, vocab=128)
    hub.add("acme/twelve", ck)
    code = ("from wna16ctl.sources.hub import HubRef, open_hub_checkpoint;"
            "ck = open_hub_checkpoint(HubRef('acme/twelve'));"
            "print(ck.files.info('lm_head.weight').shape, ck.files.raw('model.norm.weight')['shape'],"
            " ck.files.shard_of('lm_head.weight').path.exists())")
    e = {k: v for k, v in os.environ.items() if k not in _HF_VARS and k != "WNA16CTL_NO_FORK"}
    e.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["(128,", "512)", "[512]", "False"]


def test_a_server_that_ignores_range_costs_a_header_not_the_shard(hub, tmp_path):
    # headers over the first request's 100 kB: the second request skips what the first one read
    ck = synthetic_headers.write(tmp_path / "ck", layers=3, experts=128, hidden=2048, inter=512, shards=2, vocab=128)
    for p in ck.glob("*.safetensors"):
        with p.open("rb") as f:
            assert int.from_bytes(f.read(8), "little") > 100_000
    hub.add("acme/no-ranges", ck, ignore_range=True)
    apparent = sum(p.stat().st_size for p in ck.glob("*.safetensors"))
    hub.reset_counts()
    res = wna16ctl(hub, tmp_path / "hf", "inspect", "acme/no-ranges", "--tp", "1", "--json")
    assert len(hub.range_gets()) == 4
    local = wna16ctl(hub, tmp_path / "hf", "inspect", str(ck), "--tp", "1", "--json")
    assert res.returncode == local.returncode, res.stderr
    doc, expected = json.loads(res.stdout), json.loads(local.stdout)
    assert without_names(doc, "acme/no-ranges") == without_names(expected)
    assert hub.bytes_served < apparent / 20, (hub.bytes_served, apparent)


def test_single_file_repo_without_index(hub, tmp_path):
    from tests.rawckpt import write_raw_checkpoint

    ck = write_raw_checkpoint(tmp_path / "ck", hidden=256, intermediate=128, group_size=64)
    hub.add("acme/single", ck)
    local = wna16ctl(hub, tmp_path / "hf", "inspect", str(ck), "--tp", "1,2", "--json")
    assert local.returncode == 0, local.stderr
    expected = without_names(json.loads(local.stdout))
    for env in ({}, {"HF_HUB_OFFLINE": "1"}):  # online; then offline from the cache (the index's absence too)
        res = wna16ctl(hub, tmp_path / "hf", "inspect", "acme/single", "--tp", "1,2", "--json", env=env)
        assert res.returncode == 0, res.stderr
        assert without_names(json.loads(res.stdout), "acme/single") == expected
    hub.add("acme/empty", tmp_path / "empty-repo")
    (tmp_path / "empty-repo").mkdir()
    (tmp_path / "empty-repo" / "config.json").write_text((ck / "config.json").read_text())
    line = one_error_line(wna16ctl(hub, tmp_path / "hf", "inspect", "acme/empty", "--json"))
    assert "acme/empty" in line and "neither model.safetensors.index.json nor model.safetensors" in line


# ---- huggingface_hub: its public API, at both ends of the range pyproject.toml allows --------------------------


def test_repack_a_hub_repo_quietly(hub, make_ckpt, tmp_path):
    """`-q` turns huggingface_hub's progress bars off through its public `utils` module."""
    ck = make_ckpt(num_layers=1, num_experts=4, vocab_size=64)
    hub.add("acme/quiet-moe", ck)
    out = tmp_path / "tp1"
    res = wna16ctl(hub, tmp_path / "hf", "repack", "acme/quiet-moe", "--tp", "1", "-o", str(out), "-q")
    assert res.returncode == 0, res.stderr
    assert res.stderr == "" and (out / "wna16ctl.json").is_file()


# huggingface_hub>=1.0,<3: the oldest release and the newest one, each installed with pip into a
# folder of its own that goes before the venv's copy on PYTHONPATH.  1.x talks HTTP through httpx
# (2.x through httpx2, which the venv has), so the oldest brings the httpx it needs.
HUB_CLIENTS = {"oldest": ("1.0.0", ["huggingface_hub==1.0.0", "httpx<1", "httpcore", "certifi"]),
               "newest": (None, ["huggingface_hub>=1.0,<3"])}


@pytest.fixture(scope="module", params=sorted(HUB_CLIENTS))
def hub_client(request, tmp_path_factory) -> tuple[Path, str | None]:
    version, specs = HUB_CLIENTS[request.param]
    target = tmp_path_factory.mktemp(f"huggingface_hub-{request.param}")
    try:
        res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                              "--retries", "0", "--timeout", "15", "--target", str(target), *specs],
                             capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        res = None
    if res is None or res.returncode != 0:
        why = "timed out" if res is None else (res.stderr.strip().splitlines() or ["pip failed"])[-1]
        pytest.skip(f"huggingface_hub ({request.param} of the range) not installable here, the package index is "
                    f"not reachable: {why}")
    return target, version


def test_hub_code_works_with_each_end_of_the_huggingface_hub_range(hub, hub_client, make_ckpt, tmp_path):
    client, version = hub_client
    ck = make_ckpt(num_layers=1, num_experts=4, vocab_size=64)
    hub.add("acme/range-moe", ck)
    pythonpath = f"{client}{os.pathsep}{REPO_ROOT}"
    env = {"PYTHONPATH": pythonpath}
    probe = subprocess.run([sys.executable, "-c", "import huggingface_hub as h; print(h.__version__, h.__file__)"],
                           capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    got, where = probe.stdout.split()
    assert where.startswith(str(client)) and (version is None or got == version), probe.stdout
    hf_home = tmp_path / "hf"
    res = wna16ctl(hub, hf_home, "inspect", "acme/range-moe", "--tp", "1", "--json", env=env)  # headers: byte ranges
    assert res.returncode == 0, (got, res.stderr)
    out = tmp_path / "tp1"
    res = wna16ctl(hub, hf_home, "repack", "acme/range-moe", "--tp", "1", "-o", str(out), "-q", env=env)  # a snapshot
    assert res.returncode == 0 and (out / "wna16ctl.json").is_file(), (got, res.stderr)
    line = one_error_line(wna16ctl(hub, hf_home, "inspect", "acme/no-such-repo", env=env))  # the errors module
    assert "acme/no-such-repo: no such repository on the Hub" in line, (got, line)
