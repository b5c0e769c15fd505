"""Cases for the linear planner's kernel choice against each release's `choose_mp_linear_kernel`.

For a per-rank linear shape, scheme, GPU and environment, the release's own kernel list and each
kernel's `can_implement` run in the conformance worker (`linear_outcome`); the planner walks its
`kernel_priority` with `kernel_reason` (what `plan_linear` does).  The test is in
test_vllm_conformance.py, which shares each release's worker.
"""

from __future__ import annotations

import random
from typing import Any

from tests.conformance import vllm_release
from wna16ctl.planning import rules
from wna16ctl.planning.engine_env import make_switches
from wna16ctl.planning.linear import (KernelConfig, kernel_priority, kernel_reason, linear_has_g_idx,
                                      linear_scheme_error, weight_type)
from wna16ctl.sources.config import WeightScheme

GPUS = ["sm75", "sm80", "sm86", "sm89", "sm90", "sm90", "sm100", "sm120"]
ENVS: list[dict[str, str]] = [{}, {}, {}, {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"},
                              {"VLLM_DISABLED_KERNELS": "MarlinLinearKernel,MacheteLinearKernel"}]


def sample(rng: random.Random) -> dict[str, Any]:
    k = rng.choice([512, 1024, 2048, 2880, 4096, 7168, 96 * rng.randint(1, 64), 16 * rng.randint(1, 300)])
    n = rng.choice([512, 1024, 2048, 4096, 5120, 64 * rng.randint(1, 128), 8 * rng.randint(1, 600)])
    tp = rng.choice([1, 2, 4, 8])
    row = rng.random() < 0.5  # row-parallel splits K, column-parallel N
    k_p, n_p = (k // tp, n) if row else (k, n // tp)
    bits = rng.choice([4, 4, 8, 8, 2, 3, 5, 6, 7])
    gs = rng.choice([-1, 32, 64, 128, 128])
    # the weights' actorder, handed to the release's own linear scheme (which decides has_g_idx)
    actorder = rng.choice([None, None, None, "weight", "static", "group", "dynamic"]) if gs > 0 else None
    return {"kind": "linear", "k": k, "n": n, "k_p": max(k_p, 1), "n_p": max(n_p, 1), "num_bits": bits,
            "symmetric": rng.random() < 0.7, "group_size": gs, "actorder": actorder,
            "act_type": rng.choice(["bfloat16", "bfloat16", "float16"]), "gpu": rng.choice(GPUS),
            "env": rng.choice(ENVS)}


def _scheme(case: dict[str, Any]) -> WeightScheme:
    gs = case["group_size"]
    return WeightScheme(num_bits=case["num_bits"], group_size=gs, symmetric=case["symmetric"],
                        strategy="group" if gs > 0 else "channel", actorder=case.get("actorder"),
                        format="pack-quantized")


def planner_kernel(version: str, case: dict[str, Any]) -> str | None:
    """The kernel the linear planner picks, or "scheme ValueError" where it says the release cannot
    build the layer's scheme."""
    rel = rules.release(version)
    sw = make_switches(case["env"])
    disabled = sw.names("VLLM_DISABLED_KERNELS", version)
    s = _scheme(case)
    if linear_scheme_error(s, rel) is not None:
        return "scheme ValueError"
    c = KernelConfig(k=case["k"], n=case["n"], k_p=case["k_p"], n_p=case["n_p"], weight_type=weight_type(s),
                     bits=case["num_bits"], act_type=case["act_type"], group_size=case["group_size"],
                     zero_points=not case["symmetric"], has_g_idx=linear_has_g_idx(s))
    for kern in kernel_priority(rel, case["gpu"]):
        if kern not in disabled and kernel_reason(kern, rel, case["gpu"], c) is None:
            return kern
    return None


def linear_disagreement(version: str, case: dict[str, Any]) -> str | None:
    if case.get("actorder") in ("group", "dynamic") and rules.release(version).has("config.refuse_group_actorder"):
        return None  # the release refuses the whole checkpoint at config parse (compared in the MoE cases)
    got = vllm_release.vllm_outcome(version, case)
    assert not got["ops_called"], f"compiled ops called while choosing: {got['ops_called']}"
    mine = planner_kernel(version, case)
    if (got["error"] or "").startswith("scheme ValueError") and mine == "scheme ValueError":
        return None
    if got["kernel"] != mine:
        return f"vLLM {version}: {got['kernel'] or got['error']!r}, planner {mine!r} for {case}"
    return None



# -- GPTQ / AWQ / auto-round linear layers: the release's own layer class and format config ------
# (`_vllm_worker.Release.format_linear_outcome`) against `plan_linear`'s format steps
def _checkpoint_tensors(router_in_layer0: bool) -> dict[str, str]:
    """A Qwen3-MoE-like checkpoint's tensors (name -> dtype) around the layers the cases build:
    layer 0 with a dense MLP, attention quantized, the router of layer 1 (or of layer 0) in float."""
    t: dict[str, str] = {}
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
              "mlp.shared_expert.down_proj"):
        for layer in (0, 1):
            t[f"model.layers.{layer}.{m}.qweight"] = t[f"model.layers.{layer}.{m}.qzeros"] = "I32"
            t[f"model.layers.{layer}.{m}.scales"] = "F16"
    t[f"model.layers.{0 if router_in_layer0 else 1}.mlp.gate.weight"] = "BF16"
    t.update({"model.layers.0.input_layernorm.weight": "BF16", "lm_head.weight": "BF16",
              "model.embed_tokens.weight": "BF16"})
    return t


# (role, K, output sizes, prefix, extra): the layers of a Qwen3-MoE-like model with a dense layer 0
_LAYERS: list[tuple[str, int, list[int], str, dict[str, Any]]] = [
    ("row", 4096, [2048], "model.layers.1.self_attn.o_proj", {}),
    ("qkv", 2048, [], "model.layers.1.self_attn.qkv_proj", {"head_dim": 128, "num_heads": 32, "num_kv_heads": 4}),
    ("col", 2048, [768, 768], "model.layers.0.mlp.gate_up_proj", {}),
    ("row", 768, [2048], "model.layers.0.mlp.down_proj", {}),
    ("row", 2560, [2048], "model.layers.1.mlp.shared_expert.down_proj", {}),
    ("col", 2048, [2560, 2560], "model.layers.1.mlp.shared_expert.gate_up_proj", {}),
    ("lm_head", 2048, [151936], "lm_head", {}),
]


def format_case(raw: dict[str, Any], layer: tuple[str, int, list[int], str, dict[str, Any]], tp: int, gpu: str,
                router_in_layer0: bool = False, act_type: str = "bfloat16") -> dict[str, Any]:
    from tests.conformance import format_cases

    role, k, sizes, prefix, extra = layer
    tensors = _checkpoint_tensors(router_in_layer0)
    if raw.get("lm_head"):  # a checkpoint that says its head is quantized stores it packed
        del tensors["lm_head.weight"]
        tensors.update({"lm_head.qweight": "I32", "lm_head.qzeros": "I32", "lm_head.scales": "F16"})
    return {"kind": "format_linear", "quant_method": format_cases.quant_method_of(raw), "raw": dict(raw),
            "role": role, "k": k, "output_sizes": list(sizes), "tp": tp, "prefix": prefix, "gpu": gpu,
            "act_type": act_type, "checkpoint_tensors": tensors, "env": {}, **extra}


def real_format_cases() -> list[tuple[str, dict[str, Any]]]:
    """The published GPTQ/AWQ configs and AutoRound's own, each layer at TP 1/2/4/8 on sm90 and sm80,
    with lm_head quantized where the config says so (and once more with lm_head: true)."""
    from tests.conformance import format_cases

    out = []
    for name, m in format_cases.REAL.items():
        for tp in (1, 2, 4, 8):
            for gpu in ("sm90", "sm80"):
                for lay in _LAYERS:
                    out.append((f"{name} {lay[3]} TP {tp} {gpu}", format_case(m["raw"], lay, tp, gpu)))
        out.append((f"{name} lm_head flag TP 2", format_case(dict(m["raw"], lm_head=True), _LAYERS[-1], 2, "sm90")))
        out.append((f"{name} router in layer 0", format_case(m["raw"], _LAYERS[2], 1, "sm90", router_in_layer0=True)))
    return out


def sample_format(rng: random.Random) -> dict[str, Any]:
    """An adversarial GPTQ/AWQ/auto-round config (format_cases' samplers) on a sampled layer shape."""
    from tests.conformance import format_cases

    pick = rng.random()
    raw = (format_cases.sample_auto_round(rng, rng.choice([128, 128, 64, 32, -1, 256])) if pick < 0.3
           else format_cases.sample(rng)["raw"])
    if rng.random() < 0.2:
        raw["lm_head"] = True
    if rng.random() < 0.15 and raw.get("quant_method") == "gptq":
        raw["modules_in_block_to_quantize"] = [rng.choice([["self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj"], ["mlp.down_proj"], ["self_attn.q_proj"]])]
    role, k, sizes, prefix, extra = rng.choice(_LAYERS)
    if role in ("row", "col") and rng.random() < 0.5:
        k = rng.choice([768, 1408, 2880, 1536, 96 * rng.randint(1, 40), 2000])
        if role == "col":
            inter = rng.choice([768, 1408, 2880, 1000, 320, 64 * rng.randint(1, 40)])
            sizes = [inter, inter]
    return format_case(raw, (role, k, sizes, prefix, extra), rng.choice([1, 2, 4, 8]),
                       rng.choice(["sm90", "sm90", "sm80", "sm75", "sm100"]), rng.random() < 0.2,
                       rng.choice(["bfloat16", "bfloat16", "float16"]))


def format_layer(case: dict[str, Any]):
    """The LinearLayer wna16ctl's reader makes of the case's layer (model.py's placing and fusing)."""
    from wna16ctl.planning.methods.base import shard_prefixes
    from wna16ctl.sources.model import (COLUMN, QKV, ROW, VOCAB, LinearLayer, LinearShard, inner_modules,
                                        module_integer_flags)

    prefix, role = case["prefix"], case["role"]
    tensors = case["checkpoint_tensors"]
    if role == "qkv":
        hd, kv = case["head_dim"], case["num_kv_heads"]
        sizes: list[tuple[int, ...]] = [(case["num_heads"] * hd,), (kv * hd,), (kv * hd,)]
    else:
        sizes = [(n,) for n in case["output_sizes"]]
    modules = shard_prefixes(prefix) or [prefix]
    shards = [LinearShard(m, sz, None, stored_packed=f"{m}.qweight" in tensors) for m, sz in zip(modules, sizes)]
    lay = LinearLayer(name=prefix, kind="lm_head" if role == "lm_head" else prefix.split(".", 3)[-1], layer_index=None,
                      tp_role={"row": ROW, "col": COLUMN, "qkv": QKV, "lm_head": VOCAB}[role], input_size=case["k"],
                      shards=shards, head_dim=case.get("head_dim"), num_heads=case.get("num_heads"),
                      num_kv_heads=case.get("num_kv_heads"), quant_method=case["quant_method"], quant_raw=case["raw"])
    if role == "lm_head":  # inspect plans the head where it is stored packed
        lay.shards = [LinearShard(prefix, sizes[0], None, stored_packed=True)]
    lay.inner_modules = inner_modules(module_integer_flags(tensors.items()), [prefix, *modules])
    return lay


def format_linear_disagreement(version: str, name: str, case: dict[str, Any]) -> str | None:
    from wna16ctl.planning.engine_env import make_switches
    from wna16ctl.planning.linear import plan_linear

    plan = plan_linear(format_layer(case), case["tp"], version, case["gpu"], case["act_type"],
                       make_switches(case["env"]))
    got = vllm_release.vllm_outcome(version, case)
    if plan.failure_rule == "humming method" and "humming" in (str(got.get("traceback")) + str(got["error"])
                                                                + str(got["method"])).lower():
        return None  # INC's Humming linear method: its constructor reads the compiled library (stand-ins)
    assert not got.get("ops_called"), f"compiled ops called while building: {got['ops_called']}"
    why = _format_diff(plan, got, case)
    return None if why is None else f"{name}: vLLM {version} {why}\n  case {case}\n  vllm {got}\n  plan {plan.to_json()}"


def _unordered(text: str) -> str:
    """A message with each printed set's items sorted (a set of strings prints in hash order)."""
    import re

    return re.sub(r"\{('[^']*'(?:, '[^']*')*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)


def _format_diff(plan: Any, got: dict[str, Any], case: dict[str, Any]) -> str | None:
    from wna16ctl.planning.linear import AWQ_GEMM

    stage, error = plan.failure_stage, _unordered((plan.errors or [""])[0])
    if stage in ("config", "create_weights"):
        theirs = _unordered(str(got["error"]))
        typed = f"{got.get('error_type')}: {theirs}"
        same = got["error"] and (error == theirs or error.splitlines()[0] == theirs.splitlines()[0]
                                 or error.startswith(typed))
        return None if got["stage"] == stage and same else f"{got['stage']}: {got['error']!r}, planner {stage}: {error!r}"
    if got["stage"] is not None:
        return f"fails at {got['stage']}: {got['error']!r}, planner {stage or 'builds'}: {error!r}"
    if got["method"] != plan.method:
        return f"builds {got['method']}, planner {plan.method}"
    if stage == "load" and plan.failure_rule == "wrong scale groups":
        rows = (got["params"].get("scales") or [None])[0]
        floored = f"makes {rows} scale row(s)" in error  # the planner's count of rows, K/rank not a multiple
        return None if got["kernel"] == plan.kernel and floored else f"scales {got['params'].get('scales')}, kernel {got['kernel']}"
    if stage == "load":
        return None  # built as the planner says (unquantized / quantized); the tensors then do not fit
    kernel = None if plan.kernel == AWQ_GEMM else plan.kernel
    return None if got["kernel"] == kernel else f"kernel {got['kernel']}, planner {plan.kernel}"
