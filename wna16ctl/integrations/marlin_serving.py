"""What the vLLM plugin checks before and while it serves a `repack --layout marlin` output, without
torch or vLLM: the manifest, the engine it was planned for against the engine that loads it, and
the shape and dtype every expert tensor of a rank must have.

Every refusal is a `UsageError` with one line that names the output (or tensor) and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wna16ctl.dtypes import FLOAT_ST_OF_CONFIG
from wna16ctl.errors import UsageError
from wna16ctl.output.manifest import FORMAT_NAME, MANIFEST_NAME
from wna16ctl.layout.registry import PLUGIN_LOAD_FORMAT, expert_shapes
from wna16ctl.layout.spec import MARLIN, TRANSPOSED, VLLM, RankLayout
from wna16ctl.planning import rules

MANIFEST = MANIFEST_NAME
LOAD_FORMAT = PLUGIN_LOAD_FORMAT
# The releases whose weight processing of compressed-tensors WNA16 MoE layers was read for this
# plugin (the rulebook's list).
SERVED_RELEASES = rules.PLUGIN_RELEASES
# The parameters vLLM's processed Marlin MoE layer holds, by what the output may carry.
SERVED_TENSORS = ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale",
                  "w13_weight_zero_point", "w2_weight_zero_point")

ShapeDtype = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class MarlinLayer:
    """One quantized MoE layer of the output, as the manifest records it."""

    name: str  # the experts' module path in the checkpoint, e.g. model.layers.3.mlp.experts
    tensors: tuple[str, ...]  # parameter names written for the layer, in file order
    specs: tuple[RankLayout, ...]  # per rank
    experts: tuple[int, ...]  # experts each rank holds

    def rank_shapes(self, rank: int, scale_dtype: str) -> dict[str, ShapeDtype]:
        """name -> (shape, safetensors dtype) of rank `rank`'s stacked tensors of this layer."""
        per_expert = expert_shapes(self.specs[rank], scale_dtype)
        return {n: ((self.experts[rank], *shape), dtype) for n, (shape, dtype) in per_expert.items()}


@dataclass(frozen=True)
class MarlinOutput:
    """A `repack --layout marlin` output as the plugin serves it."""

    root: Path
    release: str  # the vLLM release it was planned for
    gpu: str  # the GPU (rules.GPUS key) it was planned for
    tp: int
    ep: bool
    scale_dtype: str  # safetensors dtype of the scales (BF16, F16)
    layers: tuple[MarlinLayer, ...]
    moe_backend: str  # the --moe-backend repack planned with ("auto" unless given)

    def rank_dir(self, rank: int) -> Path:
        return self.root / f"rank-{rank}"

    def expert_tensor_names(self) -> set[str]:
        return {f"{layer.name}.{t}" for layer in self.layers for t in layer.tensors}


def _manifest_error(root: Path, what: str) -> UsageError:
    return UsageError(f"{root / MANIFEST}: {what}; serve an output of `wna16ctl repack --layout marlin` "
                      f"(verify it with `wna16ctl verify`)")


def read_marlin_output(root: str | Path) -> MarlinOutput:
    """The output at `root`, or a one-line refusal when it is not a complete Marlin-layout output."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise UsageError(f"{root}: no {MANIFEST}: --load-format {LOAD_FORMAT} serves the directory "
                         f"`wna16ctl repack --layout marlin` writes (a part? run `wna16ctl assemble` first)")
    try:
        manifest = json.loads(path.read_text())
        return _parse_manifest(root, manifest)
    except UsageError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise _manifest_error(root, f"unreadable manifest ({type(exc).__name__}: {exc})") from None


def _parse_manifest(root: Path, m: dict[str, Any]) -> MarlinOutput:
    if m.get("format") != FORMAT_NAME:
        raise _manifest_error(root, "not a wna16ctl repack manifest")
    layout = m.get("layout")
    if layout != MARLIN:
        hint = {VLLM: "serve it with --load-format sharded_state",
                TRANSPOSED: f"its layout is vLLM's Triton one; repack with --layout {MARLIN}"}.get(str(layout), "")
        raise UsageError(f"{root}: layout {layout!r}, but --load-format {LOAD_FORMAT} serves the marlin layout"
                         + (f"; {hint}" if hint else ""))
    engine = m["engine"]
    scale_dtype = FLOAT_ST_OF_CONFIG.get(m["scale_dtype"])
    if scale_dtype is None:
        raise _manifest_error(root, f"scale dtype {m['scale_dtype']!r} is not one vLLM's Marlin MoE takes")
    tp = int(m["tp"])
    ep = bool(m["ep"])
    layers = []
    for lay in m["layers"]:
        if lay["layout"] != MARLIN:
            raise UsageError(f"{root}: layer {lay['name']} was written in the {lay['layout']} layout (no Marlin "
                             f"form for it); --load-format {LOAD_FORMAT} serves Marlin layers only")
        scheme = lay["scheme"]
        act_order = scheme.get("strategy") == "group" and scheme.get("actorder") in ("group", "dynamic")
        specs = tuple(
            RankLayout(layout=MARLIN, num_bits=int(scheme["num_bits"]),
                       group_size=int(scheme["group_size"]) if scheme.get("group_size") else -1,
                       symmetric=bool(scheme["symmetric"]), act_order=act_order,
                       hidden_size=int(lay["hidden_size"]), intermediate_size=int(lay["intermediate_size"]),
                       tp=1 if ep else tp, rank=0 if ep else r, load_full_w2=bool(lay["load_full_w2"]),
                       padded_intermediate=int(lay["padded_intermediate"]))
            for r in range(tp))
        experts = tuple(stop - start for start, stop in lay["expert_ranges"])
        layers.append(MarlinLayer(lay["name"], tuple(lay["tensors"]), specs, experts))
    settings = m.get("identity", {}).get("settings", {})
    return MarlinOutput(root=root, release=str(engine["version"]), gpu=str(engine["gpu"]), tp=tp, ep=ep,
                        scale_dtype=scale_dtype, layers=tuple(layers),
                        moe_backend=str(settings.get("moe_backend", "auto")))


def check_engine(out: MarlinOutput, *, vllm_version: str, capability: int | None, moe_backend: str,
                 tp: int, pp: int, ep: bool) -> None:
    """Refuse, with one line, an engine other than the one `out` was planned for: its release,
    its GPU (compute capability x 10; None: no CUDA GPU), its MoE backend, its parallel layout.

    The Marlin tensors are exact only for the release, GPU and backend the planner chose them for
    (padding and the backend's own processing differ between them), so a mismatch is never served."""
    root = out.root
    release = vllm_version.split("+", 1)[0]
    if release not in SERVED_RELEASES:
        raise UsageError(f"{root}: --load-format {LOAD_FORMAT} serves vLLM {', '.join(SERVED_RELEASES)}; this is "
                         f"vLLM {vllm_version}: install one of those, or serve the checkpoint itself")
    if rules.version_key(release) != rules.version_key(out.release):
        raise UsageError(f"{root}: repacked for vLLM {out.release}, this is vLLM {vllm_version}; "
                         f"repack with --vllm {release} (or serve with vLLM {out.release})")
    if capability is None:
        raise UsageError(f"{root}: --load-format {LOAD_FORMAT} serves the Marlin layout, which runs on a CUDA GPU; "
                         f"no CUDA GPU here")
    planned = rules.GPUS.get(out.gpu)
    if planned != capability:
        here = next((name for name, cc in rules.GPUS.items() if cc == capability), f"sm{capability}")
        raise UsageError(f"{root}: repacked for {out.gpu}, this GPU is {here} (compute capability "
                         f"{capability // 10}.{capability % 10}); repack with --gpu {here}")
    if out.moe_backend not in ("auto", "marlin"):
        raise UsageError(f"{root}: repacked for --moe-backend {out.moe_backend}; the Marlin layout is served by "
                         f"the marlin backend only: repack without --moe-backend or with --moe-backend marlin")
    if moe_backend not in ("auto", "marlin"):
        raise UsageError(f"{root}: --moe-backend {moe_backend} cannot read the Marlin layout; serve with "
                         f"--moe-backend marlin")
    if pp != 1:
        raise UsageError(f"{root}: pipeline parallelism ({pp} stages) is not served by --load-format "
                         f"{LOAD_FORMAT}; serve with --pipeline-parallel-size 1")
    if ep or out.ep:
        raise UsageError(f"{root}: expert parallelism is not served by --load-format {LOAD_FORMAT} yet "
                         f"(output {'with' if out.ep else 'without'} --ep, engine {'with' if ep else 'without'}); "
                         f"repack and serve without --ep")
    if tp != out.tp:
        raise UsageError(f"{root}: repacked for tensor parallel size {out.tp}, served with {tp}; "
                         f"serve with -tp {out.tp} or repack with --tp {tp}")


def check_tensor(name: str, got: ShapeDtype, expected: ShapeDtype, what: str) -> None:
    """One line when `got` (shape, safetensors dtype) is not `expected` (the manifest's)."""
    if tuple(got[0]) != tuple(expected[0]) or got[1] != expected[1]:
        raise UsageError(f"{name}: {what} is {list(got[0])} {got[1]}, the manifest says {list(expected[0])} "
                         f"{expected[1]}; the output and the engine disagree: repack for this engine and "
                         f"`wna16ctl verify` the output")


def served_layer_tensors(layer: MarlinLayer, root: Path) -> tuple[str, ...]:
    """The layer's tensors, refusing any the processed Marlin layer has no parameter for."""
    extra = [t for t in layer.tensors if t not in SERVED_TENSORS]
    if extra:
        raise UsageError(f"{root}: layer {layer.name} carries {', '.join(extra)} (act-order), which vLLM's "
                         f"compressed-tensors Marlin MoE layer of {', '.join(SERVED_RELEASES)} has no parameter "
                         f"for; repack a checkpoint without activation reordering")
    return layer.tensors
