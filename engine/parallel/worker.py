"""A rank's process: load its shard (on GPU `rank`, joining the NCCL communicator; or on the CPU, its collectives
through rank 0 over the pipe), then run what rank 0 sends.

Messages on the pipe (or, for a rank of another host, its TCP connection): first ("ok", "started"), then ("ok", the
tensor parts held as f32) once loaded; then each (operation, args) -> ("ok", None) once it is done (on a GPU: queued),
or ("error", message); None (or rank 0 going away) ends the process. On the CPU a forward's collectives travel on the
same pipe (comm.PipeComm).
"""
from __future__ import annotations

import signal
import sys


def rank_main(path: str, shard, device: str, unique_id, widths: list[int], exact: bool, kv_f32: bool, cuda,
              conn, gpu: int | None = None) -> None:
    """Rank shard.rank on GPU `gpu` (default: the rank's number; another host's ranks count from its own 0)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is rank 0's to handle
    conn.send(("ok", "started"))                          # rank 0 joins NCCL only once every rank is this far
    try:
        from ..backends import get_backend
        from ..gguf import GGUFFile
        from ..model import load_model
        from .group import RankState
        if device == "cuda":
            import cupy as cp
            cp.cuda.Device(shard.rank if gpu is None else gpu).use()
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


JOIN_RETRY_S = 0.2


def join_main(address: tuple[str, int], key: str, rank: int, gpu: int, model: str | None, timeout_s: float) -> int:
    """A rank on another host: connect to rank 0 (retrying until it listens), say which rank this is, receive the
    job (the model's path, unless `model` names this host's copy, the shard, the device, NCCL's id), run it."""
    import time
    from multiprocessing.connection import Client
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(address, authkey=key.encode())
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                print(f"engine: rank {rank}: nothing listens at {address[0]}:{address[1]}", file=sys.stderr)
                return 1
            time.sleep(JOIN_RETRY_S)
    conn.send(("hello", rank))
    tag, job = conn.recv()
    if tag != "job":
        print(f"engine: rank {rank}: refused: {job}", file=sys.stderr)
        return 1
    rank_main(model or job["path"], job["shard"], job["device"], job["uid"], job["widths"], job["exact"],
              job["kv_f32"], job["cuda"], conn, gpu)
    return 0


def join_process(*args) -> None:
    """join_main as a process's target: its result is the exit code."""
    raise SystemExit(join_main(*args))
