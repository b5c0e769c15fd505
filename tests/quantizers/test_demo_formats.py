"""`wna16ctl demo --format gptq|awq` writes what GPTQModel and AutoAWQ/AutoRound write.

The demo quantizes as it does for compressed-tensors and stores the result through the format's
`stored_form`.  Each checkpoint here is read twice: by the tools' own dequantization (reference.py
in the quantizer venv: GPTQModel's `convert_gptq_file`, AutoRound's `dequantize_gemm`) and by the
package (`TensorReader.read_expert`, the canonical form, dequantized in float32); the two agree bit
for bit.  Its config keys and its tensors' names and dtypes are those of the checkpoints the real
tools wrote (conftest.py's `quantized`), and the scales are those the library's quantization
computed (the codes lie on the grid of the source weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.quantizers.conftest import Quantized, run_reference
from tests.quantizers.test_package_reads_them import _dequantized
from wna16ctl.demo import DemoSpec, demo_source_weights, write_demo_checkpoint

SMALL = dict(hidden_size=128, intermediate_size=128, num_experts=4, vocab_size=320, group_size=32)
# demo variant -> (spec, the real tools' checkpoints of the same format)
VARIANTS = {
    "gptq-actorder-sym4": (DemoSpec(format="gptq", actorder="group", **SMALL),
                           ("gptqmodel-gptq-actorder-sym4", "autoround-gptq-sym4")),
    "gptq-asym4-linear": (DemoSpec(format="gptq", symmetric=False, targets="linear", **SMALL),
                          ("gptqmodel-gptq-actorder-sym4", "autoround-gptq-sym4")),
    "awq-asym4": (DemoSpec(format="awq", symmetric=False, **SMALL), ("autoround-awq-asym4",)),
    "awq-sym4-linear": (DemoSpec(format="awq", targets="linear", **SMALL), ("autoround-awq-asym4",)),
}


@pytest.fixture(scope="module")
def demos(tmp_path_factory, quantizer_python) -> Path:
    """Each variant's demo checkpoint and its reference (`<variant>.reference.safetensors`)."""
    root = tmp_path_factory.mktemp("demo-formats")
    for name, (spec, _) in VARIANTS.items():
        write_demo_checkpoint(root / name, spec)
        run_reference(quantizer_python, root / name, root / f"{name}.reference.safetensors")
    return root


def _qc(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())["quantization_config"]


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _stored(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.dtype]]:
    """module -> {suffix: dtype} of every module stored with a qweight."""
    modules: dict[str, dict[str, torch.dtype]] = {}
    for name, tensor in tensors.items():
        module, _, suffix = name.rpartition(".")
        modules.setdefault(module, {})[suffix] = tensor.dtype
    return {m: s for m, s in modules.items() if "qweight" in s}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_tools_reference_equals_the_package_read(demos, variant):
    """Every quantized module's reference is the tool's dequantization; every expert the package
    reads dequantizes to it exactly, and the reference lies within the quantization error of the
    demo's source weights (not a random or mixed-up tensor)."""
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader

    spec, _ = VARIANTS[variant]
    reference = load_file(str(demos / f"{variant}.reference.safetensors"))
    stored = _stored(_tensors(demos / variant))
    assert set(reference) == {m + ".weight" for m in stored}
    source = demo_source_weights(spec)
    for name, weight in reference.items():
        error = float((weight - source[name].float()).norm() / source[name].float().norm())
        assert error < 0.2, (name, error)
    ckpt = open_checkpoint(demos / variant)
    compared = 0
    with TensorReader(ckpt.files) as reader:
        for layer in ckpt.layers:
            for expert in range(layer.num_experts):
                for role, canonical in reader.read_expert(layer, expert).items():
                    module = layer.tensor_name(expert, role, "weight")
                    want = reference[module]
                    assert torch.equal(_dequantized(canonical, layer.scheme, *want.shape), want), module
                    compared += 1
    assert compared == spec.num_layers * spec.num_experts * 3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_keys_and_tensors_are_the_tools(demos, quantized: Quantized, variant):
    """The demo's quantization_config keys are keys the tools write, with values of the same type;
    its quantized modules store the tensors (names and dtypes) the tools store for theirs."""
    spec, tools = VARIANTS[variant]
    qc = _qc(demos / variant)
    written = {key: value for tool in tools for key, value in _qc(quantized.checkpoint(tool)).items()}
    assert set(qc) <= set(written), set(qc) - set(written)
    for key, value in qc.items():
        assert type(value) is type(written[key]), key
    for key in ("quant_method", "bits", "version", "checkpoint_format", "format", "pack_dtype", "method"):
        if key in qc:
            assert qc[key] == written[key], key
    assert qc["group_size"] == spec.group_size
    if spec.format == "gptq":
        assert qc["desc_act"] == (spec.actorder == "group") and qc["sym"] == spec.symmetric
        assert json.loads((demos / variant / "quantize_config.json").read_text()) == qc
    else:
        assert qc["zero_point"] == (not spec.symmetric) and "lm_head" in qc["modules_to_not_convert"]
    theirs = {frozenset(s.items()) for s in _stored(_tensors(quantized.checkpoint(tools[0]))).values()}
    ours = {frozenset(s.items()) for s in _stored(_tensors(demos / variant)).values()}
    assert len(theirs) == 1 and ours == theirs


def test_only_the_modules_the_config_quantizes_are_quantized(demos):
    """targets experts: attention and routers stay float and the config skips them (a GPTQ negative
    dynamic rule, an AWQ modules_to_not_convert entry), each attention block as a whole; targets
    linear: only the routers are skipped."""
    experts_only, linear = _tensors(demos / "gptq-actorder-sym4"), _tensors(demos / "gptq-asym4-linear")
    for layer in range(2):
        attention = f"model.layers.{layer}.self_attn.q_proj"
        assert attention + ".weight" in experts_only and attention + ".qweight" in linear
        assert f"model.layers.{layer}.mlp.gate.weight" in experts_only and f"model.layers.{layer}.mlp.gate.weight" in linear
    assert set(_qc(demos / "gptq-actorder-sym4")["dynamic"]) == {
        rf"-:model\.layers\.{i}\.{m}" for i in range(2) for m in (r"self_attn\.", r"mlp\.gate$")}
    assert set(_qc(demos / "gptq-asym4-linear")["dynamic"]) == {rf"-:model\.layers\.{i}\.mlp\.gate$" for i in range(2)}
    assert _qc(demos / "awq-asym4")["modules_to_not_convert"] == [
        "model.layers.0.self_attn", "model.layers.0.mlp.gate", "model.layers.1.self_attn", "model.layers.1.mlp.gate",
        "lm_head"]
