"""wna16ctl reads the checkpoints AutoRound and GPTQModel write exactly: each expert projection the
package reads (`TensorReader.read_expert`: the format's canonical form) and dequantizes in float32
(`layout.packing.dequantize`) equals the tool's own dequantization (reference.py) bit for bit.

A format the package does not read yet (`sources.formats.FORMATS` without its quant_method) is
skipped with one line that says so.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.quantizers.test_real_checkpoints import LAYERS
from tests.quantizers.write_checkpoints import VARIANTS

ROLES = ("gate", "up", "down")
QUANT_METHOD = {"autoround-gptq-sym4": "gptq", "gptqmodel-gptq-actorder-sym4": "gptq", "gptqmodel-gptqv2-asym8": "gptq",
                "autoround-awq-asym4": "awq", "autoround-own-sym4": "auto-round"}


def _needs_format(method: str) -> None:
    formats = pytest.importorskip("wna16ctl.sources.formats")
    if method not in formats.FORMATS:
        pytest.skip(f"wna16ctl does not read {method} checkpoints yet (sources.formats.FORMATS has no {method!r})")


def _dequantized(canonical: dict, scheme, n: int, k: int) -> torch.Tensor:
    """float32 [N, K] of one projection's canonical form (layout.spec): codes [N, K/pf] packed
    along K, scales [N, G], zero points [ceil(N/pf), G] packed along N (asymmetric only), g_idx [K]
    (act-order only)."""
    from wna16ctl.layout.packing import dequantize, unpack_codes
    from wna16ctl.layout.spec import CODES, G_IDX, SCALES, ZERO_POINTS

    bits = scheme.num_bits
    codes = unpack_codes(canonical[CODES], bits, dim=1, size=k)
    if G_IDX in canonical:
        groups = canonical[G_IDX].long()
    else:
        group = k if scheme.group_size in (None, -1) else scheme.group_size
        groups = torch.arange(k) // group
    zero_points = None
    if canonical.get(ZERO_POINTS) is not None:
        zero_points = unpack_codes(canonical[ZERO_POINTS], bits, dim=0, size=n).t()
    return dequantize(codes.t(), canonical[SCALES].t(), groups, bits, torch.float32, zero_points).t()


@pytest.mark.parametrize("variant", list(QUANT_METHOD))
def test_the_package_dequantizes_each_expert_as_the_tool_does(request, variant):
    assert QUANT_METHOD.keys() == VARIANTS.keys()
    _needs_format(QUANT_METHOD[variant])
    quantized = request.getfixturevalue("quantized")  # built only for a format the package reads
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader

    reference = load_file(str(quantized.reference(variant)))
    ckpt = open_checkpoint(quantized.checkpoint(variant))
    assert len(ckpt.layers) == LAYERS
    compared = 0
    with TensorReader(ckpt.files) as reader:
        for layer in ckpt.layers:
            for expert in range(layer.num_experts):
                for role, canonical in reader.read_expert(layer, expert).items():
                    module = layer.tensor_name(expert, role, "weight")
                    want = reference[module]
                    got = _dequantized(canonical, layer.scheme, *want.shape)
                    assert torch.equal(got, want), f"{variant}: {module}"
                    compared += 1
    assert compared == sum(3 * layer.num_experts for layer in ckpt.layers) > 0
