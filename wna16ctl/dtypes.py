"""Dtype names, defined once: safetensors' names ("BF16", "I32"), config.json's names ("bfloat16"),
their sizes, and the torch dtypes they stand for.

Every layer reads these (sources, layout, output, the native path, the vLLM plugin), so they sit
beside `errors`, below all of them. torch is imported only by the two functions that need it: the
native repack path runs on the string names alone and never imports torch.
"""

from __future__ import annotations

import struct
from typing import Any

# bytes per element of every safetensors dtype that has a byte size
ST_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
# every dtype the safetensors library reads, in bits (the sub-byte ones have no byte size)
ST_BITS = {**{k: 8 * v for k, v in ST_SIZES.items()}, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
# the floating-point dtypes a WNA16 scale (and a model) may have, as config.json and safetensors name them
FLOAT_ST_OF_CONFIG = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
FLOAT_ST = ("BF16", "F16", "F32")
# the integer dtypes a g_idx may have, as the `array` module's typecodes (read without torch)
ARRAY_TYPECODES = {"I32": "i", "I64": "q"}
# numpy's dtype for the words of a tensor read without torch (floats as their bits: numpy has no
# bfloat16), and the exponent bits that are all ones in a float that is Inf or NaN
NUMPY_WORDS = {"I32": "<i4", "I64": "<i8", "F16": "<u2", "BF16": "<u2", "F32": "<u4"}
FLOAT_EXPONENT_MASK = {"F16": 0x7C00, "BF16": 0x7F80, "F32": 0x7F800000}
# the float dtypes as `struct` formats, little-endian as safetensors stores them (BF16: F32's upper half)
_STRUCT_FLOATS = {"F64": "<d", "F32": "<f", "F16": "<e"}


def float_bytes(value: float, st_dtype: str) -> bytes | None:
    """`value` stored as one element of a safetensors float dtype (None: not one of F64/F32/F16/BF16)."""
    if st_dtype == "BF16":
        return struct.pack("<f", value)[2:]
    fmt = _STRUCT_FLOATS.get(st_dtype)
    return None if fmt is None else struct.pack(fmt, value)

# safetensors name -> torch attribute name (resolved lazily: see torch_dtype)
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_ST_OF_TORCH_NAME = {f"torch.{v}": k for k, v in _TORCH_NAMES.items()}


def torch_dtype(st: str) -> Any:
    """The torch dtype of a safetensors dtype name (KeyError for one torch has no dtype for)."""
    import torch

    return getattr(torch, _TORCH_NAMES[st])


def st_dtype(dtype: Any) -> str:
    """The safetensors name of a torch dtype (KeyError for one safetensors cannot store)."""
    return _ST_OF_TORCH_NAME[str(dtype)]
