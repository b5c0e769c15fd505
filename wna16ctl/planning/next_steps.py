"""What to run next: the `repack` and `vllm serve` lines every command ends with.

One owner for the serve command of each repack layout: `inspect` prints them per loadable TP size
(`planning.serving` chooses the layout), `repack` and `verify` print the serve command of the
layout they wrote or proved, and the JSON forms carry the same lines as `next_steps`.

Every line is shell-quoted: a path with spaces or non-ASCII characters pastes as one word.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wna16ctl.layout.registry import layout_of
from wna16ctl.layout.spec import MARLIN, VLLM
from wna16ctl.planning import rules

VLLM_LAYOUT = VLLM
MARLIN_LAYOUT = MARLIN
# The releases the plugin serves (the rulebook's; integrations.marlin_serving checks the engine against them).
PLUGIN_RELEASES = rules.PLUGIN_RELEASES
PLUGIN_INSTALL = "pip install 'wna16ctl[vllm]'"
# The hazard the plugin's layout corrects (planning.moe states it; vLLM PR #50196).
W13_SCALE_HAZARD = "PR #50196"


@dataclass(frozen=True)
class NextStep:
    """How to serve one TP size: the layout to write (None: serve the checkpoint as it is), the
    `wna16ctl repack` line that writes it and the `vllm serve` line that serves it."""

    tp: int
    ep: bool
    layout: str | None
    repack: str | None
    serve: str
    why: str
    needs: str | None = None  # what must be installed first (the plugin), if anything

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "ep": self.ep, "layout": self.layout, "repack": self.repack, "serve": self.serve,
                "why": self.why, "needs": self.needs}

    def lines(self) -> list[str]:
        """The commands in the order they are run."""
        return [x for x in (self.needs, self.repack, self.serve) if x]


def _env_prefix(env: Any) -> str:
    pairs = list(env.items()) if isinstance(env, dict) else list(env or ())
    return "".join(f"{name}={shlex.quote(str(value))} " for name, value in pairs)


def serve_command(out: str | os.PathLike[str], layout: str | None, tp: int, *, ep: bool = False, moe_backend: str = "auto",
                  env: Any = (), revision: str | None = None, memory: tuple[str, ...] = ()) -> str:
    """The `vllm serve` line for `out`: a repack output of `layout`, or (layout None) a checkpoint
    vLLM loads itself (a local directory or a Hub repo id at `revision`); `memory`: the
    `--max-model-len` / `--gpu-memory-utilization` words the start needs to fit
    (`planning.serving.memory_options`)."""
    words = ["vllm", "serve", str(out)]
    hint = None if layout is None else layout_of(layout).serve
    if hint is not None and hint.load_format is not None:
        words += ["--load-format", hint.load_format]
        moe_backend = hint.moe_backend or moe_backend  # a loader that pins the backend reading its layout
    elif revision:
        words += ["--revision", revision]
    words += ["--tensor-parallel-size", str(tp)]
    if ep:
        words.append("--enable-expert-parallel")
    if moe_backend != "auto":
        words += ["--moe-backend", moe_backend]
    return _env_prefix(env) + shlex.join(words + list(memory))


def output_name(ckpt: str, layout: str, tp: int, *, hub: bool = False, ep: bool = False) -> str:
    """A default output directory for the repack line: the checkpoint's name, layout and TP (and
    `-ep` for expert parallelism, whose ranks hold other tensors than TP's).  A
    local checkpoint's output is its sibling, named as the line names the checkpoint (relative
    stays relative, to the same directory, whatever the checkpoint path is: `.`, `..`, `a/b/`);
    a Hub checkpoint's is in the current directory."""
    if hub:
        base = ckpt.rstrip("/").split("@", 1)[0].rsplit("/", 1)[-1] or "ckpt"
        return f"{base}-{layout}-tp{tp}{'-ep' if ep else ''}"
    where = os.path.abspath(ckpt)
    name = f"{os.path.basename(where) or 'ckpt'}-{layout}-tp{tp}{'-ep' if ep else ''}"
    sibling = os.path.join(os.path.dirname(where), name)
    return sibling if os.path.isabs(ckpt) else os.path.relpath(sibling)


def repack_command(ckpt: str, out: str, layout: str, tp: int, *, vllm: str, gpu: str, moe_backend: str = "auto",
                   env: Any = (), ep: bool = False) -> str:
    words = ["wna16ctl", "repack", ckpt, "--tp", str(tp)] + (["--ep"] if ep else []) + [
        "--layout", layout, "--vllm", vllm, "--gpu", gpu]
    pairs = list(env.items()) if isinstance(env, dict) else list(env or ())
    for name, value in pairs:
        words += ["--env", f"{name}={value}"]
    if moe_backend != "auto":
        words += ["--moe-backend", moe_backend]
    return shlex.join(words + ["-o", out])


def plugin_serves(version: str, ep: bool, act_order: bool) -> bool:
    """Whether `--load-format wna16ctl` serves a Marlin output planned for this deployment."""
    return version in PLUGIN_RELEASES and not ep and not act_order


def has_w13_scale_hazard(hazards: list[str]) -> bool:
    return any(W13_SCALE_HAZARD in h for h in hazards)


def checkpoint_ref(ck: Any) -> tuple[str, str | None]:
    """How a command names the checkpoint: the Hub repo id (with its revision unless the default
    branch) for a Hub checkpoint, never the cache snapshot; else the directory."""
    if ck.source is not None:
        rev = ck.source.get("revision")
        rev = None if rev in (None, "main") else str(rev)
        return ck.source["repo_id"] + (f"@{rev}" if rev else ""), rev
    return str(ck.root), None


def output_next_step(ckpt: str | Path, out: str | Path, layout: str, tp: int, ep: bool, vllm: str,
                     moe_backend: str = "auto", env: Any = (),
                     layers: list[dict[str, Any]] | None = None) -> NextStep:
    """After `repack` wrote (or `verify` proved) `out` from `ckpt`: how to serve it.  `layers` is
    the manifest's layer list (their layouts and schemes decide whether the plugin serves a Marlin
    output); where no load format reads the output, the checkpoint itself is served."""
    out = str(out)
    if layout == VLLM_LAYOUT:
        return NextStep(tp, ep, layout, None, serve_command(out, layout, tp, ep=ep, moe_backend=moe_backend, env=env),
                        "stock vLLM reads each rank's files with its sharded_state loader")
    layouts = {lay.get("layout") for lay in layers or ()}
    act_order = any((lay.get("scheme") or {}).get("actorder") in ("group", "dynamic") for lay in layers or ())
    if layouts <= {MARLIN_LAYOUT} and plugin_serves(vllm, ep, act_order):
        return NextStep(tp, ep, MARLIN_LAYOUT, None, serve_command(out, MARLIN_LAYOUT, tp, env=env),
                        "the wna16ctl load format serves the Marlin layout in vLLM", needs=PLUGIN_INSTALL)
    why = ("no vLLM load format reads this output"
           + (f" (the wna16ctl load format serves vLLM {', '.join(PLUGIN_RELEASES)}, TP only, without act-order, "
              "Marlin layers only)" if layouts else "")
           + "; serve the checkpoint itself (or repack with --layout vllm for stock vLLM)")
    return NextStep(tp, ep, None, None, serve_command(ckpt, None, tp, ep=ep, moe_backend=moe_backend, env=env), why)


def manifest_next_step(manifest: dict[str, Any], out: str | Path, ckpt: str | Path | None = None) -> NextStep | None:
    """How to serve the output at `out` whose manifest is `manifest` (None for a part: the parts
    are joined with `assemble` first).  `ckpt`: the checkpoint, served itself where no load format
    reads the output (default: the source path the manifest records).  Where the opened checkpoint
    is at hand, `planning.serving.output_serve_path` answers instead (as inspect and pad do)."""
    settings = (manifest.get("identity") or {}).get("settings") or {}
    engine = manifest.get("engine") or {}
    tp = int(manifest["tp"])
    part = manifest.get("part")
    if isinstance(part, dict) and len(part.get("ranks") or ()) != tp:
        return None  # a manifest part: the parts are joined first
    source = ckpt if ckpt is not None else (manifest.get("source") or {}).get("path", "CKPT")
    return output_next_step(source, out, str(manifest.get("layout")), tp, bool(manifest.get("ep")),
                            str(engine.get("version", "")), moe_backend=str(engine.get("moe_backend") or
                                                                             settings.get("moe_backend") or "auto"),
                            env=dict(engine.get("env") or settings.get("env") or {}),
                            layers=[lay for lay in manifest.get("layers") or () if isinstance(lay, dict)])
