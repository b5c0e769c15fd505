"""`verify` of a `--layout vllm` output: the files against the release's key contract (every key,
no extra, exact shape and dtype; `wna16ctl.planning.vllm_state` plans them again from the
manifest's settings), the hashes against the manifest, and every tensor inverted back to the
checkpoint bit for bit (`wna16ctl.layout.vllm_state.invert_key`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wna16ctl.errors import BadInput
from wna16ctl.layout.spec import VLLM
from wna16ctl.output.manifest import MANIFEST_NAME
from wna16ctl.planning import rules
from wna16ctl.planning.next_steps import NextStep
from wna16ctl.planning.vllm_state import VllmStatePlan, plan_vllm_state
from wna16ctl.sources import Checkpoint


@dataclass
class VllmStateReport:
    out: Path
    tp: int
    vllm: str
    problems: list[str]
    keys_checked: int = 0
    tensors_round_tripped: int = 0
    serve: str = ""
    round_trip_ran: bool = False  # the files met the contract, so the tensors were compared
    step: NextStep | None = None  # how the output is served (the plan's serve_step)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def passed(self) -> bool:
        """The output is proved (the name every verify result answers to)."""
        return self.ok

    @property
    def next_steps(self) -> list[NextStep]:
        """The serve command, once the output is proved."""
        return [self.step] if self.passed and self.step is not None else []

    def to_json(self) -> dict[str, Any]:
        return {"output": str(self.out), "layout": VLLM, "tp": self.tp, "vllm": self.vllm, "ok": self.ok,
                "passed": self.passed, "keys_checked": self.keys_checked,
                "tensors_round_tripped": self.tensors_round_tripped, "problems": self.problems, "serve": self.serve,
                "next_steps": [s.to_json() for s in self.next_steps]}


def read_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: cannot read the manifest ({e}); point verify at a repack output") from None


def verify_vllm_state(ckpt: str | os.PathLike[str] | Checkpoint, out: str | os.PathLike[str]) -> VllmStateReport:
    """Files against the contract (every key, no extra, exact shape and dtype), hashes against the
    manifest, and every tensor inverted back to the checkpoint bit for bit."""
    out_path = Path(out)
    manifest = read_manifest(out_path)
    engine = manifest["engine"]
    tp, vllm = int(manifest["tp"]), str(engine["version"])
    switches = None
    if engine.get("env") or engine.get("moe_backend"):
        from wna16ctl.planning.engine_env import make_switches

        switches = make_switches(engine.get("env"), engine.get("moe_backend"))
    plan = plan_vllm_state(ckpt, tp, vllm, gpu=str(engine.get("gpu", rules.DEFAULT_GPU)), switches=switches,
                           ep=bool(manifest.get("ep")))
    step = plan.serve_step(out_path)
    report = VllmStateReport(out_path, tp, vllm, [], serve=step.serve, step=step)
    headers = _check_files(plan, out_path, manifest, report)
    if report.problems:
        return report
    report.round_trip_ran = True
    _round_trip(plan, out_path, headers, report)
    return report


def _rank_of(name: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"model-rank-(\d+)-part-(\d+)\.safetensors", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_files(plan: VllmStatePlan, out: Path, manifest: dict[str, Any], report: VllmStateReport
                 ) -> dict[int, dict[str, tuple[Path, dict[str, Any]]]]:
    """Per rank: key -> (file, header entry).  Every contract violation becomes one line."""
    from wna16ctl.output.writer import FILE_HASH, hash_file
    from wna16ctl.sources.headers import read_shard_header

    for rel, meta in sorted((manifest.get("files") or {}).items()):
        path = out / rel
        if not path.is_file():
            report.problems.append(f"{path}: listed in the manifest but missing")
        elif hash_file(path) != meta.get(FILE_HASH):
            report.problems.append(f"{path}: content differs from the manifest's {FILE_HASH}")
    found: dict[int, dict[str, tuple[Path, dict[str, Any]]]] = {r: {} for r in range(plan.tp)}
    for entry in sorted(os.listdir(out)):
        rp = _rank_of(entry)
        if rp is None:
            continue
        rank, _ = rp
        if rank >= plan.tp:
            report.problems.append(f"{out / entry}: rank {rank} is outside --tp {plan.tp}; vLLM would load it into no rank")
            continue
        header = read_shard_header(out / entry)
        for key, info in header.entries.items():
            if key in found[rank]:
                report.problems.append(f"{out / entry}: key {key} also in {found[rank][key][0].name}")
            found[rank][key] = (out / entry, info)
    for r in range(plan.tp):
        want = {t.key: t for t in plan.keys[r]}
        got = found[r]
        for key, t in want.items():
            if key not in got:
                report.problems.append(f"rank {r}: key {key} is missing (vLLM {plan.vllm} raises on a missing key)")
                continue
            path, info = got[key]
            shape, dtype = tuple(info["shape"]), info["dtype"]
            if dtype != t.dtype:
                report.problems.append(f"{path}: {key} is {dtype}, vLLM {plan.vllm} creates it as {t.dtype}")
            if shape != t.shape:
                report.problems.append(f"{path}: {key} has shape {list(shape)}, vLLM {plan.vllm} creates "
                                       f"{list(t.shape)}{_vocab_hint(key, shape, t.shape)}")
            report.keys_checked += 1
        for key in sorted(set(got) - set(want)):
            report.problems.append(f"{got[key][0]}: extra key {key} (vLLM {plan.vllm} has no such parameter: KeyError)")
    return found


def _vocab_hint(key: str, shape: tuple[int, ...], want: tuple[int, ...]) -> str:
    if key.endswith(("embed_tokens.weight", "lm_head.weight")) and shape[1:] == want[1:] and shape[0] < want[0]:
        return " (the vocabulary is not padded to a multiple of 64)"
    return ""


def _round_trip(plan: VllmStatePlan, out: Path, found: dict[int, dict[str, tuple[Path, Any]]],
                report: VllmStateReport) -> None:
    """Invert every key of every rank to the checkpoint tensors it came from and compare bit for bit."""
    from safetensors import safe_open

    from wna16ctl.layout.vllm_state import invert_key
    from wna16ctl.sources.tensors import TensorReader

    handles: dict[Path, Any] = {}

    def load(rank: int, key: str) -> Any:
        path = found[rank][key][0]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(key)

    with TensorReader(plan.checkpoint.files) as reader:
        for t in plan.keys[0]:
            bad = invert_key(plan, reader, t, [load(r, t.key) for r in range(plan.tp)])
            if bad:
                report.problems.append(f"{found[0][t.key][0].parent}: {t.key}: {bad}")
            else:
                report.tensors_round_tripped += plan.tp


def is_vllm_output(out: str | os.PathLike[str]) -> bool:
    """Whether OUT's manifest says it holds the vllm layout (any other or none: False)."""
    try:
        return json.loads((Path(out) / MANIFEST_NAME).read_text()).get("layout") == VLLM
    except (OSError, ValueError, AttributeError):
        return False
