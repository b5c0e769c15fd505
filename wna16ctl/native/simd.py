"""Which tile loop the native rank builder runs (`wna16_marlin_rank_host` in kernels/host.cpp).

`WNA16CTL_SIMD` chooses it: `auto` (the default: the best this CPU has), or one of `avx512`
(AVX-512 VBMI; its 8-bit tiles run the AVX2 loop), `avx2`, `neon`, `scalar` to force it, e.g. to
compare them.  Every level writes the same bytes.  A level the CPU (or this build) lacks is refused
with one line rather than replaced by another.
"""

from __future__ import annotations

import os

from wna16ctl.native import build as native
from wna16ctl.errors import UsageError

ENV = "WNA16CTL_SIMD"
AUTO = "auto"
# WNA16_SIMD_* in kernels/capi.h
LEVELS = {"scalar": 0, "auto": 1, "avx2": 2, "avx512": 3, "neon": 4}
NAMES = {code: name for name, code in LEVELS.items() if name != AUTO}


def requested() -> str:
    """The level WNA16CTL_SIMD asks for (`auto` when unset); refuses an unknown name."""
    value = os.environ.get(ENV, "").strip().lower() or AUTO
    if value not in LEVELS:
        raise UsageError(f"{ENV}={os.environ.get(ENV)}: not one of auto, avx512, avx2, neon, scalar; "
                         "set one of those or unset it")
    return value


def available(lib: native.NativeLib) -> list[str]:
    """The levels this CPU and build can run, best first."""
    return [name for name in ("avx512", "avx2", "neon", "scalar") if lib.wna16_simd_level(LEVELS[name]) == LEVELS[name]]


def resolve() -> tuple[int, str]:
    """(code, name) of the level the native rank builder runs: WNA16CTL_SIMD's, or for `auto` the
    best this CPU has. Refuses with one line a level the CPU lacks, and a forced level without the
    native host library."""
    want = requested()
    lib = native.host_lib()
    if lib is None:
        if want != AUTO:
            raise UsageError(f"{ENV}={want}: the native host library is unavailable (see the notice above); "
                             f"unset {ENV}")
        return LEVELS["scalar"], "scalar"
    code = lib.wna16_simd_level(LEVELS[want])
    if code < 0:
        raise UsageError(f"{ENV}={want}: this CPU has no {want} instructions (it has: {', '.join(available(lib))}); "
                         f"choose one of those or unset {ENV}")
    return code, NAMES[code]
