"""Build hook: ship the kernel sources of `kernels/` inside the package.

`kernels/` stays the one copy in the repository; a built wheel carries it as
`wna16ctl/kernel_sources/`, where `wna16ctl.native.ops.kernels_dir()` finds it, so the native host
build and the CUDA build work after `pip install` as they do in a checkout.  (Editable installs
read `kernels/` in the checkout directly.)  Everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNEL_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        source = Path(__file__).resolve().parent / "kernels"
        target = Path(self.build_lib) / "wna16ctl" / "kernel_sources"
        # kernels/ and its emu/ folder (the CPU emulation that intrinsics.cuh includes on the host)
        files = sorted(p for p in (*source.iterdir(), *(source / "emu").iterdir())
                       if p.is_file() and p.suffix in KERNEL_SUFFIXES)
        if not files:
            raise RuntimeError(f"{source}: no kernel sources to package")
        for path in files:
            dest = target / path.relative_to(source)
            self.mkpath(str(dest.parent))
            self.copy_file(str(path), str(dest))


setup(cmdclass={"build_py": BuildPyWithKernels})
