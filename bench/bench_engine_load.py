"""Engine start-up: the default load of a W4A16 MoE checkpoint against `sharded_state` of its
`repack --layout vllm`, on vLLM.

    python bench/bench_engine_load.py [--device cpu|cuda] [--tp N] [--rounds 2] [--engine-python PY]
                                      [--work DIR] [--layers 3] [--vocab 151936] [--warm] [--json OUT]

The checkpoint is Qwen3-MoE-shaped (bench/synthetic_checkpoint.py --engine: Qwen3-30B-A3B's
widths, 128 experts, random codes; an engine does not judge them), at least 2 GB with the
defaults.  It is repacked once (timed), then the engine is started alternately from the
checkpoint (load_format "auto") and from the repack ("sharded_state"), `--rounds` times each, in
the order ABBA...  Each start is a fresh process (scripts: bench/_engine_load_driver.py) that
reports when vLLM was imported, when the engine was ready and when the first token of a one-token
request came back (all from the launch of the process; "LLM() s" is the engine's construction
alone, from the import to ready, which the load format changes).  Meanwhile every rank's worker process is sampled (every 0.2 s):

* the .safetensors files it maps (/proc/PID/maps): the files that rank reads, and their bytes;
* read_bytes of /proc/PID/io: what it read from storage (before each start the page cache of both
  models' files is dropped with posix_fadvise(DONTNEED), unless --warm; where another rank already
  brought a page in, this rank's read does not count);
* VmHWM of /proc/PID/status: its peak resident set.

--device cpu (default): vLLM's CPU build, from --engine-python or $WNA16CTL_ENGINE_PYTHON (the
engine venv, `make engine-venv`); TP 2.  On a CPU without AMX, vLLM has no WNA16 MoE kernel, so the
engine tier's hooks (tests/engine_hooks) make it use its EMULATION backend, which dequantizes the
experts to bf16 while processing the weights (the same work for both load formats).
--device cuda: a CUDA build of vLLM in --engine-python (default: this python); TP = the GPUs
there are, at most 2.  Without a GPU or vLLM it prints `not run: REASON` and exits 2; the JSON
(--json) then holds {"status": "not-run", "reason": ...}.
Exit 0: measured; 1: a start failed; 2: not run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DRIVER = ROOT / "bench" / "_engine_load_driver.py"
HOOKS = ROOT / "tests" / "engine_hooks"  # test-only: vLLM's EMULATION MoE backend on a CPU without AMX
MODES = ("default", "sharded_state")


class NotRun(Exception):
    """The comparison cannot run here; the message says why."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def simd_level() -> str:
    flags = cpu_flags()
    parts = [f for f in ("avx2", "avx512f", "avx512vbmi", "amx_tile") if f in flags]
    return ", ".join(parts) if parts else "unknown"


def probe_engine(python: Path, device: str) -> dict:
    """vLLM's version and the GPUs of `python`, or NotRun with the reason."""
    code = ("import json, torch, vllm; print(json.dumps({'vllm': vllm.__version__, "
            "'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0, "
            "'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))")
    if not Path(python).exists():
        raise NotRun(f"no python at {python}")
    probe = subprocess.run([str(python), "-c", code], check=False, capture_output=True, text=True, env=_clean_env())
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise NotRun(f"vLLM does not import in {python}: {last}")
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    if device == "cuda" and not info["gpus"]:
        raise NotRun(f"no CUDA GPU visible to {python} (vLLM {info['vllm']})")
    return info


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def engine_env(device: str, tp: int) -> dict[str, str]:
    env = _clean_env()
    if device == "cpu":
        if "amx_tile" not in cpu_flags():
            env["PYTHONPATH"] = str(HOOKS)
            env["WNA16CTL_TEST_MOE_BACKEND"] = "emulation"
        if tp > 1:  # the default binding refuses on a machine with one NUMA node
            env |= {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp)),
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return env


def model_files(*folders: Path) -> list[Path]:
    return sorted(p for f in folders for p in f.glob("*.safetensors"))


def drop_page_cache(files: list[Path]) -> None:
    """Ask the kernel to drop these files' clean cached pages, so the next start reads storage."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- sampling the workers ----------------------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _rank_of(pid: int, tp: int) -> int | None:
    """A worker's TP rank from its process title (vLLM names them Worker_TP{rank}); with TP 1 the
    one worker (or the engine core, where the model runs in it)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    m = re.search(r"Worker\S*_TP(\d+)", title)
    if m:
        return int(m.group(1))
    if tp == 1 and "Worker" in title:
        return 0
    return None


class RankSampler:
    def __init__(self, root: int, tp: int, files: set[str]):
        self.root, self.tp, self.files = root, tp, files
        self.ranks: dict[int, dict] = {}
        self.core: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        for pid in _descendants(self.root):
            rank = _rank_of(pid, self.tp)
            if rank is None:
                continue
            rec = self.ranks.setdefault(rank, {"pid": pid, "files": set(), "read_bytes": 0, "rchar": 0, "vm_hwm_kib": 0})
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
                io = dict(ln.split(": ") for ln in Path(f"/proc/{pid}/io").read_text().splitlines())
                status = Path(f"/proc/{pid}/status").read_text()
            except (OSError, ValueError):
                continue
            for line in maps.splitlines():
                path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path in self.files:
                    rec["files"].add(path)
            rec["read_bytes"] = max(rec["read_bytes"], int(io.get("read_bytes", 0)))
            rec["rchar"] = max(rec["rchar"], int(io.get("rchar", 0)))
            m = re.search(r"VmHWM:\s+(\d+) kB", status)
            if m:
                rec["vm_hwm_kib"] = max(rec["vm_hwm_kib"], int(m.group(1)))


def one_start(python: Path, model: Path, mode: str, tp: int, device: str, work: Path, all_files: list[Path],
              warm: bool, timeout: float) -> dict:
    if not warm:
        drop_page_cache(all_files)
    request = work / f"request-{mode}.json"
    request.write_text(json.dumps({"model": str(model), "load_format": "auto" if mode == "default" else "sharded_state",
                                   "tensor_parallel_size": tp,
                                   "memory_fraction": 0.9 if device == "cuda" else 0.5,
                                   # the same small KV cache for both: one short request, and the start-up
                                   # compared is the weights'
                                   "kv_cache_bytes": 256 * 2**20}))
    log = work / f"engine-{mode}.log"
    launched = time.time()
    with open(log, "w") as err:
        proc = subprocess.Popen([str(python), str(DRIVER), str(request)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=engine_env(device, tp), cwd=work)
        sampler = RankSampler(proc.pid, tp, {str(p) for p in all_files})
        sampler.start()
        stamps = None
        deadline = launched + timeout
        for line in proc.stdout:  # the driver prints its result, then waits for stdin to close
            if line.startswith("ENGINE_LOAD "):
                stamps = json.loads(line[len("ENGINE_LOAD "):])
                break
            err.write(line)  # vLLM logs to stdout
            if time.time() > deadline:
                break
        sampler.stop()
        proc.stdin.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if stamps is None:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{mode} start failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    # vLLM's own account of each rank's weight loading (reading and copying, before its processing)
    text = log.read_text()
    loading = [float(x) for x in re.findall(r"Loading weights took ([\d.]+) seconds", text)]
    model_loading = [float(x) for x in re.findall(r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds", text)]
    sizes = {str(p): p.stat().st_size for p in all_files}
    ranks = {r: {"files": sorted(Path(f).name for f in rec["files"]),
                 "file_bytes": sum(sizes[f] for f in rec["files"]),
                 "read_bytes": rec["read_bytes"], "rchar": rec["rchar"], "peak_rss_bytes": rec["vm_hwm_kib"] * 1024}
             for r, rec in sorted(sampler.ranks.items())}
    return {"mode": mode, "ready_s": stamps["ready"] - launched, "first_token_s": stamps["first_token"] - launched,
            "import_s": stamps["imported"] - launched, "engine_s": stamps["ready"] - stamps["imported"],
            "token": stamps["token"], "vllm": stamps["vllm"], "ranks": ranks, "load_average_1min": os.getloadavg()[0],
            "vllm_loading_weights_s": loading, "vllm_model_loading_s": model_loading}


# -- the comparison ----------------------------------------------------------------------------------

def checkpoint(work: Path, layers: int, vocab: int) -> Path:
    from bench import synthetic_checkpoint

    ck = work / f"ckpt-l{layers}-v{vocab}"
    stamp = ck / ".complete"
    if not stamp.exists():
        import shutil

        shutil.rmtree(ck, ignore_errors=True)
        synthetic_checkpoint.write(ck, layers=layers, experts=128, hidden=2048, intermediate=768, vocab=vocab,
                                   engine=True)
        stamp.touch()
    return ck


def repack(ck: Path, out: Path, tp: int, release: str) -> float:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "wna16ctl", "repack", str(ck), "--tp", str(tp), "--layout", "vllm",
                          "--vllm", release, "-o", str(out), "-q"], check=False, capture_output=True, text=True,
                         env=os.environ | {"PYTHONPATH": str(ROOT)}, cwd=ROOT)
    seconds = time.perf_counter() - started
    if run.returncode:
        raise NotRun(f"repack --layout vllm --vllm {release} refused this checkpoint: {run.stdout[-400:]}{run.stderr[-400:]}")
    return seconds


def compare(args: argparse.Namespace) -> dict:
    python = Path(args.engine_python or os.environ.get("WNA16CTL_ENGINE_PYTHON") or
                  (sys.executable if args.device == "cuda" else ROOT / "build" / "engine-venv" / "bin" / "python"))
    info = probe_engine(python, args.device)
    tp = args.tp or (2 if args.device == "cpu" else max(1, min(2, info["gpus"])))
    if args.device == "cuda" and tp > info["gpus"]:
        raise NotRun(f"TP {tp} needs {tp} GPUs, {info['gpus']} visible")
    release = re.match(r"\d+\.\d+\.\d+", info["vllm"]).group(0)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    ck = checkpoint(work, args.layers, args.vocab)
    size = sum(p.stat().st_size for p in ck.glob("*.safetensors"))
    out = work / f"{ck.name}-vllm-tp{tp}"
    repack_s = repack(ck, out, tp, release)
    print(f"repack --layout vllm --tp {tp}: {repack_s:.1f} s", file=sys.stderr, flush=True)
    files = model_files(ck, out)
    starts = []
    for i in range(args.rounds):
        order = MODES if i % 2 == 0 else MODES[::-1]
        for mode in order:
            model = ck if mode == "default" else out
            print(f"start {len(starts) + 1}/{2 * args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            starts.append(one_start(python, model, mode, tp, args.device, work, files, args.warm, args.timeout))
            print(f"  ready {starts[-1]['ready_s']:.1f} s, first token {starts[-1]['first_token_s']:.1f} s",
                  file=sys.stderr, flush=True)
            if args.json:  # what was measured so far survives an interrupted run
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"status": "partial", "repack_s": repack_s, "starts": starts},
                                                indent=1, default=str))
    summary = {}
    for mode in MODES:
        runs = [s for s in starts if s["mode"] == mode]
        summary[mode] = {"ready_s": statistics.median(s["ready_s"] for s in runs),
                         "first_token_s": statistics.median(s["first_token_s"] for s in runs),
                         "engine_s": statistics.median(s["engine_s"] for s in runs),
                         "ranks": runs[-1]["ranks"]}
    d, s = summary["default"], summary["sharded_state"]
    saved = d["ready_s"] - s["ready_s"]
    tokens_agree = len({json.dumps(x["token"]) for x in starts}) == 1
    return {"status": "measured", "device": args.device, "gpu": info.get("gpu"), "cpu_simd": simd_level(),
            "vllm": info["vllm"], "tp": tp, "checkpoint_bytes": size, "repack_s": repack_s, "rounds": args.rounds,
            "page_cache": "warm" if args.warm else "dropped before each start", "starts": starts, "summary": summary,
            "ready_ratio": d["ready_s"] / s["ready_s"], "first_token_ratio": d["first_token_s"] / s["first_token_s"],
            "engine_ratio": d["engine_s"] / s["engine_s"],
            "starts_to_pay_back_repack": repack_s / saved if saved > 0 else None, "same_first_token": tokens_agree}


def render(r: dict) -> str:
    gib = 2**30
    lines = [(f"vLLM {r['vllm']} on {r['device']} ({r['gpu'] or 'CPU: ' + r['cpu_simd']}), TP {r['tp']}, "
              f"checkpoint {r['checkpoint_bytes'] / gib:.2f} GiB, {r['rounds']} start(s) each, alternated; page cache "
              f"{r['page_cache']}"),
             (f"{'':14} {'ready s':>8} {'1st token s':>11} {'LLM() s':>8}   per rank: files read (GiB), storage read "
              "(GiB), peak RSS (GiB)")]
    for mode in MODES:
        m = r["summary"][mode]
        per_rank = "; ".join(f"rank {k}: {v['file_bytes'] / gib:.2f}, {v['read_bytes'] / gib:.2f}, "
                             f"{v['peak_rss_bytes'] / gib:.2f}" for k, v in m["ranks"].items())
        lines.append(f"{mode:14} {m['ready_s']:8.1f} {m['first_token_s']:11.1f} {m['engine_s']:8.1f}   {per_rank}")
    pay = r["starts_to_pay_back_repack"]
    lines.append(f"default / sharded_state: ready {r['ready_ratio']:.2f}x, first token {r['first_token_ratio']:.2f}x, "
                 f"LLM() after the import {r['engine_ratio']:.2f}x; "
                 f"repack --layout vllm {r['repack_s']:.1f} s, "
                 + (f"paid back after {pay:.1f} start(s)" if pay else "never paid back by start-up time (sharded_state not faster)")
                 + ("" if r["same_first_token"] else "; WARNING: the first tokens differ between starts"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tp", type=int, default=0, help="tensor parallel size (cpu: 2; cuda: the GPUs, at most 2)")
    ap.add_argument("--rounds", type=int, default=2, help="starts of each kind, alternated")
    ap.add_argument("--engine-python", type=Path)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-engine-load")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary (embedding and head are bf16)")
    ap.add_argument("--warm", action="store_true", help="keep the page cache between starts")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one start may take")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        result = compare(args)
    except NotRun as e:
        result = {"status": "not-run", "reason": str(e)}
        print(f"not run: {e}")
        code = 2
    except RuntimeError as e:
        result = {"status": "failed", "reason": str(e)}
        print(f"failed: {e}")
        code = 1
    else:
        print(render(result))
        code = 0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
