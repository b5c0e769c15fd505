"""The ctypes prototypes in wna16ctl/native/build.py against the C declarations they bind.

ctypes trusts whatever argtypes it is given: a parameter added in kernels/capi.h and not in
build.py shifts every later argument silently. So every bound function is parsed from its C
declaration (capi.h; header_scan.cpp for the header reader, whose functions live there alone) and
its parameter and return types compared with the prototype, one by one.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from wna16ctl.native import build

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
_DECL = re.compile(r"WNA16_API\s+([\w\s\*]+?)\s*\b(wna16_\w+)\s*\(([^)]*)\)\s*[;{]", re.S)


def c_declarations(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, [parameter types]) of every WNA16_API function declared in `text`."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    out = {}
    for ret, name, params in _DECL.findall(text):
        types = []
        for p in (x.strip() for x in params.split(",")):
            if p in ("", "void"):
                continue
            # drop the parameter name: the last identifier not followed by more of the type
            m = re.match(r"(.*?[\s\*])(\w+)$", p)
            types.append(" ".join((m.group(1) if m else p).split()))
        out[name] = (" ".join(ret.split()), types)
    return out


def ctype_of(c_type: str) -> object:
    """The ctypes type a C type is bound as: pointers as void* (char* results as c_char_p)."""
    t = c_type.replace("const ", "").replace(" *", "*").strip()
    if t == "char*":
        return ctypes.c_char_p
    if "*" in t:
        return ctypes.c_void_p
    return {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64}[t]


def _same(bound: object, declared: object, *, is_result: bool) -> bool:
    if bound is declared:
        return True
    # a char* parameter may be passed as bytes (c_char_p) or as a buffer address (c_void_p)
    return not is_result and {bound, declared} == {ctypes.c_char_p, ctypes.c_void_p}


def _declared() -> dict[str, tuple[str, list[str]]]:
    decls = c_declarations((KERNELS / "capi.h").read_text())
    decls.update(c_declarations((KERNELS / "header_scan.cpp").read_text()))
    return decls


@pytest.mark.parametrize("table", ["_HOST_PROTOS", "_HEADER_SCAN_PROTOS", "_CUDA_PROTOS"])
def test_every_prototype_matches_its_c_declaration(table):
    decls = _declared()
    wrong = []
    for name, (restype, argtypes) in getattr(build, table).items():
        if name not in decls:
            wrong.append(f"{name}: not declared in kernels/")
            continue
        ret, params = decls[name]
        declared = [ctype_of(p) for p in params]
        if not _same(restype, ctype_of(ret), is_result=True):
            wrong.append(f"{name}: returns {ret}, bound as {restype}")
        if len(declared) != len(argtypes):
            wrong.append(f"{name}: {len(params)} parameters declared, {len(argtypes)} bound")
            continue
        for i, (b, d) in enumerate(zip(argtypes, declared)):
            if not _same(b, d, is_result=False):
                wrong.append(f"{name}: parameter {i} is {params[i]}, bound as {b}")
    assert not wrong, "\n".join(wrong)


def test_every_cuda_and_host_function_of_capi_is_bound():
    bound = set(build._HOST_PROTOS) | set(build._CUDA_PROTOS)
    declared = set(c_declarations((KERNELS / "capi.h").read_text()))
    assert declared - bound == set(), "declared in capi.h, bound nowhere"


def test_the_parser_reads_types_and_sees_a_changed_signature():
    decls = c_declarations("""
        /* a comment with WNA16_API int wna16_fake(int x); inside */
        WNA16_API int wna16_a(const int32_t* packed, int64_t n, int num_bits);
        WNA16_API const char* wna16_b(void);
        WNA16_API void* wna16_c(int fd, int64_t off, int64_t len, int64_t* out_len) { return 0; }
    """)
    assert decls == {"wna16_a": ("int", ["const int32_t*", "int64_t", "int"]),
                     "wna16_b": ("const char*", []),
                     "wna16_c": ("void*", ["int", "int64_t", "int64_t", "int64_t*"])}
    assert [ctype_of(t) for t in decls["wna16_a"][1]] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    assert ctype_of("const char*") is ctypes.c_char_p and ctype_of("int32_t") is ctypes.c_int32
