"""Checkpoints written by AutoRound 0.16.1 and GPTQModel 7.7.0 themselves (tests/quantizers/conftest.py),
and the reference dequantization of each through the tool's own code (reference.py).

What the tools write for a Qwen3-MoE (hidden K=128, moe_intermediate I=96, 4 experts, group 32),
as these tests check it:

- Experts are stored one by one, `model.layers.L.mlp.experts.E.{gate,up,down}_proj.<suffix>`, and the
  attention projections are quantized the same way; the router `mlp.gate` and `lm_head` are not
  (AutoRound lists them: GPTQ `dynamic` "-:" rules, AWQ `modules_to_not_convert`, auto-round
  `extra_config` bits 16).  Unquantized tensors are bfloat16 (the float model was float16), scales
  float16, every packed tensor int32.
- GPTQ (`quant_method: gptq`), both tools, for a projection [N out, K in], b bits, pf = 32/b:
  qweight [K/pf, N] packed along K (low bits first), qzeros [K/g, N/pf] packed along N, scales
  [K/g, N], g_idx [K] int32 always stored (also without act-order, then k // g).
  - AutoRound: no `checkpoint_format` key (v1), `desc_act: false`, `sym`, `provider: auto-round`.
    Symmetric qzeros are stored: every field 2^(b-1) - 1 (v1 keeps zero - 1).
  - GPTQModel: `checkpoint_format` and `format` "gptq" (v1, zero - 1 stored) or "gptq_v2" (the zero
    itself); `desc_act: true` writes g_idx as a permutation of whole groups (each group index K/g
    times, not in column order); `pack_dtype: int32`; `meta.quantizer: ["gptqmodel:7.7.0"]`; it
    writes quantize_config.json beside config.json, the same keys.
- AWQ (`quant_method: awq`, AutoRound): `version: gemm`, `zero_point: true` (asymmetric), `bits`,
  `group_size`; qweight [K, N/8] and qzeros [K/g, N/8] packed along N in AWQ's interleaved order
  (fields 0,2,4,6,1,3,5,7 of each word), scales [K/g, N]; no g_idx.  Zero points are the zero
  itself.
- AutoRound's own (`quant_method: auto-round`, `packing_format: auto_round:auto_gptq`): the
  tensors of GPTQ v1 (qzeros zero - 1, symmetric ones stored) without g_idx.

The reference is float32 (q - z) * s [N, K] per quantized module, computed by the tools' code.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.quantizers.conftest import Quantized
from tests.quantizers.write_checkpoints import MODEL, VARIANTS

K = MODEL["hidden_size"]
I = MODEL["moe_intermediate_size"]
EXPERTS = MODEL["num_experts"]
LAYERS = MODEL["num_hidden_layers"]
SHAPES = {"gate_proj": (I, K), "up_proj": (I, K), "down_proj": (K, I)}  # [N, K]

# the quantization_config each variant's writer puts in config.json (the keys the readers follow)
EXPECTED_CONFIG = {
    "autoround-gptq-sym4": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                            "provider": "auto-round", "checkpoint_format": None},
    "autoround-awq-asym4": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                            "version": "gemm", "provider": "auto-round"},
    "autoround-own-sym4": {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": True,
                           "packing_format": "auto_round:auto_gptq", "data_type": "int"},
    "gptqmodel-gptq-actorder-sym4": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                     "desc_act": True, "checkpoint_format": "gptq", "pack_dtype": "int32"},
    "gptqmodel-gptqv2-asym8": {"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": False,
                               "desc_act": False, "checkpoint_format": "gptq_v2", "pack_dtype": "int32"},
}
# the stored form of each variant's tensors
STORED = {"autoround-gptq-sym4": "gptq", "autoround-awq-asym4": "awq", "autoround-own-sym4": "auto-round",
          "gptqmodel-gptq-actorder-sym4": "gptq", "gptqmodel-gptqv2-asym8": "gptq_v2"}


def _qc(quantized: Quantized, variant: str) -> dict:
    return json.loads((quantized.checkpoint(variant) / "config.json").read_text())["quantization_config"]


def _tensors(quantized: Quantized, variant: str) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(quantized.checkpoint(variant).glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _projections():
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for proj, shape in SHAPES.items():
                yield f"model.layers.{layer}.mlp.experts.{expert}.{proj}", shape


def test_every_variant_is_written(quantized):
    assert STORED.keys() == EXPECTED_CONFIG.keys() == VARIANTS.keys()
    for variant in VARIANTS:
        assert (quantized.checkpoint(variant) / "config.json").is_file(), variant
        assert quantized.reference(variant).is_file(), variant


@pytest.mark.parametrize("variant", list(EXPECTED_CONFIG))
def test_the_config_keys_each_tool_writes(quantized, variant):
    qc = _qc(quantized, variant)
    for key, value in EXPECTED_CONFIG[variant].items():
        assert qc.get(key) == value, (variant, key, qc.get(key))
    if variant.startswith("gptqmodel"):
        side = json.loads((quantized.checkpoint(variant) / "quantize_config.json").read_text())
        assert {k: side[k] for k in ("bits", "group_size", "sym", "desc_act", "checkpoint_format")} == \
               {k: qc[k] for k in ("bits", "group_size", "sym", "desc_act", "checkpoint_format")}
        assert qc["meta"]["quantizer"] == ["gptqmodel:7.7.0"]
    if variant == "autoround-awq-asym4":
        assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= set(qc["modules_to_not_convert"])


def _expected_shapes(stored: str, n: int, k: int, bits: int, group: int) -> dict[str, tuple[int, ...]]:
    pf = 32 // bits
    if stored == "awq":
        return {"qweight": (k, n // pf), "qzeros": (k // group, n // pf), "scales": (k // group, n)}
    shapes = {"qweight": (k // pf, n), "qzeros": (k // group, n // pf), "scales": (k // group, n)}
    if stored != "auto-round":
        shapes["g_idx"] = (k,)
    return shapes


@pytest.mark.parametrize("variant", list(STORED))
def test_expert_tensors_names_shapes_and_dtypes(quantized, variant):
    qc = _qc(quantized, variant)
    tensors = _tensors(quantized, variant)
    dtypes = {"qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16, "g_idx": torch.int32}
    for module, (n, k) in _projections():
        expected = _expected_shapes(STORED[variant], n, k, qc["bits"], qc["group_size"])
        stored = {name.rpartition(".")[2]: t for name, t in tensors.items() if name.rpartition(".")[0] == module}
        assert {s: tuple(t.shape) for s, t in stored.items()} == expected, module
        assert all(t.dtype == dtypes[s] for s, t in stored.items()), module
    for layer in range(LAYERS):
        assert tensors[f"model.layers.{layer}.mlp.gate.weight"].shape == (EXPERTS, K)  # the router stays float
        assert f"model.layers.{layer}.self_attn.q_proj.qweight" in tensors
    assert "lm_head.weight" in tensors
    assert not any(".experts.gate_up_proj" in name or ".experts.down_proj" in name for name in tensors)


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The b-bit fields of int32 words along the last dim, low bits first (no reordering)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return ((packed.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


@pytest.mark.parametrize("variant", ["autoround-gptq-sym4", "autoround-own-sym4", "gptqmodel-gptq-actorder-sym4"])
def test_symmetric_v1_stores_the_midpoint_minus_one(quantized, variant):
    tensors = _tensors(quantized, variant)
    for module, _ in _projections():
        assert bool((_fields(tensors[module + ".qzeros"], 4) == 7).all()), module


def test_asymmetric_zero_points_vary(quantized):
    for variant, bits in (("autoround-awq-asym4", 4), ("gptqmodel-gptqv2-asym8", 8)):
        tensors = _tensors(quantized, variant)
        zeros = torch.cat([_fields(tensors[m + ".qzeros"], bits).flatten() for m, _ in _projections()])
        assert len(zeros.unique()) > 4, variant


def test_act_order_g_idx_is_a_permutation_of_whole_groups(quantized):
    tensors = _tensors(quantized, "gptqmodel-gptq-actorder-sym4")
    in_order = 0
    for module, (_, k) in _projections():
        g_idx = tensors[module + ".g_idx"].long()
        assert torch.bincount(g_idx).tolist() == [32] * (k // 32), module
        in_order += bool((g_idx == torch.arange(k) // 32).all())
    assert in_order == 0
    plain = _tensors(quantized, "gptqmodel-gptqv2-asym8")
    for module, (_, k) in _projections():
        assert bool((plain[module + ".g_idx"] == torch.arange(k, dtype=torch.int32) // 32).all()), module


def _another_expert(module: str) -> str:
    """The same projection of the next expert."""
    head, _, tail = module.partition(".experts.")
    expert, _, proj = tail.partition(".")
    return f"{head}.experts.{(int(expert) + 1) % EXPERTS}.{proj}"


def _reference(quantized: Quantized, variant: str) -> dict[str, torch.Tensor]:
    return load_file(str(quantized.reference(variant)))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_reference_is_the_quantized_float_model(quantized, variant):
    """Not vacuous: each expert's reference is its own float weight within the quantization error
    (and far from another expert's, so neither a random init nor a mix-up passes), and lies on its
    group's grid: (q - z) = w / s is an integer within the bit width, q - z taken from the stored
    scales alone (no unpacking of the codes here)."""
    qc = _qc(quantized, variant)
    bits, group = qc["bits"], qc["group_size"]
    ref = _reference(quantized, variant)
    tensors = _tensors(quantized, variant)
    tolerance = {4: 0.2, 8: 0.02}[bits]
    with safe_open(str(quantized.float_model / "model.safetensors"), "pt") as f:
        for module, (n, k) in _projections():
            w = ref[module + ".weight"]
            assert w.dtype == torch.float32 and tuple(w.shape) == (n, k), module
            original = f.get_tensor(module + ".weight").float()
            other = f.get_tensor(_another_expert(module) + ".weight").float()
            assert float((w - original).norm() / original.norm()) < tolerance, module
            assert float((w - other).norm() / other.norm()) > 1.0, module
            g_idx = tensors[module + ".g_idx"].long() if module + ".g_idx" in tensors else torch.arange(k) // group
            steps = w / tensors[module + ".scales"].float().t()[:, g_idx]
            assert bool((steps == steps.round()).all()), module
            assert float(steps.abs().max()) <= 2 ** bits - 1, module


def test_two_readers_agree_on_one_quantization(quantized):
    """AutoRound exported the same tuned weights as GPTQ (read by GPTQModel's dequantizer) and in its
    own format (read by AutoRound's QuantLinear): the two references are equal bit for bit."""
    gptq, own = _reference(quantized, "autoround-gptq-sym4"), _reference(quantized, "autoround-own-sym4")
    assert gptq.keys() == own.keys() and len(gptq) == LAYERS * (EXPERTS * 3 + 4)
    for name in gptq:
        assert torch.equal(gptq[name], own[name]), name
