"""The CUDA MoE GEMM kernels run on the CPU: a library of the real kernel sources
(`kernels/moe_gemm_v3.cu`, `kernels/moe_gemm_v2.cu`, `kernels/moe_gemm.cu`) compiled with g++ against the CPU emulation of
`kernels/intrinsics.cuh` (`kernels/emu/intrinsics_host.h`, docs/kernel-emulation.md).

What it is for: `verify` judges the repacked per-rank tensors with the kernel a GPU would run, its
fragment layout, its dequantisation and its tile/stream-K code, not with the layout's own inverse
functions (which `ops._gemm_cpu` uses and which would miss any bug they share with the forward
layout). It is slow -- every CUDA thread is a fiber (a user-level context) and every warp
collective a hand-off between 32 of them -- so it is meant for small models, for a subset of the
tokens on larger ones and for a prefix of steps; it says nothing about speed.

Nothing here is required: without g++ (or with `WNA16CTL_NO_NATIVE=1`) `emulated_gemm_lib()`
returns None with the reason in `emulated_unavailable_reason()`, and callers report the check as
"not run". An emulator abort (a kernel that misaligns an ldmatrix or diverges at a barrier) ends
the process with a message on stderr, as a device fault would.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import threading
from pathlib import Path
from typing import Optional, TypedDict

import torch
from torch import Tensor

from wna16ctl.native.build import (
    CPrototypes,
    KernelBuildError,
    KernelError,
    NativeLib,
    WNA16_OK,
    _build_dir,
    _compile_and_link,
    _digest,
    _tool_identity,
    find_cxx,
    kernels_dir,
    native_disabled,
)
from wna16ctl.native.ops import (DTYPE_CODES, GEMM_VARIANTS, WNA16_ENOTSUP, _check_gemm_extras, _gemm_dims,
                                 fast_gemm_order)

# the kernels and their launchers, the error store, the emulated device's settings
EMULATED_SOURCES = ("moe_gemm_v3.cu", "moe_gemm_v2.cu", "moe_gemm.cu", "error.cpp", "emu_capi.cpp")
_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-pthread", "-fvisibility=hidden")
# Few emulated SMs: the stream-K grid of v2 is sized by the SM count, and every block is a team of
# host threads; 2 SMs still make stream-K cut tiles between blocks on larger problems. The SM
# count fixes the grid and so the stream-K cuts and the output's bits: it does not follow the
# machine. What follows the machine is how many blocks run side by side (one OS thread each,
# its CUDA threads as fibers): every core this process may run on (`usable_cores`), up to
# the grid's blocks. The blocks combine their partial tiles in a fixed order, so the output is
# the same bits whatever that number.
EMULATED_SMS = 2

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_PROTOS: CPrototypes = {
    "wna16_abi_version": (_I32, []),
    "wna16_last_error": (ctypes.c_char_p, []),
    "wna16_emu_configure": (_I32, [_I32, _I32, _I32, _I32]),
    "wna16_emu_counters": (_I32, [_P]),
    "wna16_cuda_moe_gemm": (_I32, [_P] * 11 + [_I64] * 6 + [_I32] * 5 + [_P]),
    "wna16_cuda_moe_gemm_v2": (_I32, [_P] * 11 + [_I64] * 6 + [_I32] * 5 + [_P]),
    "wna16_cuda_moe_gemm_v2_workspace": (_I32, [_I64] * 5 + [_I32] * 3 + [_P]),
    "wna16_cuda_moe_gemm_v3_workspace": (_I32, [_I64] * 5 + [_I32] * 3 + [_P]),
    "wna16_cuda_moe_gemm_v3": (_I32, [_P] * 11 + [_I64] * 6 + [_I32] * 5 + [_P]),
}

class _Loaded(TypedDict, total=False):
    lib: Optional[NativeLib]  # present once a load was tried; None when it failed
    reason: str  # why there is no library


_lock = threading.Lock()
_state: _Loaded = {}


def _emulated_headers(src: Path) -> list[Path]:
    return sorted([*src.glob("*.h"), *src.glob("*.cuh"), *(src / "emu").glob("*.h")])


def build_emulated(out_dir: Optional[Path] = None) -> Path:
    """Build (or find in the cache) the emulated kernel library; returns its path."""
    cxx = find_cxx()
    if not cxx:
        raise KernelBuildError("no C++ compiler (g++) on PATH")
    src = kernels_dir()
    if not (src / "emu" / "intrinsics_host.h").is_file():
        raise KernelBuildError(f"the kernel emulation is not in {src}/emu (set WNA16CTL_KERNELS_DIR)")
    key = _digest([*(p.name.encode() + p.read_bytes() for p in
                     [*(src / s for s in EMULATED_SOURCES), *_emulated_headers(src)]),
                   _tool_identity(cxx), *_FLAGS])
    out_dir = out_dir or _build_dir()
    target = out_dir / f"libwna16_emulated-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        objs = [Path(tmp) / f"{Path(s).stem}.o" for s in EMULATED_SOURCES]
        cmds = [[cxx, *_FLAGS, "-I", str(src), *(["-x", "c++"] if s.endswith(".cu") else []), "-c", str(src / s),
                 "-o", str(o)] for s, o in zip(EMULATED_SOURCES, objs)]
        link = [cxx, *_FLAGS, "-shared", *map(str, objs), "-o", str(Path(tmp) / "lib.so")]
        return _compile_and_link(target, cmds, link, Path(tmp))


def emulated_gemm_lib() -> Optional[NativeLib]:
    """The loaded emulated library (built on first use), or None with the reason kept."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib: Optional[NativeLib] = None
        if native_disabled():
            _state["reason"] = "native code is disabled (WNA16CTL_NO_NATIVE)"
        else:
            try:
                lib = NativeLib(build_emulated(), _PROTOS)
                lib.call("wna16_emu_configure", EMULATED_SMS, usable_cores(), 0, 1)
            except (KernelBuildError, OSError, ValueError, KernelError) as exc:
                _state["reason"] = f"the emulated kernels cannot be built: {str(exc).splitlines()[0]}"
                lib = None
        _state["lib"] = lib
        return lib


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container or `taskset` may grant
    fewer than the machine has): the emulated blocks that run side by side, and verify's torch
    threads."""
    return max(1, len(os.sched_getaffinity(0)))


def configure_emulation(*, concurrent_blocks: int = 0, fibers: int = -1) -> None:
    """Change how the emulated device runs a launch (0 / -1 leave a setting): blocks side by side,
    and fibers (1) or one OS thread per CUDA thread (0). The output does not depend on either."""
    lib = emulated_gemm_lib()
    if lib is None:
        raise KernelBuildError(emulated_unavailable_reason())
    lib.call("wna16_emu_configure", 0, concurrent_blocks, 0, fibers)


def emulation_counters() -> dict[str, int]:
    """What the emulated launches did since the library was loaded: launches, blocks, the rows of
    the mma instructions executed (16 each), those multiplied (the others are zero rows: a tile's
    rows past its routed ones), and the OS threads the launches ran on."""
    lib = emulated_gemm_lib()
    if lib is None:
        raise KernelBuildError(emulated_unavailable_reason())
    out = (ctypes.c_int64 * 5)()
    lib.call("wna16_emu_counters", out)
    return dict(zip(("launches", "blocks", "mma_rows", "mma_rows_multiplied", "os_threads"), (int(v) for v in out)))


def emulated_unavailable_reason() -> str:
    return _state.get("reason", "")


def _aligned(t: Tensor) -> Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _i32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else _aligned(t.to(torch.int32))


def _p(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def emulated_moe_gemm(
    a: Tensor, b_q: Tensor, scales: Tensor, sorted_token_ids: Tensor, expert_offsets: Tensor, *,
    top_k: int, num_bits: int, zero_points: Optional[Tensor] = None, g_idx: Optional[Tensor] = None,
    perm: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None, is_k_full: bool = True,
) -> tuple[Tensor, str]:
    """The MoE GEMM (the contract of `ops.moe_wna16_gemm`) executed by the real kernel source on
    the CPU emulation: v3, or v2 where v3 declines, or v1 where v2 declines (WNA16_ENOTSUP), the
    order of `ops.moe_wna16_gemm`'s auto choice (`ops.fast_gemm_order`: v2 first for 64-row
    tiles). Returns (output, kernel name).
    Raises KernelBuildError when the library is unavailable, KernelError when a kernel refuses."""
    lib = emulated_gemm_lib()
    if lib is None:
        raise KernelBuildError(emulated_unavailable_reason())
    a, b_q, scales, sorted_token_ids, expert_offsets = (x.cpu() for x in (a, b_q, scales, sorted_token_ids,
                                                                         expert_offsets))
    zero_points, g_idx, perm, topk_weights = (None if x is None else x.cpu()
                                              for x in (zero_points, g_idx, perm, topk_weights))
    experts, size_k, size_n, groups = _gemm_dims(a, b_q, scales, num_bits, top_k)
    _check_gemm_extras(a, b_q, scales, zero_points, g_idx, perm, sorted_token_ids, expert_offsets,
                       topk_weights, top_k, num_bits, is_k_full)
    num_slots = a.shape[0] * top_k
    out = torch.zeros(num_slots, size_n, dtype=a.dtype)
    ids, offs = _aligned(sorted_token_ids.to(torch.int32)), _aligned(expert_offsets.to(torch.int32))
    tw = None if topk_weights is None else _aligned(topk_weights.reshape(-1).float())
    keep = (_aligned(a), _aligned(b_q), _aligned(scales), _i32(zero_points), _i32(g_idx), _i32(perm), ids, offs, tw)
    ptrs = [_p(x) for x in keep] + [_p(out)]
    sizes = (num_slots, ids.numel(), experts, size_n, size_k, groups, top_k, num_bits, DTYPE_CODES[a.dtype],
             int(is_k_full), GEMM_VARIANTS["auto"], None)
    for kernel in fast_gemm_order("auto", ids.numel(), experts, GEMM_VARIANTS["auto"]):  # as on a GPU
        words = ctypes.c_int64(0)
        rc = getattr(lib, f"wna16_cuda_moe_gemm_{kernel}_workspace")(
            ids.numel(), experts, size_n, size_k, groups, num_bits, int(perm is not None), GEMM_VARIANTS["auto"],
            ctypes.byref(words))
        if rc == WNA16_OK:
            ws = torch.zeros(max(words.value, 1), dtype=torch.int32)  # v3: its counters zero before the call
            rc = getattr(lib, f"wna16_cuda_moe_gemm_{kernel}")(*ptrs, _p(ws), *sizes)
            if rc == WNA16_OK:
                return out, kernel
        if rc != WNA16_ENOTSUP:
            raise KernelError(f"wna16_cuda_moe_gemm_{kernel} (emulated): "
                              f"{(lib.wna16_last_error() or b'').decode()} (code {rc})", rc)
    ws = torch.zeros(experts + 1, dtype=torch.int32)
    lib.call("wna16_cuda_moe_gemm", *ptrs, _p(ws), *sizes)
    return out, "v1"


def emulation_enabled_by_env() -> bool:
    """$WNA16CTL_VERIFY_KERNEL=torch skips the emulated kernels in verify (they are the default)."""
    return os.environ.get("WNA16CTL_VERIFY_KERNEL", "emulated").strip().lower() != "torch"
