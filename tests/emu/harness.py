"""Build and run the emulated kernels (kernels/*.cu + tests/emu/probes.cu on kernels/emu/).

Three builds of one test driver (tests/emu/runner.cpp): plain, ThreadSanitizer, and
AddressSanitizer + UndefinedBehaviorSanitizer. Objects are cached by a digest of their inputs
(the source, every header, the flags and the compiler version) in the native-kernel cache, so a
test run compiles each once and a source tree with one file changed recompiles only that file.
Inputs go to the driver as raw files; outputs come back as tensors.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from wna16ctl.native import ops as K

EMU_DIR = Path(__file__).resolve().parent
# the driver links every CUDA source of kernels/ (kernels and launchers) and the error store
TEST_SOURCES = ("probes.cu", "runner.cpp")


def kernel_sources(kernels: Path) -> list[Path]:
    return [*sorted(kernels.glob("*.cu")), kernels / "error.cpp"]

FLAVOURS: dict[str, tuple[str, ...]] = {
    "plain": ("-O2",),
    "tsan": ("-O1", "-g", "-fsanitize=thread"),
    "asan": ("-O0", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=undefined"),
}
_COMMON = ("-std=c++17", "-pthread", "-Wall", "-Wextra", "-Wpedantic", "-Werror")

# sanitizer reports fail the driver with this exit code (and abort on the first error)
SAN_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1 exitcode=66 report_signal_unsafe=0",
    "ASAN_OPTIONS": "halt_on_error=1 exitcode=66 detect_leaks=0",
    "UBSAN_OPTIONS": "halt_on_error=1 exitcode=66 print_stacktrace=1",
}


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)


def _included_headers(src: Path, kernels: Path) -> list[Path]:
    """The headers of ours that `src` includes, directly or through another, in any #if branch
    (a superset of what one build reads). An object is keyed on these alone, so that a mutant of one
    header recompiles the sources that include it, not every kernel of the library."""
    found: set[Path] = set()
    todo = [src]
    while todo:
        current = todo.pop()
        for name in _INCLUDE.findall(current.read_text()):
            for base in (current.parent, kernels):
                path = (base / name).resolve()
                if path.is_file():
                    if path not in found:
                        found.add(path)
                        todo.append(path)
                    break
    return sorted(found)


def build(flavour: str, kernels: Optional[Path] = None) -> Path:
    """The driver for `flavour`, built from `kernels` (default: the checkout's kernels/)."""
    cxx = K.find_cxx()
    if cxx is None:
        raise K.KernelBuildError("no C++ compiler (g++) on PATH")
    kernels = kernels or K.kernels_dir()
    flags = [*_COMMON, *FLAVOURS[flavour]]
    version = K._tool_version(cxx)
    out = K._build_dir() / "emu"
    out.mkdir(parents=True, exist_ok=True)
    sources = kernel_sources(kernels) + [EMU_DIR / s for s in TEST_SOURCES]
    objs: list[Path] = []
    cmds: list[list[str]] = []
    for src in sources:
        headers = [p.name.encode() + p.read_bytes() for p in _included_headers(src, kernels)]
        key = K._digest([src.name, src.read_bytes(), *headers, version, *flags])
        obj = out / f"{src.stem}-{flavour}-{key}.o"
        objs.append(obj)
        if obj.exists():
            continue
        lang = ["-x", "c++"] if src.suffix == ".cu" else []
        cmds.append([cxx, *flags, "-I", str(kernels), *lang, "-c", str(src), "-o", str(obj)])
    exe = out / f"runner-{flavour}-{K._digest([o.name for o in objs])}"
    if exe.exists() and not cmds:
        return exe
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        # each object to a temporary name, then renamed (concurrent test runs stay safe)
        staged = []
        for cmd in cmds:
            final = Path(cmd[-1])
            cmd[-1] = str(Path(tmp) / final.name)
            staged.append((Path(cmd[-1]), final))
        link = [cxx, *flags, *map(str, objs), "-o", str(Path(tmp) / "runner")]
        if cmds:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as pool:
                for fut in [pool.submit(K._run, c, "compile") for c in cmds]:
                    fut.result()
            for tmp_obj, final in staged:
                os.replace(tmp_obj, final)
        K._run(link, "link")
        os.replace(Path(tmp) / "runner", exe)
    return exe


def mutated_kernels(tmp: Path, file: str, old: str, new: str) -> Path:
    """A copy of kernels/ with `old` replaced by `new` (exactly once) in `file`."""
    dst = tmp / "kernels"
    shutil.copytree(K.kernels_dir(), dst, ignore=shutil.ignore_patterns("__pycache__"))
    text = (dst / file).read_text()
    assert text.count(old) == 1, f"{file}: {old!r} occurs {text.count(old)} times"
    (dst / file).write_text(text.replace(old, new))
    return dst


@dataclass
class Result:
    returncode: int  # the driver's exit status (66: a sanitizer report; -6: an emulator abort)
    rc: int  # the launcher's return code (WNA16_OK = 0)
    message: str  # the launcher's last error
    stderr: str
    outputs: dict[str, bytes]

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = torch.frombuffer(bytearray(self.outputs[name]), dtype=dtype).clone()
        return t.reshape(shape) if shape is not None else t


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def run(exe: Path, op: str, bufs: Mapping[str, Optional[torch.Tensor]], ints: Mapping[str, int] = {},
        outs: tuple[str, ...] = (), dev: Mapping[str, int] = {}, timeout: float = 300) -> Result:
    """Run `op` on the driver `exe`; buffers that are None are passed as NULL."""
    with tempfile.TemporaryDirectory(prefix="wna16-emu-") as tmp:
        d = Path(tmp)
        lines = [f"op {op}"]
        for name, t in bufs.items():
            if t is None:
                continue
            (d / f"{name}.bin").write_bytes(_raw(t))
            lines.append(f"buf {name}")
        lines += [f"int {k} {int(v)}" for k, v in ints.items()]
        lines += [f"dev {k} {int(v)}" for k, v in dev.items()]
        lines += [f"out {o}" for o in outs]
        (d / "args.txt").write_text("\n".join(lines) + "\n")
        env = {**os.environ, **SAN_ENV}
        cmd = [str(exe), str(d)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if "unexpected memory mapping" in proc.stderr and shutil.which("setarch"):
            # ThreadSanitizer of older compilers and a kernel with high-entropy ASLR: run without it
            proc = subprocess.run(["setarch", os.uname().machine, "-R", *cmd], capture_output=True, text=True,
                                  timeout=timeout, env=env)
        rc, message = -1, ""
        head = proc.stdout.split("\n", 1)
        if head and head[0].startswith("rc "):
            rc = int(head[0][3:])
            message = head[1].strip() if len(head) > 1 else ""
        outputs = {o: (d / f"{o}.out").read_bytes() for o in outs if (d / f"{o}.out").exists()}
        return Result(proc.returncode, rc, message, proc.stderr, outputs)
