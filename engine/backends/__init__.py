"""Backend selection: `cpu` (numpy), `cuda` (CuPy + the project's kernels), `auto` (the GPU when CuPy sees one)."""
from __future__ import annotations

import dataclasses

from ..cuda.config import CudaConfig


class BackendError(RuntimeError):
    pass


def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def cuda_backend_built() -> bool:
    """Whether this version has a CUDA runtime backend (engine/backends/cuda.py); the kernels come first."""
    import importlib.util
    return importlib.util.find_spec(f"{__name__}.cuda") is not None


def get_backend(device: str = "auto", exact: bool = False, kv_f32: bool = False, cuda=None,
                batch_invariant: bool = False):
    """The backend for a device; kv_f32 selects an f32 KV cache on the GPU (the CPU cache is always f32/f64), cuda a
    CudaConfig (engine/cuda/config.py: forced kernel choices, CUDA graphs off); batch_invariant: each row's results
    independent of the other rows of its step (engine/backends/cpu.py, CudaConfig.batch_invariant)."""
    if device == "auto":
        device = "cuda" if not exact and cuda_backend_built() and cuda_available() else "cpu"
    if device == "cpu":
        from .cpu import CPUBackend
        return CPUBackend(exact=exact, batch_invariant=batch_invariant)
    if device == "cuda":
        if batch_invariant:
            try:
                cuda = dataclasses.replace(cuda or CudaConfig(), batch_invariant=True)
            except ValueError as e:
                raise BackendError(str(e)) from None
        if exact:
            raise BackendError("the exact (float64) mode runs on the CPU backend only")
        if not cuda_backend_built():
            raise BackendError("--device cuda: this version has the CUDA kernels (engine/cuda) but no CUDA runtime "
                               "backend yet; use --device cpu")
        if not cuda_available():
            raise BackendError("--device cuda: no CUDA GPU visible to CuPy (install engine[cuda] on a GPU machine)")
        from .cuda import CUDABackend
        return CUDABackend(kv_f32=kv_f32, config=cuda)
    raise BackendError(f"unknown device {device!r} (cpu, cuda or auto)")
