"""A rank's process: load its shard (on GPU `rank`, joining the NCCL communicator; or on the CPU, its collectives
through rank 0 over the pipe), then run what rank 0 sends.

Messages on the pipe: (operation, args) -> ("ok", detail) once the operation is queued on the GPU, or ("error",
message); None (or rank 0 going away) ends the process.
"""
from __future__ import annotations

import signal


def rank_main(path: str, shard, device: str, unique_id, widths: list[int], exact: bool, kv_f32: bool, cuda,
              conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is rank 0's to handle
    conn.send(("ok", "started"))                          # rank 0 joins NCCL only once every rank is this far
    try:
        from ..backends import get_backend
        from ..gguf import GGUFFile
        from ..model import load_model
        from .group import RankState
        if device == "cuda":
            import cupy as cp
            cp.cuda.Device(shard.rank).use()
            from .comm import NcclComm
            backend = get_backend("cuda", kv_f32=kv_f32, cuda=cuda)
            backend.comm = NcclComm(shard.size, unique_id, shard.rank, widths)
        else:
            from .comm import PipeComm
            backend = get_backend("cpu", exact)
            backend.comm = PipeComm(conn)
        state = RankState(backend, load_model(GGUFFile(path), backend, shard))
        backend.prepare_kernels()
        conn.send(("ok", list(shard.expanded)))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        op, args = msg
        try:
            getattr(state, op)(*args)
            conn.send(("ok", None))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
