"""vLLM's own packing helpers, loaded from a release's sources as a reference independent of the
package's readers: `pack_rows` (GPTQ's K-first packing), `unpack_cols`/`pack_cols` (packing along
N) and `awq_pack` (AWQ's interleaved order), from model_executor/layers/quantization/utils/
quant_utils.py.  That module imports the distributed runtime, so only these functions' own
definitions are taken from it (they need numpy and torch alone)."""

from __future__ import annotations

import ast
from functools import lru_cache
from types import SimpleNamespace

import numpy
import pytest
import torch

from tests.conformance.vllm_release import fetch_hint, release_sources

RELEASE = "0.33.0"
_FUNCTIONS = ("get_pack_factor", "pack_rows", "pack_cols", "unpack_cols", "awq_pack")


@lru_cache(maxsize=1)
def helpers() -> SimpleNamespace:
    try:
        root = release_sources(RELEASE)
    except Exception:  # offline without the cache
        pytest.skip(fetch_hint(RELEASE))
    path = root / "tree" / "vllm" / "model_executor" / "layers" / "quantization" / "utils" / "quant_utils.py"
    tree = ast.parse(path.read_text())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _FUNCTIONS]
    assert sorted(d.name for d in defs) == sorted(_FUNCTIONS), "vLLM's quant_utils changed its packing helpers"
    namespace: dict = {"numpy": numpy, "torch": torch}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), namespace)
    return SimpleNamespace(**{name: namespace[name] for name in _FUNCTIONS})
