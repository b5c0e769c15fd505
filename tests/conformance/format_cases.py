"""GPTQ, AWQ and AutoRound MoE layer cases for the conformance tier: the quantization_config of
published checkpoints and of what AutoRound 0.16.1 writes (header-only facts: their config.json),
and sampled adversarial ones, each at TP 1/2/4/8.

A case carries `quant_method` and the `raw` quantization_config; the worker builds the release's
own config class from `raw` (`_vllm_worker.Release.format_config`), the planner plans a layer whose
scheme is the format's (the reader's contract: sym / not zero_point, desc_act -> actorder group).
"""

from __future__ import annotations

import random
from typing import Any

from wna16ctl.sources.moe import MoELayer
from wna16ctl.sources.scheme import WeightScheme

TPS = (1, 2, 4, 8)

# quantization_config of published checkpoints, with their expert shapes (config.json)
_QWEN_GPTQ = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq",
              "damp_percent": 0.01, "static_groups": False, "true_sequential": True, "checkpoint_format": "gptq"}
_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None}
REAL: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B-GPTQ-Int4: hidden 2048, moe_intermediate_size 768, 128 experts
    "Qwen3-30B-A3B-GPTQ-Int4": {"raw": _QWEN_GPTQ, "hidden_size": 2048, "intermediate_size": 768, "num_experts": 128},
    # Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4: hidden 2048, moe_intermediate_size 1408, 60 experts
    "Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4": {"raw": dict(_QWEN_GPTQ, checkpoint_format=None), "hidden_size": 2048,
                                         "intermediate_size": 1408, "num_experts": 60},
    # cognitivecomputations/DeepSeek-R1-AWQ: hidden 7168, moe_intermediate_size 2048, 256 experts
    "DeepSeek-R1-AWQ": {"raw": dict(_AWQ, modules_to_not_convert=["self_attn.kv_a_proj_with_mqa"]), "hidden_size": 7168,
                        "intermediate_size": 2048, "num_experts": 256},
    # TheBloke/Mixtral_7Bx2_MoE-AWQ: hidden 4096, intermediate_size 14336, 2 experts (w1/w3/w2)
    "Mixtral_7Bx2_MoE-AWQ": {"raw": dict(_AWQ, version="GEMM"), "hidden_size": 4096, "intermediate_size": 14336,
                             "num_experts": 2},
}
# what AutoRound 0.16.1 writes (tests/quantizers: the checkpoints it quantized, config.json as written),
# with a Qwen3-30B-A3B's expert shapes and the group sizes people publish
_AR_EXTRA = {r".*model\.layers\.0\.mlp\.gate.*": {"bits": 16, "data_type": "float"},
             r".*model\.layers\.1\.mlp\.gate.*": {"bits": 16, "data_type": "float"}}
_AR_OWN = {"autoround_version": "0.16.1", "bits": 4, "block_name_to_quantize": "model.layers", "data_type": "int",
           "extra_config": _AR_EXTRA, "group_size": 128, "iters": 8, "packing_format": "auto_round:auto_gptq",
           "quant_method": "auto-round", "sym": True}
_AR_GPTQ = {"autoround_version": "0.16.1", "bits": 4, "damp_percent": 0.01, "data_type": "int", "desc_act": False,
            "dynamic": {r"-:.*model\.layers\.0\.mlp\.gate.*": {}, r"-:.*model\.layers\.1\.mlp\.gate.*": {}},
            "group_size": 128, "iters": 8, "lm_head": False, "provider": "auto-round", "quant_method": "gptq",
            "sym": True, "true_sequential": False}
_AR_AWQ = {"autoround_version": "0.16.1", "bits": 4, "data_type": "int", "group_size": 128, "iters": 8,
           "modules_to_not_convert": ["model.layers.1.mlp.gate", "model.layers.0.mlp.gate", "lm_head"],
           "provider": "auto-round", "quant_method": "awq", "sym": False, "to_quant_block_names": "model.layers",
           "version": "gemm", "zero_point": True}
_QWEN3 = {"hidden_size": 2048, "intermediate_size": 768, "num_experts": 128}
REAL.update({
    "AutoRound auto_round:auto_gptq sym4 g128": {"raw": _AR_OWN, **_QWEN3},
    "AutoRound auto_round:auto_gptq sym4 g32": {"raw": dict(_AR_OWN, group_size=32), **_QWEN3},
    "AutoRound auto_round:auto_awq asym4 g128": {"raw": dict(_AR_OWN, packing_format="auto_round:auto_awq", sym=False),
                                                 **_QWEN3},
    "AutoRound auto_round:auto_gptq sym8 g128": {"raw": dict(_AR_OWN, bits=8), **_QWEN3},
    "AutoRound GPTQ export sym4 g128": {"raw": _AR_GPTQ, **_QWEN3},
    "AutoRound AWQ export asym4 g128": {"raw": _AR_AWQ, **_QWEN3},
})
GPUS = ("sm90", "sm80")
AUTO_ROUND = "auto-round"


def quant_method_of(raw: dict[str, Any]) -> str:
    """The reader's quant_method for the file's (the contract: intel/auto-round is auto-round)."""
    qm = str(raw.get("quant_method", "gptq"))
    return AUTO_ROUND if qm in (AUTO_ROUND, "intel/auto-round") else qm


def case(raw: dict[str, Any], hidden: int, inter: int, experts: int, tp: int, gpu: str = "sm90", ep: bool = False,
         moe_backend: str = "auto") -> dict[str, Any]:
    return {"quant_method": quant_method_of(raw), "raw": dict(raw), "hidden_size": hidden,
            "intermediate_size": inter, "num_experts": experts, "tp": tp, "ep": ep, "gpu": gpu, "env": {},
            "moe_backend": moe_backend, "names": "gate_up_down"}


def real_cases() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{name} TP {tp} {gpu}", case(m["raw"], m["hidden_size"], m["intermediate_size"], m["num_experts"], tp, gpu))
            for name, m in REAL.items() for tp in TPS for gpu in GPUS]


def sample(rng: random.Random) -> dict[str, Any]:
    """An adversarial GPTQ or AWQ layer: act-order, asymmetric, channel-wise, 8-bit, odd sizes,
    dynamic rules, modules_to_not_convert."""
    group = rng.choice([128, 128, 64, 32, -1, 256, 16])
    if rng.random() < 0.5:
        raw: dict[str, Any] = {"quant_method": "gptq", "bits": rng.choice([4, 4, 8, 3, 2]), "group_size": group,
                               "desc_act": rng.random() < 0.3, "sym": rng.random() < 0.85}
        if rng.random() < 0.2:
            raw["dynamic"] = {rng.choice([r"+:.*\.mlp\.experts.*", r"+:.*layers\.1\..*"]): rng.choice(
                [{"bits": 8}, {"group_size": 64}, {"desc_act": True}]),
                **({r"-:.*\.mlp\.experts.*": {}} if rng.random() < 0.3 else {})}
    else:
        raw = {"quant_method": "awq", "bits": rng.choice([4, 4, 4, 8]), "group_size": group,
               "zero_point": rng.random() < 0.85, "version": "gemm",
               "modules_to_not_convert": rng.choice([None, ["mlp.experts"], ["self_attn"]])}
    return _shaped(rng, raw)


def _shaped(rng: random.Random, raw: dict[str, Any]) -> dict[str, Any]:
    hidden = rng.choice([2048, 4096, 7168, 2880, 1536, 5120, 2000])
    inter = rng.choice([768, 1408, 2048, 1536, 512, 320, 2880, 96, 1000])
    return case(raw, hidden, inter, rng.choice([8, 60, 128]), rng.choice(TPS), rng.choice(["sm90", "sm80", "sm100", "sm75"]),
                rng.random() < 0.1, rng.choice(["auto"] * 8 + ["marlin", "triton"]))


def sample_auto_round_case(rng: random.Random) -> dict[str, Any]:
    return _shaped(rng, sample_auto_round(rng, rng.choice([128, 128, 64, 32, -1, 256, 16])))


def sample_auto_round(rng: random.Random, group: int) -> dict[str, Any]:
    """An adversarial auto-round config: bit widths the releases route differently, asymmetric, the
    packing formats and backends INCConfig knows (and some it refuses), extra_config entries that
    reach the experts layer (exact, regex, suffix), block names that leave it out."""
    raw: dict[str, Any] = dict(_AR_OWN, bits=rng.choice([4, 4, 8, 8, 2, 3, 5, 6]), group_size=group,
                               sym=rng.random() < 0.7,
                               packing_format=rng.choices(list(_PACKINGS), list(_PACKINGS.values()))[0],
                               backend=rng.choice(["auto"] * 6 + ["marlin", "gptq", "awq", "gptq:marlin", "exllama"]))
    extra = dict(_AR_EXTRA)
    pick = rng.random()
    if pick < 0.1:
        extra["model.layers.0.mlp.experts"] = {"bits": 16}
    elif pick < 0.25:
        extra[r".*mlp\.experts.*"] = rng.choice([{"bits": 8}, {"group_size": 64}, {"sym": False}, {"bits": 4}])
    elif pick < 0.3:
        extra["mlp.experts"] = {"bits": 8, "group_size": -1}  # a short name: the suffix match
    raw["extra_config"] = extra
    if rng.random() < 0.1:
        raw["block_name_to_quantize"] = rng.choice(["model.layers.1", "model.embed"])
    if rng.random() < 0.1:
        raw.pop("sym")
    if rng.random() < 0.05:
        raw["quant_method"] = "intel/auto-round"
    return raw


_PACKINGS = {"auto_round:auto_gptq": 5, "auto_round:auto_awq": 4, "auto_round:llm_compressor": 1, None: 1,
             "auto_round:fp8": 1}


def scheme_of(raw: dict[str, Any]) -> WeightScheme:
    """The format-free scheme the reader gives the experts (the contract), base config only."""
    group = raw["group_size"]
    if quant_method_of(raw) == AUTO_ROUND:
        awq_packed = "awq" in str(raw.get("packing_format"))
        return WeightScheme(num_bits=raw["bits"], group_size=group, symmetric=raw.get("sym", True),
                            strategy="group" if group != -1 else "channel", actorder=None,
                            format="awq" if awq_packed else "gptq")
    if raw["quant_method"] == "gptq":
        sym, act = raw["sym"], "group" if raw.get("desc_act") and group != -1 else None
    else:
        sym, act = not raw["zero_point"], None
    return WeightScheme(num_bits=raw["bits"], group_size=group, symmetric=sym, strategy="group" if group != -1 else "channel",
                        actorder=act, format="gptq" if raw["quant_method"] == "gptq" else "awq")


def layer_of(case: dict[str, Any]) -> MoELayer:
    s = scheme_of(case["raw"])
    E = case["num_experts"]
    return MoELayer(prefix="model.layers.0.mlp.experts", layer_index=0, family="gate_up_down", num_experts=E,
                    hidden_size=case["hidden_size"], intermediate_size=case["intermediate_size"], scheme=s,
                    scale_dtype="F16", scheme_sets={(s, s, s): list(range(E))},
                    quant_method=case["quant_method"], quant_raw=dict(case["raw"]))
