"""repack across processes (torchrun on the CPU, gloo on localhost), parts (`--ranks`,
`--node-local`) and `assemble`: every multi-process or assembled output must equal the
single-process run byte for byte, and a failure anywhere must commit nothing and leave a staging
directory that `--resume` completes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import wna16ctl
from tests.conftest import QUESTIONS
from wna16ctl.repacking import distributed
from wna16ctl.output import outdir
from wna16ctl.repacking.distributed import Group, Launch, PeerFailed
from wna16ctl.errors import BadInput, UsageError
from wna16ctl.repacking.parts import assemble
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.verification.checks import NOT_RUN, PASS, verify_output
from wna16ctl.output.writer import StagedOutput

# TP 4 needs I/4 divisible by the group size 128; a small shard size gives every rank several
# files, so "after its first file" is in the middle of a process's work
SPEC = dict(num_layers=2, num_experts=4, intermediate_size=512, vocab_size=64)
SETTINGS = RepackSettings(tp=4, max_shard_bytes=300_000)
CLI_SETTINGS = ["--tp", "4", "--max-shard-size", "300000"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", distributed.TEST_KILL_ENV)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from wna16ctl.demo import DemoSpec, write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"), DemoSpec(**SPEC))


@pytest.fixture(scope="module")
def whole(ckpt, tmp_path_factory):
    """The single-process output everything else must equal."""
    out = tmp_path_factory.mktemp("whole") / "out"
    run_repack(plan_repack(ckpt, SETTINGS), out)
    return out


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (the manifest included), by relative path."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name and out.name in p.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def torchrun(args: list[str], *, cwd: Path, port: int, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
             env: dict[str, str] | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", str(nnodes),
           "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "wna16ctl", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def error_lines(stderr: str) -> list[str]:
    """wna16ctl's error lines in a launch's stderr (every process's and torchrun's together)."""
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def stdout_objects(text: str) -> list[dict]:
    """The JSON objects printed one after another on stdout."""
    dec = json.JSONDecoder()
    out, pos, text = [], 0, text.strip()
    while pos < len(text):
        obj, pos = dec.raw_decode(text, pos)
        out.append(obj)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


# ---- the decisions, without processes ----------------------------------------------------------------


def test_launch_from_env():
    assert distributed.launch_from_env({}) == Launch()
    assert distributed.launch_from_env({"WORLD_SIZE": "1", "RANK": "0"}) == Launch()
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert distributed.launch_from_env(env) == Launch(rank=5, world_size=8, local_rank=1, local_world_size=4, node=1)
    with pytest.raises(UsageError, match="RANK is not"):
        distributed.launch_from_env({k: v for k, v in env.items() if k != "RANK"})
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        distributed.launch_from_env({k: v for k, v in env.items() if k != "MASTER_ADDR"})
    with pytest.raises(UsageError, match="LOCAL_RANK='x' is not an integer"):
        distributed.launch_from_env({**env, "LOCAL_RANK": "x"})
    with pytest.raises(UsageError, match="do not fit"):
        distributed.launch_from_env({**env, "RANK": "8"})


def test_rank_r_is_written_by_process_r_mod_world_size():
    assert [distributed.ranks_of_process(8, p, 3) for p in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert [distributed.ranks_of_process(2, p, 4) for p in range(4)] == [[0], [1], [], []]
    assert [distributed.ranks_of_process(8, p, 2, subset=[6, 3, 0]) for p in range(2)] == [[0, 6], [3]]
    assert distributed.parse_ranks("3, 0,3", 4) == [0, 3]
    for bad in ("4", "-1", "a", "", "0,,1"):
        with pytest.raises(UsageError, match="--ranks"):
            distributed.parse_ranks(bad, 4)


def test_each_process_uses_the_gpu_of_its_local_rank():
    chosen: list[int] = []
    pick = lambda launch, device="cuda", count=4: distributed.select_device(  # noqa: E731 - select_device with this test's defaults, for the lines below
        device, launch, cuda_usable=lambda: True, device_count=lambda: count, set_device=chosen.append)
    assert pick(Launch(rank=6, world_size=8, local_rank=2, local_world_size=4, node=1)) == "cuda:2"
    assert pick(Launch()) == "cuda:0"
    assert chosen == [2, 0]
    with pytest.raises(UsageError, match="LOCAL_RANK 3 but 2 GPUs are visible"):
        pick(Launch(rank=3, world_size=4, local_rank=3, local_world_size=4), count=2)
    assert pick(Launch(rank=3, world_size=4, local_rank=3, local_world_size=4), device="auto", count=2) == "cpu"
    assert chosen == [2, 0]
    # --device cpu never looks for a GPU; cuda without one is refused, auto falls back
    assert distributed.select_device("cpu", Launch(), cuda_usable=lambda: 1 / 0) == "cpu"
    assert distributed.select_device("auto", Launch(), cuda_usable=lambda: False) == "cpu"
    with pytest.raises(UsageError, match="no usable CUDA GPU"):
        distributed.select_device("cuda", Launch(), cuda_usable=lambda: False)


def test_a_lost_process_is_named_and_the_first_running_process_of_the_node_says_so():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: its pid names no process now
    here, me = socket.gethostname(), os.getpid()
    members = [Launch(rank=r, world_size=3, local_rank=r, local_world_size=3) for r in range(3)]

    def seen_by(rank: int) -> PeerFailed:
        group = Group(members[rank], members)
        group.hosts = [(here, ended.pid), (here, me), (here, me)]  # process 0 ended, 1 and 2 run
        return group.lost_contact("Connection closed by peer")

    one, two = seen_by(1), seen_by(2)
    assert one.message.startswith("process 1 lost contact with process 0: it was killed or crashed")
    assert not one.quiet and two.quiet  # process 0 is gone: process 1 speaks for the node, 2 is quiet
    # nothing known to have ended (a peer past the timeout, say): the node's first process speaks
    group = Group(members[1], members)
    group.hosts = [(here, me)] * 3
    err = group.lost_contact("Timed out")
    assert "another process of the run (Timed out)" in err.message and err.quiet


def test_a_joining_process_refuses_a_staging_directory_of_another_run(ckpt, tmp_path):
    plan = plan_repack(ckpt, SETTINGS)
    out = tmp_path / "out"
    owner = StagedOutput(out, force=False, resume=False, identity=plan.identity)
    try:
        with pytest.raises(UsageError, match="not the staging directory process 0 of this run prepared"):
            StagedOutput(out, force=False, resume=False, identity=plan.identity, process=1, join="another-run")
        joined = StagedOutput(out, force=False, resume=False, identity=plan.identity, process=1, join=owner.run)
        joined.abort(keep_for_resume=False)  # a joiner never removes the owner's directory
        assert outdir.is_our_stage(outdir.stage_path(out), out)
    finally:
        owner.abort(keep_for_resume=False)
    assert siblings(out) == []


class _Threads:
    """Processes of one run played by threads: `all_gather` hands every thread's object to all."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list[object] = [None] * n

    def group(self, rank: int) -> Group:
        members = [Launch(rank=r, world_size=len(self.slots), local_rank=r, local_world_size=len(self.slots))
                   for r in range(len(self.slots))]
        return _ThreadGroup(self, members[rank], members)

    def run(self, *steps) -> list[tuple[str, object]]:
        """Each thread runs its step with its group: ("value", what it returned) or ("raised", what it raised)."""
        results: list[tuple[str, object]] = [("none", None)] * len(steps)

        def one(rank: int) -> None:
            try:
                results[rank] = ("value", steps[rank](self.group(rank)))
            except BaseException as e:  # the step's outcome, looked at by the test
                results[rank] = ("raised", e)

        workers = [threading.Thread(target=one, args=(r,)) for r in range(len(steps))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        return results


class _ThreadGroup(Group):
    def __init__(self, threads: _Threads, launch: Launch, members: list[Launch]):
        super().__init__(launch, members)
        self.threads = threads

    def all_gather(self, obj):
        self.threads.slots[self.rank] = obj
        self.threads.barrier.wait()
        out = list(self.threads.slots)
        self.threads.barrier.wait()  # every thread has read the slots before any writes its next object
        return out


def _disk_full():
    raise BadInput("shard-x.safetensors: disk full")


def test_a_step_taken_together_stops_every_process_on_one_failure():
    got = _Threads(3).run(*[lambda g: g.together("writing", lambda: g.rank * 10)] * 3)
    assert got == [("value", 0), ("value", 10), ("value", 20)]  # each process keeps its own value
    fails_on_1 = lambda g: g.together("writing", _disk_full if g.rank == 1 else lambda: g.rank)  # noqa: E731 - process 1 fails
    (k0, e0), (k1, e1), (k2, e2) = _Threads(3).run(fails_on_1, fails_on_1, fails_on_1)
    assert (k0, k1, k2) == ("raised",) * 3
    assert isinstance(e1, BadInput) and e1.message == "shard-x.safetensors: disk full"  # its own error
    for e in (e0, e2):
        assert isinstance(e, PeerFailed) and e.exit_code == 2
        assert e.message == "process 1 failed while writing: shard-x.safetensors: disk full"
    # one line for the node: process 0 (its first) prints it, the others are quiet
    assert [e.quiet for e in (e0, e1, e2)] == [False, True, True]


def test_an_exchange_gives_every_process_every_value_or_stops_them_all():
    got = _Threads(2).run(*[lambda g: g.exchange("comparing layer 0", lambda: {"rank": g.rank})] * 2)
    assert got == [("value", [{"rank": 0}, {"rank": 1}])] * 2
    fails_on_0 = lambda g: g.exchange("comparing layer 0", _disk_full if g.rank == 0 else lambda: 1)  # noqa: E731 - process 0 fails
    (k0, e0), (k1, e1) = _Threads(2).run(fails_on_0, fails_on_0)
    assert (k0, k1) == ("raised", "raised") and isinstance(e0, BadInput) and not e0.quiet
    assert isinstance(e1, PeerFailed) and e1.quiet
    assert e1.message == "process 0 failed while comparing layer 0: shard-x.safetensors: disk full"


def test_processes_at_different_kinds_of_step_are_out_of_step():
    (k0, e0), (k1, e1) = _Threads(2).run(lambda g: g.exchange("comparing layer 0", lambda: 1),
                                         lambda g: g.together("writing", lambda: 1))
    assert (k0, k1) == ("raised", "raised") and isinstance(e0, PeerFailed) and isinstance(e1, PeerFailed)
    assert e0.message == ("process 1 is not comparing layer 0: the processes are out of step; "
                          "launch every process with the same command") and e0.exit_code == 2
    assert e1.message.startswith("process 0 is not writing: the processes are out of step") and e1.exit_code == 2


def _launch_env(local_rank: int) -> dict[str, str]:
    """The environment torchrun gives process `local_rank` of two on one node."""
    return {"WORLD_SIZE": "2", "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _command(name: str, ckpt: Path, tmp_path: Path) -> list[str]:
    if name == "repack":
        return ["repack", str(ckpt), "--tp", "2", "-o", str(tmp_path / "out"), "-q"]
    return ["verify", str(ckpt), str(tmp_path / "out"), "--no-numerics"]


@pytest.mark.parametrize("command", ["repack", "verify"])
def test_an_error_before_the_group_exists_is_said_once_per_node(ckpt, tmp_path, monkeypatch, command):
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    def no_rendezvous(launch=None):
        raise UsageError("process 1: cannot join the process group at 127.0.0.1:29500 (refused)")

    monkeypatch.setattr(distributed, "init_group", no_rendezvous)
    said = [CliRunner().invoke(cli, _command(command, ckpt, tmp_path), env=_launch_env(r)) for r in (0, 1)]
    assert [r.exit_code for r in said] == [2, 2]
    assert said[0].stderr.startswith("error: process 1: cannot join the process group") and said[1].stderr == ""


@pytest.mark.parametrize("command", ["repack", "verify"])
def test_a_broken_launch_is_refused_by_every_process(ckpt, tmp_path, command):
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    # none of them knows which process is the node's first: each says so, and none runs alone
    broken = CliRunner().invoke(cli, _command(command, ckpt, tmp_path), env={"WORLD_SIZE": "2"})
    assert broken.exit_code == 2 and broken.stderr.startswith("error: WORLD_SIZE=2 is set but RANK is not"), broken.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["repack", "verify"])
def test_a_ctrl_c_that_reaches_every_process_is_said_once_per_node(ckpt, tmp_path, monkeypatch, command):
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    class Interrupted(Group):
        def together(self, step, fn):
            raise KeyboardInterrupt

    members = [Launch(rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    monkeypatch.setattr(distributed, "init_group", lambda launch=None: Interrupted(launch, members))
    said = [CliRunner().invoke(cli, _command(command, ckpt, tmp_path), env=_launch_env(r)) for r in (0, 1)]
    assert [r.exit_code for r in said] == [130, 130]
    assert said[0].stderr.startswith("error: interrupted; ") and said[1].stderr == ""


class _PeerFailsWhileWriting(Group):
    """Process 0 of two, whose peer reports a failure at the writing step."""

    def __init__(self):
        me = Launch(rank=0, world_size=2, local_rank=0, local_world_size=2)
        super().__init__(me, [me, Launch(rank=1, world_size=2, local_rank=1, local_world_size=2)])

    def all_gather(self, obj):
        return [obj, None]

    def together(self, step, fn):
        value = fn()
        if step == "writing":
            raise PeerFailed(f"process 1 failed while {step}: disk full", 2)
        return value


def test_a_failure_in_another_process_commits_nothing_and_keeps_staging(ckpt, whole, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(PeerFailed, match="process 1 failed while writing: disk full"):
        run_repack(plan_repack(ckpt, SETTINGS), out, group=_PeerFailsWhileWriting())
    assert not out.exists() and siblings(out) == [f".{out.name}.wna16ctl-partial"]
    plan = plan_repack(ckpt, SETTINGS)
    res = run_repack(plan, out, resume=True)
    mine = len(plan.files[0]) + len(plan.files[2])  # ranks 0 and 2 were process 0's, finished
    assert res.files_reused == mine and res.files_written == len(plan.files[1]) + len(plan.files[3])
    assert digests(out) == digests(whole) and siblings(out) == []


# ---- parts and assemble (one process) ----------------------------------------------------------------


def test_ranks_subsets_assembled_equal_the_whole_run(ckpt, whole, tmp_path):
    plan = plan_repack(ckpt, SETTINGS)
    a = run_repack(plan, tmp_path / "a", ranks=[3, 0])
    b = run_repack(plan, tmp_path / "b", ranks=[1, 2])
    assert (a.ranks, a.manifest_name, b.manifest_name) == ([0, 3], "wna16ctl.part-0_3.json", "wna16ctl.part-1_2.json")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert [n for n in names if n.startswith(("rank-", "wna16ctl"))] == ["rank-0", "rank-3", "wna16ctl.part-0_3.json"]
    assert "config.json" in names  # every part carries the side files
    # each part's rank files and indexes are the whole run's, byte for byte
    full = digests(whole)
    for part in ("a", "b"):
        got = digests(tmp_path / part)
        assert all(full[rel] == d for rel, d in got.items() if not rel.startswith("wna16ctl."))
    # copied together: verify accepts it as it is; assemble makes it the whole run's output
    joined = tmp_path / "joined"
    shutil.copytree(tmp_path / "a", joined)
    shutil.copytree(tmp_path / "b", joined, dirs_exist_ok=True)
    report = verify_output(ckpt, joined, samples=QUESTIONS, num_samples=4)
    assert report.passed and report.ranks_not_checked == [] and [c.name for c in report.checks] == [
        "manifest", "round_trip", "numerics"], [f.message for f in report.findings]
    result = assemble(joined)
    assert result.parts == ["wna16ctl.part-0_3.json", "wna16ctl.part-1_2.json"] and result.ranks == [0, 1, 2, 3]
    assert digests(joined) == digests(whole)


def test_verify_checks_the_ranks_a_part_holds_and_reports_the_others_not_run(ckpt, tmp_path):
    part = tmp_path / "part"
    run_repack(plan_repack(ckpt, SETTINGS), part, ranks=[1])
    report = verify_output(ckpt, part, samples=QUESTIONS, num_samples=4)
    statuses = {c.name: c.status for c in report.checks}
    assert statuses == {"manifest": PASS, "round_trip": PASS, "numerics": PASS, "all_ranks": NOT_RUN}
    assert report.passed and report.ranks_checked == [1] and report.ranks_not_checked == [0, 2, 3]
    assert "ranks 0, 2, 3 not checked" in report.check("all_ranks").reason
    assert report.to_json()["ranks_not_checked"] == [0, 2, 3]
    # the checks are real on a part: one flipped byte in its rank file fails the manifest check
    f = next((part / "rank-1").glob("model-00002-*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    bad = verify_output(ckpt, part, samples=QUESTIONS, num_samples=4)
    assert not bad.passed and bad.check("manifest").status == "FAIL"
    assert any("blake3 differs" in x.message for x in bad.findings)


def test_assemble_refuses_what_is_not_one_whole_run(ckpt, tmp_path):
    plan = plan_repack(ckpt, SETTINGS)
    run_repack(plan, tmp_path / "a", ranks=[0, 1])
    run_repack(plan, tmp_path / "b", ranks=[2, 3])
    d = tmp_path / "d"
    shutil.copytree(tmp_path / "a", d)
    with pytest.raises(UsageError, match="ranks 2, 3 of 4 missing"):
        assemble(d)
    shutil.copytree(tmp_path / "b", d, dirs_exist_ok=True)
    victim = next((d / "rank-2").glob("*.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(UsageError, match="an incomplete copy"):
        assemble(d)
    shutil.copy(next((tmp_path / "b" / "rank-2").glob(victim.name)), victim)
    (d / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt is not listed"):
        assemble(d)
    (d / "notes.txt").unlink()
    # a part of another run (other settings) is refused, naming the key that differs
    other = tmp_path / "other"
    run_repack(plan_repack(ckpt, RepackSettings(tp=4, max_shard_bytes=400_000)), other, ranks=[2, 3])
    e = tmp_path / "e"
    shutil.copytree(tmp_path / "a", e)
    shutil.copy(other / "wna16ctl.part-2_3.json", e)
    with pytest.raises(BadInput, match="'identity' differs"):
        assemble(e)
    assert (d / "wna16ctl.part-0_1.json").exists() and not (d / "wna16ctl.json").exists()  # nothing changed
    assemble(d)
    assert not outdir.part_manifest_names(d) and (d / "wna16ctl.json").is_file()


def test_force_and_resume_treat_a_part_as_wna16ctl_output(ckpt, tmp_path):
    plan = plan_repack(ckpt, SETTINGS)
    part = tmp_path / "part"
    run_repack(plan, part, ranks=[0])
    before = digests(part)
    res = run_repack(plan, part, ranks=[0], resume=True)
    assert res.files_written == 0 and res.files_reused == len(plan.files[0]) and digests(part) == before
    run_repack(plan, part, ranks=[2], force=True)  # replaced: every entry was the part's
    assert outdir.part_manifest_names(part) == ["wna16ctl.part-2.json"] and not (part / "rank-0").exists()


# ---- torchrun -------------------------------------------------------------------------------------------


def test_torchrun_two_processes_equal_the_single_process_run(ckpt, whole, tmp_path):
    rc, out, err = torchrun(["repack", str(ckpt), *CLI_SETTINGS, "-o", "out", "--json"], cwd=tmp_path, port=free_port())
    assert rc == 0 and error_lines(err) == [], err
    results = stdout_objects(out)
    assert len(results) == 1, out  # printed once, by process 0, which committed
    per_rank = [len(files) for files in plan_repack(ckpt, SETTINGS).files]
    assert [(p["process"], p["ranks"], p["files_written"]) for p in results[0]["processes"]] == [
        (0, [0, 2], per_rank[0] + per_rank[2]), (1, [1, 3], per_rank[1] + per_rank[3])]
    assert digests(tmp_path / "out") == digests(whole)
    assert siblings(tmp_path / "out") == []


@pytest.mark.parametrize("resume_with", ["one process", "torchrun"])
def test_torchrun_process_killed_commits_nothing_and_resume_completes_it(ckpt, whole, tmp_path, resume_with):
    args = ["repack", str(ckpt), *CLI_SETTINGS, "-o", "out"]
    rc, _, err = torchrun([*args, "-q"], cwd=tmp_path, port=free_port(), env=clean_env(**{distributed.TEST_KILL_ENV: "1"}))
    out = tmp_path / "out"
    assert rc != 0 and "SIGKILL" in err, err
    # one line for the whole launch, by process 0, naming the process that was killed
    assert len(error_lines(err)) == 1 and "error: process 0 lost contact with process 1:" in error_lines(err)[0], err
    assert not out.exists() and siblings(out) == [".out.wna16ctl-partial"]
    stage = tmp_path / ".out.wna16ctl-partial"
    assert not list(stage.glob("wna16ctl*.json"))  # no manifest: nothing committed
    # process 1's journal part records the first file it finished before dying
    journal = json.loads((stage / ".wna16ctl-journal-p1.json").read_text())
    first = sorted(rel for rel in journal["files"] if rel.startswith("rank-1/"))[0]
    inode = os.stat(stage / first).st_ino
    if resume_with == "torchrun":  # process 1 again writes rank 1: it reuses what it journaled
        rc, stdout, err = torchrun([*args, "--resume", "--json"], cwd=tmp_path, port=free_port())
    else:  # one process writes every rank: it reuses what process 1 journaled
        res = subprocess.run([sys.executable, "-m", "wna16ctl", *args, "--resume", "--json"], cwd=tmp_path,
                             env=clean_env(), capture_output=True, text=True, timeout=300)
        rc, stdout, err = res.returncode, res.stdout, res.stderr
    assert rc == 0, err
    (result,) = stdout_objects(stdout)
    total = sum(len(files) for files in plan_repack(ckpt, SETTINGS).files)
    assert result["files_reused"] > 0 and result["files_reused"] + result["files_written"] == total
    assert os.stat(out / first).st_ino == inode  # the journaled file was reused, not rewritten
    assert digests(out) == digests(whole) and siblings(out) == []


def test_torchrun_first_process_killed_another_says_so_once(ckpt, tmp_path):
    # three processes: the lost one is found among the processes of this host, not by elimination
    rc, _, err = torchrun(["repack", str(ckpt), *CLI_SETTINGS, "-o", "out", "-q"], cwd=tmp_path, port=free_port(),
                          nproc=3, env=clean_env(**{distributed.TEST_KILL_ENV: "0"}))
    assert rc != 0 and "SIGKILL" in err, err
    (line,) = error_lines(err)
    assert line.startswith(("error: process 1 ", "error: process 2 ")) and "lost contact with process 0:" in line, err
    assert not (tmp_path / "out").exists()


def test_torchrun_bad_input_is_one_line(tmp_path):
    rc, _, err = torchrun(["repack", str(tmp_path / "missing"), "--tp", "2", "-o", "out"], cwd=tmp_path,
                          port=free_port())
    assert rc != 0 and len(error_lines(err)) == 1 and "missing" in error_lines(err)[0], err


_FAILING_PROCESS = """
import os, sys
import wna16ctl.repacking.pipeline as r
import wna16ctl.repacking.native_path as n
from wna16ctl.errors import BadInput
real, real_native, calls = r.build_rank_tensors, n.LayerBuilder.build_into, []
def fail_on_second_chunk():  # process 1 fails on its second chunk, on either data path
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        raise BadInput("shard-x.safetensors: simulated read error")
def build(*a, **kw):
    fail_on_second_chunk()
    return real(*a, **kw)
def build_native(self, *a, **kw):
    fail_on_second_chunk()
    return real_native(self, *a, **kw)
r.build_rank_tensors = build
n.LayerBuilder.build_into = build_native
sys.argv = ["wna16ctl"] + sys.argv[1:]
from wna16ctl.cli import main
main()
"""


def test_torchrun_error_in_one_process_stops_all_and_keeps_staging(ckpt, whole, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(_FAILING_PROCESS)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(script), "repack", str(ckpt), *CLI_SETTINGS, "-o", "out", "-q"]
    res = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    # one line for the whole launch: process 0 says who failed and why, the failing process is quiet
    assert error_lines(res.stderr) == [
        "error: process 1 failed while writing: shard-x.safetensors: simulated read error"], res.stderr
    # (torchrun prints a traceback of its own when a child fails; none comes from wna16ctl's code)
    # (the package's own folder, not the word: a checkout cloned into `wna16ctl/` holds torchrun's frames too)
    package = {str(Path(wna16ctl.__file__).parent) + os.sep, str(Path(wna16ctl.__file__).resolve().parent) + os.sep}
    assert not [ln for ln in res.stderr.splitlines() if 'File "' in ln and any(p in ln for p in package)], res.stderr
    out = tmp_path / "out"
    assert not out.exists() and siblings(out) == [".out.wna16ctl-partial"]
    res = run_repack(plan_repack(ckpt, SETTINGS), out, resume=True)
    assert res.files_reused > 0 and digests(out) == digests(whole)


def test_torchrun_two_nodes_node_local_parts_verify_and_assemble(ckpt, whole, tmp_path):
    port = free_port()
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    procs = []
    for n, cwd in enumerate(nodes):
        cwd.mkdir()
        procs.append(torchrun(["repack", str(ckpt), *CLI_SETTINGS, "-o", "out", "--node-local", "--json"], cwd=cwd,
                              port=port, nproc=1, nnodes=2, node_rank=n, wait=False))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(stdout_objects(out))
    # world size 2: node 0's process writes ranks 0 and 2, node 1's ranks 1 and 3, each a part
    assert [r[0]["ranks"] for r in results] == [[0, 2], [1, 3]]
    assert [sorted(outdir.part_manifest_names(n / "out")) for n in nodes] == [
        ["wna16ctl.part-0_2.json"], ["wna16ctl.part-1_3.json"]]
    for n, held in zip(nodes, ([0, 2], [1, 3])):
        report = verify_output(ckpt, n / "out", samples=QUESTIONS, num_samples=4)
        assert report.passed and report.ranks_checked == held, [f.message for f in report.findings]
        assert report.check("all_ranks").status == NOT_RUN
    joined = tmp_path / "joined"
    for n in nodes:
        shutil.copytree(n / "out", joined, dirs_exist_ok=True)
    assemble(joined)
    assert digests(joined) == digests(whole)


def test_node_local_refuses_a_node_that_would_write_no_rank(ckpt, tmp_path):
    members = [Launch(rank=r, world_size=4, local_rank=r % 2, local_world_size=2, node=r // 2) for r in range(4)]
    group = Group(members[0], members)  # 2 nodes x 2 processes; TP 2 leaves node 1 without a rank
    with pytest.raises(UsageError, match="node 1 would write no rank"):
        run_repack(plan_repack(ckpt, RepackSettings(tp=2)), tmp_path / "out", node_local=True, group=group)
    assert not (tmp_path / "out").exists() and siblings(tmp_path / "out") == []


def test_verify_of_an_ep_part_counts_the_experts_it_holds(ckpt, tmp_path):
    """An EP part holding ranks 0 and 1 of 4 holds half of each layer's experts: verify counts
    those, not every expert of the checkpoint."""
    settings = RepackSettings(tp=4, ep=True, max_shard_bytes=300_000)
    plan = plan_repack(ckpt, settings)
    part = tmp_path / "part"
    run_repack(plan, part, ranks=[0, 1])
    report = verify_output(ckpt, part, samples=QUESTIONS, num_samples=4)
    assert report.passed, [f.message for f in report.findings]
    held = sum(len(job.expert_ranges[0]) + len(job.expert_ranges[1]) for job in plan.jobs)
    total = sum(job.layer.num_experts for job in plan.jobs)
    assert held < total and report.experts_checked == held == report.to_json()["experts_checked"]
