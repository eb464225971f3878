"""Builds the CUDA kernels ahead of time (engine/cuda/aot.py) into the package when nvcc is on the machine.

Without nvcc the package installs without them, and the engine compiles the kernels it needs with NVRTC on first use.
"""
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_kernels(build_py):
    def run(self):
        super().run()
        sys.path.insert(0, str(Path(__file__).parent))
        from engine.cuda import aot, build

        if aot.find_nvcc() is None:
            print("engine: nvcc not found; the CUDA kernels will be compiled with NVRTC on first use", file=sys.stderr)
            return
        # an editable install loads the package from the source tree: build there
        out = build.PREBUILT_DIR if self.editable_mode else Path(self.build_lib) / "engine" / "cuda" / "prebuilt"
        if aot.is_current(out):
            print(f"engine: the CUDA kernels in {out} are built from these sources", file=sys.stderr)
            return
        aot.build_all(out, log=lambda msg: print(msg, file=sys.stderr))


setup(cmdclass={"build_py": build_py_with_kernels})
