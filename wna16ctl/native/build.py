"""Building and loading the native libraries in `kernels/`, without torch.

The host library (g++) and the CUDA library (nvcc) are compiled on first use into a per-user cache
(`$XDG_CACHE_HOME/wna16ctl` or `~/.cache/wna16ctl`), keyed by a hash of the sources, the compiler
and the target, built in a temporary directory and renamed into place (concurrent first uses are
safe), and loaded with ctypes.  `wna16ctl.native.ops` puts torch ops on top; the repack data path
calls the host library directly and so runs without importing torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("wna16ctl.native.ops")  # one logger for the notices of both modules

ABI_VERSION = 1  # must equal WNA16_ABI_VERSION in kernels/capi.h

HOST_SOURCES = ("host.cpp", "host_simd.cpp", "untile.cpp", "error.cpp")
# inspect's checking header reader: its own small library, so that a first `inspect` compiles one
# file (about a second) and never waits for the repack kernels
HEADER_SCAN_SOURCES = ("header_scan.cpp",)
_HEADER_SCAN_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden")
CUDA_SOURCES = ("repack.cu", "moe_gemm.cu", "moe_gemm_v2.cu", "moe_gemm_v3.cu", "error.cpp")
_HOST_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-pthread", "-fvisibility=hidden")
_HOST_FILE_FLAGS: dict[str, tuple[str, ...]] = {}
_CUDA_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden")
_FALLBACK_ARCHS = ("80", "90")

WNA16_OK = 0
WNA16_EFAULT = 4  # kernels/capi.h: a mapped file shrank while it was read


class KernelBuildError(RuntimeError):
    """A native library could not be built or loaded; the message carries the compiler output."""


class KernelError(RuntimeError):
    """A native call returned an error code (the message is the library's last error)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------------
# locations, switches, notices


def kernels_dir() -> Path:
    """The kernel sources: $WNA16CTL_KERNELS_DIR when set, else the copy a wheel ships inside the
    package (`wna16ctl/kernel_sources/`, see setup.py), else `kernels/` of the checkout."""
    override = os.environ.get("WNA16CTL_KERNELS_DIR")
    if override:
        return Path(override)
    packaged = Path(__file__).resolve().parents[1] / "kernel_sources"
    if (packaged / "capi.h").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "kernels"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wna16ctl"


def native_disabled() -> bool:
    return os.environ.get("WNA16CTL_NO_NATIVE", "").strip() not in ("", "0")


_notice_lock = threading.Lock()
_notice_given = False


def _notice(message: str) -> None:
    """The one user-visible fallback notice per process; later ones go to the debug log."""
    global _notice_given
    with _notice_lock:
        first = not _notice_given
        _notice_given = True
    if first:
        log.warning("%s; using the slower portable path instead (set WNA16CTL_NO_NATIVE=1 to silence)", message)
    else:
        log.debug("%s", message)


# ----------------------------------------------------------------------------------------------
# building


def _source_files() -> list[Path]:
    d = kernels_dir()
    if not (d / "capi.h").is_file():
        raise KernelBuildError(f"kernel sources not found in {d} (set WNA16CTL_KERNELS_DIR)")
    return sorted(p for p in d.iterdir() if p.suffix in (".h", ".cuh", ".cpp", ".cu"))


def _digest(parts: Sequence[bytes | str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _tool_version(exe: str) -> str:
    import subprocess

    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{exe} --version failed: {exc}") from exc
    return out.stdout.strip()


def _build_key(compiler: str, flags: list[str]) -> str:
    """The cache key of a library: every kernel source (name and bytes), the compiler, the flags."""
    return _digest([*(p.name.encode() + p.read_bytes() for p in _source_files()), _tool_identity(compiler), *flags])


def _tool_identity(exe: str) -> str:
    """What a build is keyed on for its compiler: the resolved executable's path, size and mtime.
    A stat instead of running `exe --version` on every use (tens of milliseconds per process);
    replacing the compiler changes at least one of the three."""
    path = shutil.which(exe) or exe
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError as exc:
        raise KernelBuildError(f"{exe}: cannot be found ({exc.strerror})") from exc
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def find_cxx() -> Optional[str]:
    return os.environ.get("CXX") if os.environ.get("CXX") else shutil.which("g++")


def find_nvcc() -> Optional[str]:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def _run(cmd: list[str], what: str) -> None:
    import subprocess  # only when something is built: a run that finds its libraries never starts one

    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-4000:]
        raise KernelBuildError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _compile_and_link(
    target: Path, compile_cmds: list[list[str]], link_cmd: list[str], workdir: Path
) -> Path:
    """Compile objects in parallel, link into `workdir`, then atomically rename onto `target`."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(compile_cmds), os.cpu_count() or 1))) as pool:
        for fut in [pool.submit(_run, cmd, "compile") for cmd in compile_cmds]:
            fut.result()
    _run(link_cmd, "link")
    built = Path(link_cmd[link_cmd.index("-o") + 1])
    os.replace(built, target)  # atomic: readers see the old file or the complete new one
    return target


def _fallback_dir() -> Path:
    """Where libraries are built when the cache directory cannot be written."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"wna16ctl-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _build_dir() -> Path:
    import tempfile

    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=d, delete=True)
        probe.close()
        return d
    except OSError:
        fallback = _fallback_dir()
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _built(name: str, out_dir: Optional[Path]) -> tuple[Path, bool]:
    """(path, whether it exists) of the library file `name`: in `out_dir` when given, else in the
    cache directory or, where an earlier build had to use it, the fallback directory.  A library
    that is already built is found without writing anything (no probe of the cache directory)."""
    if out_dir is None:
        for where in (cache_dir, _fallback_dir):  # called in turn: the fallback's look-up imports tempfile
            found = where() / name
            if found.exists():
                return found, True
        out_dir = _build_dir()
    return out_dir / name, (out_dir / name).exists()


def build_host(extra_flags: Sequence[str] = (), out_dir: Optional[Path] = None) -> Path:
    """Build (or find in the cache) the host library; returns its path. Raises KernelBuildError."""
    cxx = find_cxx()
    if not cxx:
        raise KernelBuildError("no C++ compiler (g++) on PATH")
    src = kernels_dir()
    flags = [*_HOST_FLAGS, *extra_flags]
    key = _build_key(cxx, flags)
    target, done = _built(f"libwna16_host-{key}.so", out_dir)
    if done:
        return target
    import tempfile

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        objs = [Path(tmp) / f"{Path(s).stem}.o" for s in HOST_SOURCES]
        cmds = [[cxx, *flags, *_HOST_FILE_FLAGS.get(s, ()), "-I", str(src), "-c", str(src / s), "-o", str(o)]
                for s, o in zip(HOST_SOURCES, objs)]
        link = [cxx, *flags, "-shared", *map(str, objs), "-o", str(Path(tmp) / "lib.so")]
        return _compile_and_link(target, cmds, link, Path(tmp))


def build_header_scan(out_dir: Optional[Path] = None) -> Path:
    """Build (or find in the cache) the header-scan library, keyed on its own sources only."""
    cxx = find_cxx()
    if not cxx:
        raise KernelBuildError("no C++ compiler (g++) on PATH")
    src = kernels_dir()
    if not (src / "capi.h").is_file():
        raise KernelBuildError(f"kernel sources not found in {src} (set WNA16CTL_KERNELS_DIR)")
    flags = list(_HEADER_SCAN_FLAGS)
    key = _digest([*((src / n).read_bytes() for n in ("capi.h", *HEADER_SCAN_SOURCES)), _tool_identity(cxx), *flags])
    target, done = _built(f"libwna16_headers-{key}.so", out_dir)
    if done:
        return target
    import tempfile

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        built = Path(tmp) / "lib.so"
        _run([cxx, *flags, "-shared", "-I", str(src), *(str(src / s) for s in HEADER_SCAN_SOURCES), "-o", str(built)],
             "compile")
        os.replace(built, target)  # atomic: readers see the old file or the complete new one
        return target


def _normalise_arch(arch: str | int) -> str:
    a = str(arch).lower().replace("sm_", "").replace("compute_", "").replace(".", "")
    if not a.isdigit():
        raise ValueError(f"unrecognised CUDA arch {arch!r} (expected e.g. 'sm_90', '90' or '9.0')")
    return a


def detect_archs() -> list[str]:
    """Compute capability of the local GPU(s): torch first, then nvidia-smi, else sm_80 + sm_90."""
    archs: set[str] = set()
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                archs.add(f"{major}{minor}")
    except Exception as exc:  # a broken driver must not stop the build
        log.debug("torch.cuda capability query failed: %s", exc)
    if not archs and shutil.which("nvidia-smi"):
        import subprocess

        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )
            archs.update(_normalise_arch(x.strip()) for x in out.stdout.split() if x.strip())
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            log.debug("nvidia-smi query failed: %s", exc)
    return sorted(archs) if archs else list(_FALLBACK_ARCHS)


def _nvcc_archs(nvcc: str) -> list[int]:
    import subprocess

    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=30)
        return sorted({int(x.split("_")[1]) for x in out.stdout.split() if x.startswith("compute_")})
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return []


def _gencode(archs: Sequence[str], supported: Sequence[int]) -> list[str]:
    flags: list[str] = []
    chosen: list[int] = []
    for a in archs:
        n = int(a)
        if supported and n not in supported:
            older = [s for s in supported if s <= n]
            if not older:
                raise KernelBuildError(f"nvcc cannot target sm_{a} (supports {supported})")
            n = older[-1]  # the driver JIT-compiles the PTX embedded below for the newer GPU
        if n not in chosen:
            chosen.append(n)
    for n in chosen:
        flags += ["-gencode", f"arch=compute_{n},code=sm_{n}"]
    top = max(chosen)
    flags += ["-gencode", f"arch=compute_{top},code=compute_{top}"]  # PTX for newer GPUs
    return flags


def build_cuda(
    arch: str | int | Sequence[str | int] | None = None,
    extra_flags: Sequence[str] = (),
    out_dir: Optional[Path] = None,
) -> Path:
    """Build (or find in the cache) the CUDA library for `arch` (default: the local GPU's, else
    sm_80 + sm_90); returns its path. Raises KernelBuildError."""
    nvcc = find_nvcc()
    if not nvcc:
        raise KernelBuildError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    if arch is None:
        archs = detect_archs()
    elif isinstance(arch, (str, int)):
        archs = [_normalise_arch(arch)]
    else:
        archs = [_normalise_arch(a) for a in arch]
    src = kernels_dir()
    flags = [*_CUDA_FLAGS, *_gencode(archs, _nvcc_archs(nvcc)), *extra_flags]
    key = _build_key(nvcc, flags)
    target, done = _built(f"libwna16_cuda-{'-'.join(archs)}-{key}.so", out_dir)
    if done:
        return target
    import tempfile

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        objs = [Path(tmp) / f"{Path(s).stem}.o" for s in CUDA_SOURCES]
        cmds = [[nvcc, *flags, "-I", str(src), "-c", str(src / s), "-o", str(o)] for s, o in zip(CUDA_SOURCES, objs)]
        link = [nvcc, *flags, "-shared", *map(str, objs), "-o", str(Path(tmp) / "lib.so")]
        return _compile_and_link(target, cmds, link, Path(tmp))


# ----------------------------------------------------------------------------------------------
# loading

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int

# each C function's prototype: name -> (ctypes return type, ctypes argument types)
CPrototypes = dict[str, tuple[type, Sequence[type]]]

_HOST_PROTOS: CPrototypes = {
    "wna16_abi_version": (_I32, []),
    "wna16_last_error": (ctypes.c_char_p, []),
    "wna16_marlin_repack_host": (_I32, [_P, _P, _P, _I64, _I64, _I64, _I32, _I32]),
    "wna16_marlin_repack_host_strided": (_I32, [_P, _P, _P, _I64, _I64, _I64, _I32] + [_I64] * 5 + [_I32, _I32]),
    "wna16_marlin_unrepack_host": (_I32, [_P, _P, _P, _I64, _I64, _I64, _I32, _I32]),
    "wna16_marlin_untile_host": (_I32, [_P, _P, _I64, _I64, _I64, _I32]),
    "wna16_permute_scales_host": (_I32, [_P, _P, _I64, _I64, _I32, _I32, _I32]),
    "wna16_zero_points_host": (_I32, [_P, _P, _I64, _I64, _I32, _I32]),
    "wna16_marlin_src_table": (_I32, [_I32, _I64, _I64, _P, _P]),
    "wna16_marlin_dst_table": (_I32, [_I32, _I64, _I64, _P, _P, _P]),
    "wna16_scale_perm_table": (_I32, [_I32, _P]),
    "wna16_zp_perm_table": (_I32, [_I32, _P]),
    "wna16_marlin_rank_host": (_I32, [_P, _I64, _I64, _I64, _I32, _I32, _I32, _I64] + [_I32] * 4 + [_P] * 4 + [_I32] * 2),
    "wna16_simd_level": (_I32, [_I32]),
    "wna16_first_nonfinite": (_I64, [_P, _I64, _I32]),
    "wna16_first_nonfinite_many": (_I64, [_P, _P, _I64, _I32, _P]),
    "wna16_pread_many": (_I64, [_P, _P, _P, _P, _I64, _P]),
    "wna16_map_file": (_P, [_I32, _I64, _I64, _P]),
    "wna16_transpose_host": (_I32, [_P, _I64, _I64, _I64, _P, _I32, _I32]),
    "wna16_unmap_file": (_I32, [_P, _I64]),
}

_HEADER_SCAN_PROTOS: CPrototypes = {
    "wna16_abi_version": (_I32, []),
    "wna16_header_scan": (_I32, [ctypes.c_char_p, _I64, _I64, _P, _I64, _P]),
    "wna16_index_scan": (_I32, [ctypes.c_char_p, _I64, _P, _I64, _P]),
}

_CUDA_PROTOS: CPrototypes = {
    "wna16_abi_version": (_I32, []),
    "wna16_last_error": (ctypes.c_char_p, []),
    "wna16_cuda_device_info": (_I32, [_I32, _P]),
    "wna16_cuda_marlin_repack": (_I32, [_P, _P, _P, _I64, _I64, _I64, _I32, _P]),
    "wna16_cuda_permute_scales": (_I32, [_P, _P, _I64, _I64, _I32, _I32, _P]),
    "wna16_cuda_zero_points": (_I32, [_P, _P, _I64, _I64, _I32, _P]),
    "wna16_cuda_moe_gemm": (_I32, [_P] * 11 + [_I64] * 6 + [_I32] * 5 + [_P]),
    "wna16_cuda_moe_gemm_v2": (_I32, [_P] * 11 + [_I64] * 6 + [_I32] * 5 + [_P]),
    "wna16_cuda_moe_gemm_v2_workspace": (_I32, [_I64] * 5 + [_I32] * 3 + [_P]),
    "wna16_cuda_moe_gemm_v3_workspace": (_I32, [_I64] * 5 + [_I32] * 3 + [_P]),
    "wna16_cuda_moe_gemm_v3": (_I32, [_P] * 11 + [_I64] * 6 + [_I32] * 5 + [_P]),
}


class NativeLib:
    """A loaded library: attribute access gives the C functions, `call` checks the return code."""

    def __init__(self, path: Path, protos: CPrototypes):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in protos.items():
            fn = getattr(self._lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = self._lib.wna16_abi_version()
        if version != ABI_VERSION:
            raise KernelBuildError(f"{path} has ABI version {version}, expected {ABI_VERSION}")

    def __getattr__(self, name: str):
        return getattr(self._lib, name)

    def call(self, name: str, *args: object) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != WNA16_OK:
            msg = self._lib.wna16_last_error() or b""
            raise KernelError(f"{name}: {msg.decode(errors='replace')} (code {rc})", rc)


_load_lock = threading.Lock()
_libs: dict[str, Optional[NativeLib]] = {}


def _load(kind: str) -> Optional[NativeLib]:
    """The library of `kind` ("host" / "cuda"), building it on first use; None (after one notice)
    when it cannot be had."""
    if native_disabled():
        return None
    with _load_lock:
        if kind in _libs:
            return _libs[kind]
        lib: Optional[NativeLib] = None
        try:
            if kind == "host":
                lib = NativeLib(build_host(), _HOST_PROTOS)
            elif kind == "headers":
                lib = NativeLib(build_header_scan(), _HEADER_SCAN_PROTOS)
            elif _torch_sees_cuda():
                lib = NativeLib(build_cuda(), _CUDA_PROTOS)
            else:  # nothing runs on a GPU here, so there is nothing to fall back from
                log.debug("torch sees no CUDA device: CUDA kernels not built")
        except (KernelBuildError, OSError, ValueError) as exc:
            if kind != "headers":  # the Python header reader gives the same answers: nothing to tell
                _notice(f"wna16ctl native {kind} kernels unavailable ({str(exc).splitlines()[0]})")
            log.debug("native %s build/load failure:\n%s", kind, exc)
        _libs[kind] = lib
        return lib


def host_lib() -> Optional[NativeLib]:
    return _load("host")


def loaded_host_lib() -> NativeLib:
    """The host library, for code that runs only where `host_lib()` has loaded it."""
    lib = host_lib()
    if lib is None:
        raise KernelBuildError("the native host library is not loaded")
    return lib


def header_scan_lib() -> Optional[NativeLib]:
    """The checking header reader (kernels/header_scan.cpp), or None: inspect then reads in Python."""
    return _load("headers")


def cuda_lib() -> Optional[NativeLib]:
    return _load("cuda")


def native_host_available() -> bool:
    """Whether the native CPU library is usable (builds it on first call)."""
    return host_lib() is not None


def cuda_available() -> bool:
    """Whether a CUDA device is visible and the CUDA library is usable (builds it on first call)."""
    return cuda_lib() is not None




def _torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
