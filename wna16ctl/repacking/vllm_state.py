"""`repack --layout vllm`: every rank's planned state (`wna16ctl.planning.vllm_state`) built key by
key (`wna16ctl.layout.vllm_state.build_tensor`) and written through the staged output of
`writer.StagedOutput` (atomic commit), with the side files and the manifest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from wna16ctl.layout.spec import VLLM
from wna16ctl.output.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, SIDE_FILES
from wna16ctl.planning.vllm_state import PATTERN, VllmStatePlan
from wna16ctl.repacking.pipeline import RepackResult
from wna16ctl.sources import source_fingerprint
from wna16ctl.version import __version__

def identity(plan: VllmStatePlan) -> dict[str, Any]:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": __version__,
            "source_fingerprint": source_fingerprint(plan.checkpoint),
            "settings": {"tp": plan.tp, "ep": plan.ep, "layout": VLLM, "vllm": plan.vllm}}


def write_vllm_state(plan: VllmStatePlan, out: str | os.PathLike[str], *, force: bool = False,
                     progress: Callable[..., Callable[[int], None]] | None = None) -> RepackResult:
    """Build and write every rank's files, the side files and the manifest; commit atomically."""
    from safetensors.torch import save

    from wna16ctl.layout.vllm_state import build_tensor
    from wna16ctl.output.writer import StagedOutput
    from wna16ctl.sources.tensors import TensorReader

    out_path = Path(out).resolve()
    ident = identity(plan)
    staged = StagedOutput(out_path, force=force, resume=False, identity=ident, checkpoint=plan.checkpoint.root)
    total = sum(t.nbytes for keys in plan.keys for t in keys)
    advance = progress("writing the vLLM state", total, unit="bytes") if progress else (lambda n: None)
    try:
        with TensorReader(plan.checkpoint.files) as reader:
            for r in range(plan.tp):
                for name, part in zip(plan.files(r), plan.parts[r]):
                    tensors = {t.key: build_tensor(plan, reader, t, r) for t in part}
                    staged.write_small(name, save(tensors, metadata={"format": "pt"}))
                    advance(sum(t.nbytes for t in part))
        for name in SIDE_FILES:
            src = plan.checkpoint.root / name
            if src.is_file():
                staged.copy_file(src, name)
        staged.collect_hashes()
        manifest = build_manifest(plan, staged.done, staged.stage, ident, out_path)
        staged.commit(manifest, MANIFEST_NAME)
    except BaseException:
        staged.abort(keep_for_resume=False)
        raise
    return RepackResult(out=out_path, files_written=sum(len(r["files"]) for r in manifest["ranks"]), files_reused=0,
                        bytes_written=sum(int(r["bytes"]) for r in manifest["ranks"]), manifest=manifest,
                        ranks=list(range(plan.tp)), plan=plan, layout_json=plan.result_json(out_path, manifest))


def _switches_json(switches: Any) -> dict[str, Any]:
    """The engine switches a plan followed, recorded only when given (verify plans with them again)."""
    if switches is None:
        return {}
    out: dict[str, Any] = {}
    if switches.env:
        out["env"] = dict(switches.env)
    if switches.moe_backend != "auto":
        out["moe_backend"] = switches.moe_backend
    return out


def build_manifest(plan: VllmStatePlan, hashes: dict[str, str], root: Path, ident: dict[str, Any],
                   out: Path) -> dict[str, Any]:
    from wna16ctl.output.writer import FILE_HASH

    ck = plan.checkpoint
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tool_version": __version__, "identity": ident,
        "source": {"path": os.path.abspath(ck.root), "fingerprint": ident["source_fingerprint"],
                   "architecture": (ck.config.architectures or ("",))[0]},
        "engine": {"name": "vllm", "version": plan.vllm, "load_format": "sharded_state", "pattern": PATTERN,
                   "gpu": plan.gpu, **_switches_json(plan.switches)},
        "experts": plan.experts_json(),
        "tp": plan.tp, "ep": plan.ep, "layout": VLLM, "model_dtype": plan.model_dtype,
        "ranks": [{"rank": r, "files": plan.files(r), "keys": len(plan.keys[r]),
                   "bytes": sum(t.nbytes for t in plan.keys[r])} for r in range(plan.tp)],
        "serve": plan.serve_command(out),
        "files": {rel: {FILE_HASH: digest, "bytes": (root / rel).stat().st_size} for rel, digest in sorted(hashes.items())},
    }


def check_options(*, ranks: Any, resume: bool, node_local: bool, processes: int) -> None:
    """The options the other layouts take that this one does not: refused with one line each."""
    from wna16ctl.errors import UsageError

    if processes > 1 or ranks is not None or node_local:
        raise UsageError("--layout vllm is written by one process for all ranks: drop torchrun, --ranks and "
                         "--node-local (pipeline parallelism is not supported either)")
    if resume:
        raise UsageError("--layout vllm has no --resume: rerun with --force")
