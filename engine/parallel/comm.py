"""The collectives a tensor-parallel forward needs: all-reduce of partial products, gather of vocabulary columns.

- ThreadGroup / LocalComm: ranks that are threads of one process over numpy arrays (the CPU stand-in CI tests).
- PipeHub / PipeComm: ranks that are processes on the CPU, their arrays through rank 0 over the pipes that carry the
  operations (what CI runs of the GPU ranks' process protocol).
- NcclComm: one process per GPU, NCCL through CuPy's bindings, on the current stream (so it is captured in the CUDA
  graphs of a step like any kernel).

Both sum in rank order, so every rank gets the same bits.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

BARRIER_TIMEOUT_S = 600.0     # a rank that never arrives (it failed) breaks the others' wait instead of hanging it


def disable_nvlink_multicast() -> None:
    """NCCL's NVLink multicast (NVLS) stays off: on shared hosts it can put the GPUs out of service."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def sum_in_rank_order(parts: list):
    """parts[0] + parts[1] + ... left to right (every rank, summing the same list, gets the same bits)."""
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total


class ThreadGroup:
    """The rendezvous of `size` ranks that are threads: each collective posts every rank's array, then each reads all."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)
        self.slots: list = [None] * size

    def abort(self) -> None:
        """Release every waiting rank with an error (one rank failed)."""
        self.barrier.abort()


class LocalComm:
    """Rank `rank` of a ThreadGroup."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank

    def _exchange(self, x) -> list:
        g = self.group
        g.slots[self.rank] = x
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()                     # nobody posts the next collective's array before all have read
        return parts

    def all_reduce(self, x):
        return sum_in_rank_order(self._exchange(x))

    def gather_columns(self, x):
        return np.concatenate(self._exchange(x), axis=-1)


class CollectiveError(RuntimeError):
    """A rank failed inside a collective (its message is the failure)."""


class PipeComm:
    """A CPU rank process's side: its array to rank 0 over its pipe, the sum back."""

    def __init__(self, conn):
        self.conn = conn

    def all_reduce(self, x):
        self.conn.send(("partial", x))
        tag, total = self.conn.recv()
        if tag != "sum":
            raise CollectiveError(f"rank 0: {total}")
        return total

    def gather_columns(self, x):
        self.conn.send(("partial", x))
        return x                              # the whole logits are rank 0's only


class PipeHub:
    """Rank 0's side of PipeComm: the other ranks' arrays from their pipes, summed (or joined) in rank order."""

    def __init__(self, conns: list):
        self.conns = conns

    def _parts(self, x) -> list:
        parts = [x]
        for r, conn in enumerate(self.conns, 1):
            try:
                tag, value = conn.recv()
            except (EOFError, OSError):
                raise CollectiveError(f"rank {r} stopped") from None
            if tag != "partial":
                raise CollectiveError(f"rank {r}: {value}")
            parts.append(value)
        return parts

    def all_reduce(self, x):
        total = sum_in_rank_order(self._parts(x))
        for conn in self.conns:
            conn.send(("sum", total))
        return total

    def gather_columns(self, x):
        return np.concatenate(self._parts(x), axis=-1)


NCCL_FLOAT32, NCCL_SUM = 7, 0     # ncclDataType_t ncclFloat32, ncclRedOp_t ncclSum (nccl.h)


class CtypesNccl:
    """The few NCCL calls used here, straight from libnccl.so.2 (the nvidia-nccl wheel's, else the system's), for a
    CuPy built without its NCCL bindings; the same methods as cupy.cuda.nccl's."""

    class UniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_char * 128)]

    _lib = None

    @classmethod
    def lib(cls):
        if cls._lib is None:
            paths = []
            try:
                import nvidia.nccl
                paths = [os.path.join(p, "lib", "libnccl.so.2") for p in nvidia.nccl.__path__]
            except ImportError:
                pass
            for path in [*paths, "libnccl.so.2"]:
                try:
                    cls._lib = ctypes.CDLL(path)
                    break
                except OSError:
                    continue
            else:
                raise RuntimeError("NCCL not found: install nvidia-nccl-cu13 (or cupy with NCCL) for --tensor-parallel")
        return cls._lib

    @classmethod
    def get_unique_id(cls) -> bytes:
        uid = cls.UniqueId()
        cls._check(cls.lib().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def __init__(self, size: int, unique_id: bytes, rank: int):
        uid = self.UniqueId()
        uid.internal = unique_id
        self.comm = ctypes.c_void_p()
        self._check(self.lib().ncclCommInitRank(ctypes.byref(self.comm), size, uid, rank), "ncclCommInitRank")

    @classmethod
    def _check(cls, code: int, what: str) -> None:
        if code != 0:
            cls.lib().ncclGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {cls.lib().ncclGetErrorString(code).decode()}")

    def allReduce(self, send, recv, count, dtype, op, stream):   # noqa: N802 (cupy.cuda.nccl's names)
        p = ctypes.c_void_p
        self._check(self.lib().ncclAllReduce(p(send), p(recv), ctypes.c_size_t(count), dtype, op, self.comm,
                                             p(stream)), "ncclAllReduce")

    def allGather(self, send, recv, count, dtype, stream):       # noqa: N802
        p = ctypes.c_void_p
        self._check(self.lib().ncclAllGather(p(send), p(recv), ctypes.c_size_t(count), dtype, self.comm, p(stream)),
                    "ncclAllGather")


def nccl_binding():
    """(get_unique_id, Communicator class): CuPy's NCCL bindings where this CuPy has them, else CtypesNccl."""
    try:
        from cupy.cuda import nccl
        if getattr(nccl, "available", False):
            return nccl.get_unique_id, nccl.NcclCommunicator
    except ImportError:
        pass
    return CtypesNccl.get_unique_id, CtypesNccl


class NcclComm:
    """Rank `rank` of an NCCL communicator over `size` GPUs (one process each); `widths` are the ranks' column counts
    in gather_columns (their vocabulary rows)."""

    def __init__(self, size: int, unique_id, rank: int, widths: list[int]):
        disable_nvlink_multicast()
        self.comm = nccl_binding()[1](size, unique_id, rank)
        self.size, self.rank, self.widths = size, rank, widths

    @staticmethod
    def unique_id():
        disable_nvlink_multicast()
        return nccl_binding()[0]()

    def all_reduce(self, x):
        import cupy as cp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = cp.empty_like(x)
        self.comm.allReduce(x.data.ptr, y.data.ptr, x.size, NCCL_FLOAT32, NCCL_SUM, cp.cuda.get_current_stream().ptr)
        return y

    def gather_columns(self, x):
        import cupy as cp
        n, m = x.shape
        w = max(self.widths)
        send = cp.ascontiguousarray(x, dtype=cp.float32)
        if m < w:                                                    # every rank sends [n, w]
            send = cp.zeros((n, w), cp.float32)
            send[:, :m] = x
        parts = cp.empty((self.size, n, w), cp.float32)              # parts: [rank, n, w]
        self.comm.allGather(send.data.ptr, parts.data.ptr, n * w, NCCL_FLOAT32, cp.cuda.get_current_stream().ptr)
        return cp.concatenate([parts[r, :, :self.widths[r]] for r in range(self.size)], axis=1)
