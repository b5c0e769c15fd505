"""vLLM's compressed-tensors quantization method: the steps that differ per format.

vLLM builds a checkpoint's layers through the method of its format (compressed-tensors:
`CompressedTensorsConfig` and `CompressedTensorsWNA16MoEMethod` / its linear schemes), and those
steps (config parsing: `config_parse.py`; the method's constructor checks: here) refuse what the
format cannot hold.  What the method then asks, the backend oracle keyed by the weight scheme
(`moe.py`, `linear.py`), is shared by every format, as vLLM shares it.
"""

from __future__ import annotations

from wna16ctl.layout.spec import CODES, SCALES, ZERO_POINTS
from wna16ctl.planning import rules
from wna16ctl.sources.formats.compressed_tensors import PACK_QUANTIZED
from wna16ctl.sources.formats.face import SHAPE
from wna16ctl.sources.scheme import WeightScheme

# The parameters the compressed-tensors WNA16 linear scheme creates on a layer, by role
# (`CompressedTensorsWNA16.create_weights`: the same in every known release; the g_idx of
# act-order layers aside): the names a loaded layer's state holds.
LINEAR_PARAMS = {CODES: "weight_packed", SCALES: "weight_scale", SHAPE: "weight_shape", ZERO_POINTS: "weight_zero_point"}


def moe_format_refusal(rel: rules.Release, s: WeightScheme) -> str | None:
    """The error the MoE method's constructor raises for a WNA16 scheme in a stored form or bit
    width it does not load (None: it builds)."""
    if s.format != PACK_QUANTIZED or not 2 <= s.num_bits <= 8:
        return _format_bits_error(rel, s)
    return None


def _format_bits_error(rel: rules.Release, s: WeightScheme) -> str:
    bits = "[2, 3, 4, 5, 6, 7, 8]"
    if rel.has("method.format_error_is_tuple"):
        # the release passes the pieces as separate exception arguments (and names the expected
        # format as the one found): this is how the message prints
        return str(("For Fused MoE layers, only format: ", f"{PACK_QUANTIZED} ", f" and bits: {bits} is supported ",
                    f"but got format: {PACK_QUANTIZED}  and bits: {s.num_bits}"))
    return (f"For Fused MoE layers, only format: {PACK_QUANTIZED} and bits: {bits} is supported but got format: "
            f"{PACK_QUANTIZED} and bits: {s.num_bits}")


def linear_stored_form_known(s: WeightScheme) -> bool:
    """Whether a linear layer's scheme is a weight-only integer one stored in the packed form the
    WNA16 linear method loads."""
    return s.is_wna16 and s.format == PACK_QUANTIZED
