"""Hub faults against the local stand-in server: each one is one line (exit 2) within a bounded
time, the header cache keeps nothing wrong, and once the fault is gone the same command works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hubserver import FakeHub
from tests.sources.test_hub import _HF_VARS, one_error_line

SMALL = dict(num_layers=1, num_experts=2, top_k=1, vocab_size=64, num_shards=2)
# huggingface_hub's own retry loop sleeps 1+2+4+8+8 s on 5xx; the tests run it without the sleeps
NO_SLEEP = "import huggingface_hub.utils._http as h, time; h.time = type('t', (), {'sleep': staticmethod(lambda s: None), 'time': time.time})\n"


@pytest.fixture(scope="module")
def hub():
    h = FakeHub()
    yield h
    h.close()


# huggingface_hub's retry loop sleeps before each new attempt: here that sleep ends the run instead
NO_RETRY = ("import huggingface_hub.utils._http as h, time\n"
            "def _retried(s):\n    raise SystemExit('huggingface_hub retried')\n"
            "h.time = type('t', (), {'sleep': staticmethod(_retried), 'time': time.time})\n")


def run(hub: FakeHub, hf_home: Path, *args: str, no_sleep: bool = False, no_retry: bool = False) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in _HF_VARS}
    e.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DOWNLOAD_TIMEOUT="2",
             HF_HUB_ETAG_TIMEOUT="2")
    code = (NO_SLEEP if no_sleep else NO_RETRY if no_retry else "") + "import sys\nfrom wna16ctl.cli import main\nsys.argv = ['wna16ctl', *sys.argv[1:]]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=e, timeout=120)


def cached_headers(hf_home: Path) -> list[str]:
    root = hf_home / "wna16ctl" / "headers"
    return sorted(p.name for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


@pytest.mark.parametrize("fault, words", [
    ("503", "the Hub answered HTTP 503; try again later"),
    ("429", "the Hub answered HTTP 429; try again later"),
    ("truncate", "model-00002-of-00002.safetensors"),
    ("content_range", "does not serve byte ranges correctly"),
    ("stall", "did not answer in time"),
])
def test_a_fault_reading_a_header_is_one_line_and_leaves_no_cache(hub, make_ckpt, tmp_path, fault, words):
    ck = make_ckpt(**SMALL)
    repo = hub.add(f"acme/fault-{fault}", ck, fault=fault, fault_suffix="00002-of-00002.safetensors", delay=30.0)
    hf_home = tmp_path / "hf"
    res = run(hub, hf_home, "inspect", f"acme/fault-{fault}", "--tp", "1", "--json")
    line = one_error_line(res)
    assert line.startswith(f"error: acme/fault-{fault}") and words in line, line
    # the shard that failed left nothing in the header cache (the other one may be there, whole)
    assert "model-00002-of-00002.safetensors" not in cached_headers(hf_home)
    repo.fault = None
    res = run(hub, hf_home, "inspect", f"acme/fault-{fault}", "--tp", "1", "--json")
    assert res.returncode == 0, res.stderr
    local = run(hub, tmp_path / "unused", "inspect", str(ck), "--tp", "1", "--json")
    assert json.loads(res.stdout)["layers"] == json.loads(local.stdout)["layers"]
    assert "model-00002-of-00002.safetensors" in cached_headers(hf_home)


@pytest.mark.parametrize("fault", ["503", "429"])
def test_hub_retries_are_not_printed_one_line_is(hub, make_ckpt, tmp_path, fault):
    """config.json goes through huggingface_hub's download with its retry loop: its per-attempt
    warnings are dropped, the failure is one line."""
    ck = make_ckpt(**SMALL)
    hub.add(f"acme/config-{fault}", ck, fault=fault, fault_suffix="config.json", retry_after=0)
    res = run(hub, tmp_path / "hf", "inspect", f"acme/config-{fault}", "--tp", "1", no_sleep=True)
    line = one_error_line(res)
    assert "config.json" in line and f"HTTP {fault}" in line, line
    assert "Retry" not in res.stderr and "retry" not in res.stderr


def test_an_unreachable_hub_is_one_line_without_the_retry_chatter(tmp_path):
    """huggingface_hub retries a refused connection five times, logging each attempt (B8: six
    lines over ~23 s before ours); only the one line naming the fix is printed."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = type("Closed", (), {"url": f"http://127.0.0.1:{port}"})()
    res = run(closed, tmp_path / "hf", "inspect", "acme/x", "--tp", "1", no_sleep=True)
    line = one_error_line(res)
    assert line.startswith("error: acme/x: no such local directory; as a Hub repo id, config.json: cannot reach")
    assert "HF_HUB_OFFLINE=1" in line, line


@pytest.mark.parametrize("command", ["inspect", "repack"])
def test_a_mistyped_path_with_the_hub_unreachable_is_said_at_once(tmp_path, command):
    """`inspect modles/qwen3` (a path that looks like a repo id) while the Hub cannot be reached:
    the one line names the path first, and huggingface_hub's retry loop (~25 s) is never entered."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = type("Closed", (), {"url": f"http://127.0.0.1:{port}"})()
    extra = ["-o", str(tmp_path / "out")] if command == "repack" else []
    res = run(closed, tmp_path / "hf", command, "modles/qwen3", "--tp", "1", *extra, no_retry=True)
    assert "retried" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert errors[0].startswith("error: modles/qwen3: no such local directory; as a Hub repo id, config.json: "
                                f"cannot reach http://127.0.0.1:{port}"), errors[0]
    assert "check the path" in errors[0]
