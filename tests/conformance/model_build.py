"""The planner against each vLLM release's own model class, built on the meta device.

For a checkpoint on disk (config.json + safetensors headers), a TP size, EP or not and a GPU,
the release's worker (_vllm_worker.py, `model_outcome`) runs `EngineArgs.create_engine_config()`
and `initialize_model` as its engine does on rank 0 of `tp` ranks, and reads the decisions off
the built modules; `inspect_checkpoint` plans the same checkpoint.  Compared, per case:

* verdict: where the release stops (engine config, model construction, the weight loader) or
  that it builds, against where the planner says it stops (config-parse refusal and the model
  checks of the engine config, layers refused while they are built, expert checks made by the
  weight loader);
* per routed-experts layer: quant method class, the oracle's backend, the rejected set (over the
  backends the planner names, as in test_vllm_conformance.py) and the w2 scale sharding (both
  `_w2_scale_sharding` where the release has it, and the w2 scale parameter's extent);
* per quantized linear layer: the kernel and the per-rank (K, N); the set of quantized linear
  layers (a packed lm_head quantized or not, fused projections);
* with `load` (small checkpoints only: the files are read), the release's default weight loader.

    python -m tests.conformance.model_build --releases 0.27.1,0.33.0 --gpus sm80,sm90,sm100

prints the counts per release x GPU and every unexplained disagreement; exit 1 when there is one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from tests import modelckpt as m
from tests.conformance import adversarial, ckptcase
from tests.conformance import cases as case_space
from tests.conformance import vllm_release
from tests.conformance.known_differences import known_model_cause
from tests.conformance.test_vllm_conformance import COMPARED_BACKENDS

GPUS = ("sm80", "sm90", "sm100")
TPS = (1, 2, 4, 8)
# the weight loader reads the files: only checkpoints whose tensors total at most this many bytes
LOAD_LIMIT = 64 << 20
# The one-layer case checkpoints (ckptcase.py) get an unquantized attention block and router,
# ignored by the quantization config as the usual recipe ignores the router: the model class
# needs them, and the cases are about the experts.  16 heads divide every TP size drawn but 3;
# head_dim 64 is one every attention backend takes.
_CASE_HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64}
_CASE_IGNORE = [r"re:.*self_attn.*", r"re:.*mlp\.gate$"]


# -- checkpoints --------------------------------------------------------------------------------

def _kimi(c: dict, q: dict | None):
    return m.deepseek_v3(c["text_config"], q, "language_model.model", "language_model.lm_head")


def _with_quant(config: dict, **quant: Any) -> dict:
    config["quantization_config"] = m.w4a16(m.RECIPE_IGNORE, **quant)
    return config


def _packed_head(config: dict, target: bool) -> dict:
    q = config["quantization_config"]
    q["ignore"] = [p for p in q["ignore"] if p != "lm_head"]
    if target:
        q["config_groups"]["group_0"]["targets"] = ["Linear", "lm_head"]
    return config


def _qwen3() -> dict:
    # the published config renormalizes the top-k routing weights (the model class reads it)
    return dict(m.qwen3_30b_a3b(layers=1), norm_topk_prob=True)


def real_configs() -> dict[str, tuple[dict, Callable]]:
    """Published models' configs (layer counts cut down) and recipe variants of them."""
    return {
        "qwen3_30b_a3b": (_qwen3(), m.qwen3_moe),
        "qwen3_int8_channel": (_with_quant(_qwen3(), num_bits=8, group_size=-1), m.qwen3_moe),
        "qwen3_asym_g64": (_with_quant(_qwen3(), symmetric=False, group_size=64), m.qwen3_moe),
        "qwen3_g32": (_with_quant(_qwen3(), group_size=32), m.qwen3_moe),
        # softmax top-k without renormalization (vLLM's Default routing method)
        "qwen3_g32_unnormalized_topk": (dict(_with_quant(_qwen3(), group_size=32), norm_topk_prob=False), m.qwen3_moe),
        "qwen3_packed_head": (_packed_head(_qwen3(), False), m.qwen3_moe),
        "qwen3_packed_head_target": (_packed_head(_qwen3(), True), m.qwen3_moe),
        "qwen15_moe_a27b": (m.qwen15_moe_a27b(layers=1), m.qwen3_moe),
        "mixtral_8x7b": (m.mixtral_8x7b(layers=1), m.mixtral),
        "mixtral_g128": (_with_quant(m.mixtral_8x7b(layers=1)), m.mixtral),
        "deepseek_v3": (m.deepseek_v3_671b(layers=2, dense=1), m.deepseek_v3),
        "kimi_k25": (m.kimi_k25(layers=2), _kimi),
        "glm45_air": (m.glm45_air(layers=2), m.glm4_moe),
        "qwen35_35b_a3b": (m.qwen35_35b_a3b(layers=4), m.qwen3_5_moe),
    }


def write_real(name: str, root: Path) -> Path:
    out = root / name
    if not (out / "config.json").is_file():
        config, family = real_configs()[name]
        q = config.get("quantization_config")
        m.write(out, config, family(config, q))
    return out


# GPTQ and AWQ checkpoints with Qwen3-30B-A3B's expert shapes (H 2048, I 768, group 128), as
# Qwen/Qwen3-30B-A3B-GPTQ-Int4 and the community AWQ exports store them; one layer, 8 experts and a
# small vocabulary keep the files (read by the weight loader) small, and their padded copies too
QWEIGHT_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_30b_a3b_gptq_int4": ("gptq", {
        "bits": 4, "checkpoint_format": "gptq", "desc_act": False, "group_size": 128, "lm_head": False,
        "pack_dtype": "int32", "quant_method": "gptq", "sym": True}),
    "qwen3_30b_a3b_awq": ("awq", {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None}),
}


def write_qweight(name: str, root: Path) -> Path:
    """A header-only checkpoint of QWEIGHT_CONFIGS in its stored form; GPTQ's symmetric qzeros hold
    the midpoint (what the tool's reader checks where it reads data, `pad` included)."""
    from tests.sources import qweight_ckpt

    out = root / name
    if not (out / "config.json").is_file():
        form, qc = QWEIGHT_CONFIGS[name]
        config = {**m.qwen3_30b_a3b(layers=1), "num_experts": 8, "vocab_size": 1024}
        qweight_ckpt.header_only(out, config, json.loads(json.dumps(qc)), form=form, family=m.qwen3_moe)
        if form == "gptq":
            qweight_ckpt.fill_symmetric_zero_points(out)
    return out


def checkpoint_tensor_names(ckpt: Path) -> list[str]:
    names: list[str] = []
    for shard in sorted(Path(ckpt).glob("*.safetensors")):
        with open(shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            names += [k for k in json.loads(f.read(n)) if k != "__metadata__"]
    return sorted(names)


def format_check(version: str, case: dict[str, Any]) -> tuple[list[str], dict, dict]:
    """A GPTQ/AWQ checkpoint built (and with `load`, loaded) by the release against the planner:
    the verdict and each routed-experts layer's quant method class (`disagreements`' MoE part),
    and, loaded, that the loader read every tensor of the checkpoint.  The quantized linear layers
    are not compared: the worker reads the kernels of compressed-tensors linear methods only."""
    plan = planner_outcome(case, version)
    req = {k: case[k] for k in ("ckpt", "tp", "ep", "gpu", "env")}
    req.update(kind="model", load=bool(case.get("load")), ckpt_names=sorted({*plan["moe"], *plan["linear"]}))
    vllm = vllm_release.vllm_outcome(version, req)
    plan = _renamed(plan, vllm.get("name_map") or {})
    diffs = disagreements(vllm, dict(plan, linear={}), bool(case.get("load")))
    if case.get("load") and vllm["stage"] is None:
        missing = sorted(set(checkpoint_tensor_names(Path(case["ckpt"]))) - set(vllm["loaded"]["names_read"]))
        if missing:
            diffs.append(f"tensors the weight loader never read: {missing[:5]}")
    return diffs, vllm, plan


def write_layer_case(case: dict[str, Any], out: Path) -> Path:
    """A conformance layer case (ckptcase.py) as a one-layer checkpoint with attention: Qwen3-MoE,
    or Mixtral where the experts have Mixtral's names (w1/w3/w2 under `block_sparse_moe`: each
    model class names its own experts, and only Mixtral's uses those)."""
    if (out / "config.json").is_file():
        return out
    ckptcase.write_case(case, out)
    config = json.loads((out / "config.json").read_text())
    config.update(_CASE_HEADS)
    q = config["quantization_config"]
    q["ignore"] += _CASE_IGNORE
    H, heads, hd = config["hidden_size"], _CASE_HEADS["num_attention_heads"], _CASE_HEADS["head_dim"]
    p = "model.layers.0.self_attn"
    extra = [(f"{p}.q_proj.weight", [heads * hd, H]), (f"{p}.k_proj.weight", [heads * hd, H]),
             (f"{p}.v_proj.weight", [heads * hd, H]), (f"{p}.o_proj.weight", [H, heads * hd])]
    rename = {}
    if case.get("names") == "w1_w3_w2":
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                      num_local_experts=config.pop("num_experts"), intermediate_size=config.pop("moe_intermediate_size"))
        rename = {".mlp.": ".block_sparse_moe."}
        q["ignore"].append(r"re:.*block_sparse_moe\.gate$")
        for group in q["config_groups"].values():
            group["targets"] = [t.replace(r"mlp\.experts", r"block_sparse_moe\.experts") for t in group["targets"]]
    else:
        extra += [(f"{p}.q_norm.weight", [hd]), (f"{p}.k_norm.weight", [hd])]
    (out / "config.json").write_text(json.dumps(config))
    _rewrite_header(out / "model.safetensors", rename, extra)
    return out


def _rewrite_header(path: Path, rename: dict[str, str], extra_bf16: list[tuple[str, list[int]]]) -> None:
    """Rename tensors (substring replacements) and add BF16 ones after them in a one-shard
    safetensors file whose data is never read back (a sparse file)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        old = json.loads(f.read(n))
    header = {}
    for name, entry in old.items():
        for a, b in rename.items():
            name = name.replace(a, b)
        header[name] = entry
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    for name, shape in extra_bf16:
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [end, end + size]}
        end += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + end)


def _bytes(ckpt: Path) -> int:
    return sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))


def model_cases(root: Path, gpu: str, sampled: int = 12, seed: int = 0) -> list[dict[str, Any]]:
    """Every case of one GPU: the real configs at TP 1/2/4/8 with and without EP, the adversarial
    fixtures at TP 1/2/4/8, and `sampled` layer cases drawn from the conformance case space (bit
    widths, packings, expert names, targets, act-order values, packed lm_heads)."""
    out: list[dict[str, Any]] = []
    for name in real_configs():
        ckpt = write_real(name, root / "real")
        for tp in TPS:
            for ep in (False, True):
                if ep and tp == 1:
                    continue
                out.append({"name": f"{name} tp{tp}{' ep' if ep else ''}", "ckpt": str(ckpt), "tp": tp, "ep": ep,
                            "gpu": gpu, "env": {}})
        if gpu == "sm100":  # FlashInfer's int4 MoE switched on (group-32 int4 checkpoints take it)
            for tp in TPS:
                out.append({"name": f"{name} tp{tp} flashinfer", "ckpt": str(ckpt), "tp": tp, "ep": False,
                            "gpu": gpu, "env": {"VLLM_USE_FLASHINFER_MOE_INT4": "1"}})
    for name, fixture in adversarial.FIXTURES.items():
        if fixture.get("gpu", "sm90") != "sm90" and fixture["gpu"] != gpu:
            continue  # a fixture made for one GPU
        for tp in TPS:
            case = dict(fixture, tp=tp, gpu=gpu)
            ckpt = write_layer_case(case, root / "adversarial" / name)
            out.append({"name": f"{name} tp{tp}", "ckpt": str(ckpt), "tp": tp, "ep": False, "gpu": gpu,
                        "env": dict(fixture.get("env") or {}), "load": _bytes(ckpt) <= LOAD_LIMIT})
    rng = random.Random(seed)
    for i in range(sampled):
        case = case_space.sample(rng, [gpu])
        # the model is built at its own sizes: keep the expert tensors small enough to read
        case.update(hidden_size=min(case["hidden_size"], 1024), intermediate_size=min(case["intermediate_size"], 1024),
                    moe_backend="auto")
        ckpt = write_layer_case(case, root / "sampled" / f"{gpu}-{seed}-{i}")
        out.append({"name": f"sampled {i} tp{case['tp']}{' ep' if case['ep'] else ''}", "ckpt": str(ckpt),
                    "tp": case["tp"], "ep": case["ep"], "gpu": gpu, "env": dict(case["env"]),
                    "load": _bytes(ckpt) <= LOAD_LIMIT, "layer_case": case})
    return out


# -- the planner's side -------------------------------------------------------------------------

_ORDER = {None: 3, "load": 2, "model": 1, "config": 0}


def planner_outcome(case: dict[str, Any], version: str) -> dict[str, Any]:
    """The planner's answer in the shape of `model_outcome`."""
    from wna16ctl.errors import WnaError
    from wna16ctl.planning.inspection import inspect_checkpoint

    tp, ep, gpu = case["tp"], case["ep"], case["gpu"]
    out: dict[str, Any] = {"stage": None, "error": None, "moe": {}, "linear": {}, "head_quantized": False}
    try:
        insp = inspect_checkpoint(case["ckpt"], tps=(tp,), ep=ep, vllm=version, gpu=gpu,
                                  env=case.get("env") or None)
    except WnaError as exc:
        out.update(stage="input", error=str(exc))
        return out
    stages: list[tuple[str, str]] = []
    refusal = insp.refusals[version]
    if refusal is not None:
        stages.append(("config", refusal.error))
    for c in insp.checks:  # the engine's checks of the model's sizes at this TP size
        if c.fatal and not c.ok:
            stages.append(("config" if c.stage == "config" else "model", c.error or c.rule))
    for name, (plan,) in insp.linear_plans.items():
        if plan.failure_rule in ("unquantized", "built unquantized"):
            # packed tensors for a module the release builds unquantized (no group targets it, or
            # its rules leave it unquantized): the weight loader finds no parameter for them
            # (the planner files "unquantized" under the config, where it reads the fact from)
            if plan.errors:
                stages.append(("load", plan.errors[0]))
            continue
        if name.split(".")[-1] == "lm_head":
            out["head_quantized"] = True
        out["linear"][name] = {"kernel": plan.kernel, "k_p": plan.k, "n_p": plan.n}
        if not plan.loadable:
            stages.append(("load" if plan.failure_stage == "load" else "model", plan.errors[0] if plan.errors else "?"))
    for name, (plan,) in insp.plans.items():
        out["moe"][name] = {
            "method_class": (plan.method or {}).get("class"),
            "backend": plan.backend.value if plan.backend is not None else None,
            "rejected": sorted(k for k, why in plan.rejected.items()
                               if not why.startswith(("lower priority", "not considered"))),
            "considered": sorted(set(plan.rejected) | ({plan.backend.value} if plan.backend else set())),
            "w2_scale_sharding": None if plan.w2 is None else [plan.w2.load_full_w2, plan.w2.w2_scales_size,
                                                               plan.w2.is_k_full],
            "group_size": plan_group_size(insp, name),
            "stage": plan.failure_stage, "error": plan.errors[0] if plan.errors else None,
        }
        if plan.errors:
            stages.append(("load" if plan.failure_stage == "load" else "model", plan.errors[0]))
    if stages:
        out["stage"], out["error"] = min(stages, key=lambda s: _ORDER[s[0]])
    else:
        out.update(planner_memory(insp, tp, ep, version))
    return out


def planner_memory(insp, tp: int, ep: bool, version: str) -> dict[str, Any]:
    """The planner's per-rank weight bytes (rank 0, as built) and KV-cache bytes per token."""
    from wna16ctl.dtypes import ST_SIZES
    from wna16ctl.planning.kvcache import MAMBA, kv_cache
    from wna16ctl.planning.memory import model_st_dtype, weights_per_rank

    ck = insp.checkpoint
    mem = weights_per_rank(ck, tp, ep, version, {k: v[0] for k, v in insp.plans.items()},
                           {k: v[0] for k, v in insp.linear_plans.items()})
    model_bytes = ST_SIZES[model_st_dtype(ck)]
    kv = kv_cache(ck, tp, model_bytes, model_bytes)
    per_layer = sorted((lay.kind == MAMBA, lay.state_bytes if lay.kind == MAMBA else lay.bytes_per_token)
                       for lay in kv.layers)
    return {"weights_bytes": mem.built_bytes, "weights_not_counted": mem.not_counted, "kv_per_layer": per_layer}


def processed_experts(version: str, case: dict[str, Any]) -> tuple[list[list], list[list]]:
    """Per routed-experts layer of rank 0, after the release's weight processing: vLLM's
    [backend, bytes] (its `process_weights_after_loading` run on the meta-built model; the error it
    raised, if any, third) against the planner's [backend, built + processing bytes]."""
    from wna16ctl.planning.inspection import inspect_checkpoint
    from wna16ctl.planning.memory import weights_per_rank

    req = {k: case[k] for k in ("ckpt", "tp", "ep", "gpu", "env")}
    vllm = vllm_release.vllm_outcome(version, dict(req, kind="model", process=True))
    assert vllm["stage"] is None, vllm.get("error")
    insp = inspect_checkpoint(case["ckpt"], [case["tp"]], case["ep"], vllm=version, gpu=case["gpu"])
    plans = {k: v[0] for k, v in insp.plans.items()}
    mem = weights_per_rank(insp.checkpoint, case["tp"], case["ep"], version, plans,
                           {k: v[0] for k, v in insp.linear_plans.items()}, sms=_SM_COUNT[case["gpu"]])
    mine = []
    for prefix, plan in sorted(plans.items()):
        extra = sum(v for k, v in mem.processing.items() if k.startswith(prefix + "."))
        mine.append([plan.backend.value if plan.backend else None,
                     mem.built[prefix] + mem.built.get(prefix + ".expert_map", 0) + extra])
    theirs = sorted([b, n] + ([err] if err else []) for _, b, n, err in vllm["experts_processed"])
    return theirs, sorted(mine)


# the worker platform's SM counts per architecture (_vllm_worker.SM_COUNT)
_SM_COUNT = {"sm75": 40, "sm80": 108, "sm86": 72, "sm89": 142, "sm90": 132, "sm100": 148, "sm120": 188}


def vllm_kv_per_layer(vllm: dict[str, Any]) -> list[tuple[bool, int]] | str:
    """Per attention layer of the built model: (a per-sequence state, bytes) -- page size over block
    size for attention specs (bytes per token), the page size for a state (MambaSpec)."""
    out = []
    for name, spec in (vllm.get("kv_spec") or {}).items():
        if "error" in spec:
            return f"{name}: {spec['error']}"
        state = spec["class"] == "MambaSpec"
        out.append((state, spec["page_size_bytes"] if state else spec["page_size_bytes"] // spec["block_size"]))
    return sorted(out)


# vLLM's parameters and buffers the weight figure leaves out: the multimodal encoders (built from
# vision_config, not from planned tensors) and the rotary caches (sized by max_position_embeddings,
# which the cut-down configs leave to transformers' defaults)
_NOT_WEIGHTS = ("visual.", "vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.",
                "audio_tower.", "model.visual.")


def vllm_weight_bytes(vllm: dict[str, Any]) -> int:
    return sum(v[2] for k, v in (vllm.get("tensors") or {}).items()
               if not k.startswith(_NOT_WEIGHTS) and not k.endswith("cos_sin_cache"))


def memory_disagreements(vllm: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """The weight bytes of the built rank against the planner's, byte for byte."""
    if vllm["stage"] is not None or plan["stage"] is not None or "weights_bytes" not in plan:
        return []
    out = []
    got = vllm_weight_bytes(vllm)
    if got != plan["weights_bytes"]:
        out.append(f"weights per rank: vllm {got} bytes vs planner {plan['weights_bytes']} "
                   f"({plan['weights_bytes'] - got:+d})")
    kv = vllm_kv_per_layer(vllm)
    if kv != [tuple(x) for x in plan["kv_per_layer"]]:
        out.append(f"KV cache per layer (state?, bytes): vllm {kv} vs planner {plan['kv_per_layer']}")
    return out


def plan_group_size(insp, name: str) -> int | None:
    for lay in insp.checkpoint.layers:
        if lay.prefix == name:
            return lay.scheme.group_size if lay.scheme.strategy == "group" else -1
    return None


# -- comparison ---------------------------------------------------------------------------------

def _moe_name(vllm_name: str) -> str:
    return vllm_name.removesuffix(".routed_experts")


def _w2_extent(shape: list[int], hidden: int | None) -> int | None:
    """The w2 scale parameter's group extent: (experts, groups, hidden) or (experts, hidden, groups)."""
    if not shape or len(shape) != 3:
        return None
    return shape[2] if shape[1] == hidden and shape[2] != hidden else shape[1]


def disagreements(vllm: dict[str, Any], plan: dict[str, Any], loaded: bool) -> list[str]:
    out: list[str] = []
    v_stage = vllm["stage"]
    p_stage = plan["stage"]
    if not loaded and p_stage == "load":
        p_stage = None  # the loader was not run: its checks are not compared
    if v_stage != p_stage:
        out.append(f"verdict: vllm {v_stage!r} ({vllm.get('error_type')}: {(vllm.get('error') or '')[:160]}) "
                   f"vs planner {p_stage!r} ({(plan.get('error') or '')[:160]})")
    if v_stage in ("config", "model"):
        return out  # nothing was built
    v_moe = {_moe_name(k): v for k, v in vllm["moe"].items()}
    for name in sorted(set(v_moe) | set(plan["moe"])):
        v, p = v_moe.get(name), plan["moe"].get(name)
        if v is None or p is None:
            out.append(f"moe layers: {name} only in {'planner' if v is None else 'vllm'}")
            continue
        wna16 = v["method_class"].startswith("CompressedTensorsWNA16")
        if not wna16:
            # a GPTQ/AWQ checkpoint: the planner names the release's method class (its native one,
            # or the MoeWNA16 fallback); compressed-tensors plans name none
            if p["stage"] is None and p.get("method_class") != v["method_class"]:
                out.append(f"moe {name}: vllm builds {v['method_class']}, planner plans "
                           f"{p.get('method_class') or p['backend']}")
            continue
        if p["stage"] in ("model",):
            out.append(f"moe {name}: vllm builds {v['method_class']} ({v['backend']}), planner refuses: {p['error']}")
            continue
        if v["oracle_ran"] and v["backend"] != p["backend"]:
            out.append(f"moe {name} backend: vllm {v['backend']!r} vs planner {p['backend']!r}")
        if v["oracle_ran"]:
            compared = set(COMPARED_BACKENDS) | set(p["considered"])
            vr = sorted(b for b in v["rejected"] if b in compared)
            pr = sorted(b for b in p["rejected"] if b in compared)
            if vr != pr:
                out.append(f"moe {name} rejected: vllm {vr} vs planner {pr}")
        if v["w2_scale_sharding"] is not None and v["w2_scale_sharding"] != p["w2_scale_sharding"]:
            out.append(f"moe {name} w2_scale_sharding: vllm {v['w2_scale_sharding']} vs planner {p['w2_scale_sharding']}")
        if p["w2_scale_sharding"] is not None and v["w2_scale_shape"] and p["stage"] is None:
            gs = p["group_size"]
            size = p["w2_scale_sharding"][1]
            want = 1 if gs in (-1, None) else -(-size // gs)
            got = v["w2_scale_shape"][1]
            if got != want and v["w2_scale_shape"][2] != want:
                out.append(f"moe {name} w2 scale extent: vllm {v['w2_scale_shape']} vs planner {want} groups")
    v_lin, p_lin = vllm["linear"], plan["linear"]
    for name in sorted(set(v_lin) | set(p_lin)):
        v, p = v_lin.get(name), p_lin.get(name)
        if v is None or p is None:
            out.append(f"quantized linear: {name} only in {'planner' if v is None else 'vllm'}")
            continue
        if (v["kernel"], v["k_p"], v["n_p"]) != (p["kernel"], p["k_p"], p["n_p"]):
            out.append(f"linear {name}: vllm {v['kernel']} ({v['k_p']}, {v['n_p']}) vs planner {p['kernel']} "
                       f"({p['k_p']}, {p['n_p']})")
    return out


# Compiled ops that modules call while they are first imported (the first model built imports
# them): whether the CUTLASS build has fp8 GEMMs for the capability, which only fp8 schemes ask.
IMPORT_TIME_OPS = {"_C.cutlass_scaled_mm_supports_fp8"}


def _renamed(plan: dict[str, Any], name_map: dict[str, str | None]) -> dict[str, Any]:
    """The planner's layers under the model class's own module names."""
    def rename(layers: dict[str, Any]) -> dict[str, Any]:
        return {(name_map.get(k) or k): v for k, v in layers.items()}

    return dict(plan, moe=rename(plan["moe"]), linear=rename(plan["linear"]))


def check(version: str, case: dict[str, Any]) -> tuple[list[str], str | None, dict, dict]:
    """(disagreements, the known cause explaining them or None, vLLM's outcome, the planner's)."""
    plan = planner_outcome(case, version)
    req = {k: case[k] for k in ("ckpt", "tp", "ep", "gpu", "env")}
    req.update(kind="model", load=bool(case.get("load")), ckpt_names=sorted({*plan["moe"], *plan["linear"]}))
    vllm = vllm_release.vllm_outcome(version, req)
    plan = _renamed(plan, vllm.get("name_map") or {})
    diffs = disagreements(vllm, plan, bool(case.get("load"))) + memory_disagreements(vllm, plan)
    ops = sorted(set(vllm.get("ops_called") or ()) - IMPORT_TIME_OPS)
    if ops:
        diffs.append(f"compiled ops called while building: {ops[:5]}")
    known = known_model_cause(version, case, vllm, plan, diffs) if diffs else None
    return diffs, known, vllm, plan


def run(versions: list[str], gpus: list[str], root: Path, sampled: int, seed: int, verbose: bool = True) -> int:
    unexplained_total = 0
    rows = []
    for version in versions:
        try:
            vllm_release.release_sources(version)
        except vllm_release.ReleaseUnavailable:
            print(vllm_release.fetch_hint(version), file=sys.stderr)
            continue
        for gpu in gpus:
            t0 = time.perf_counter()
            counts = {"cases": 0, "agree": 0, "explained": 0, "unexplained": 0, "refused": 0, "loaded": 0,
                      "moe_layers": 0, "linear_layers": 0, "weights_compared": 0, "weights_exact": 0,
                      "kv_layers": 0, "kv_exact": 0}
            causes: dict[str, int] = {}
            for case in model_cases(root, gpu, sampled, seed):
                diffs, known, vllm, plan = check(version, case)
                counts["cases"] += 1
                counts["refused"] += vllm["stage"] is not None
                counts["loaded"] += bool(case.get("load")) and vllm["stage"] is None
                counts["moe_layers"] += len(vllm["moe"])
                counts["linear_layers"] += len(vllm["linear"])
                if vllm["stage"] is None and "weights_bytes" in plan:
                    mem_diffs = memory_disagreements(vllm, plan)
                    counts["weights_compared"] += 1
                    counts["weights_exact"] += not any(d.startswith("weights") for d in mem_diffs)
                    counts["kv_layers"] += len(plan["kv_per_layer"])
                    counts["kv_exact"] += 0 if any(d.startswith("KV") for d in mem_diffs) else len(plan["kv_per_layer"])
                if not diffs:
                    counts["agree"] += 1
                elif known is not None:
                    counts["explained"] += 1
                    causes[known] = causes.get(known, 0) + 1
                else:
                    counts["unexplained"] += 1
                    if verbose:
                        print(f"  UNEXPLAINED vLLM {version} {gpu} {case['name']}: " + "\n    ".join(diffs), flush=True)
            unexplained_total += counts["unexplained"]
            rows.append((version, gpu, counts, causes))
            print(f"== vLLM {version} {gpu}: {counts['cases']} models built ({counts['refused']} refused, "
                  f"{counts['loaded']} through the weight loader; {counts['moe_layers']} MoE layers, "
                  f"{counts['linear_layers']} quantized linear layers; weights per rank exact in "
                  f"{counts['weights_exact']}/{counts['weights_compared']} models, KV bytes per token exact in "
                  f"{counts['kv_exact']}/{counts['kv_layers']} attention layers): {counts['agree']} agree, "
                  f"{counts['explained']} explained {causes or ''}, {counts['unexplained']} unexplained "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        vllm_release.close_worker(version)
    return 1 if unexplained_total else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--releases", default="0.27.1,0.33.0", help="comma list, or all")
    ap.add_argument("--gpus", default=",".join(GPUS))
    ap.add_argument("--sampled", type=int, default=12, help="layer cases drawn from the case space per GPU")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    versions = list(vllm_release.RELEASES) if args.releases == "all" else args.releases.split(",")
    with tempfile.TemporaryDirectory(prefix="wna16ctl-models-") as tmp:
        return run(versions, args.gpus.split(","), Path(tmp), args.sampled, args.seed)


if __name__ == "__main__":
    sys.exit(main())
