"""A tensor-parallel group as the rest of the engine sees it: one model, one cache, one backend.

Rank 0 lives in the caller's process (the CLI, the server's engine core): it holds its own shard and runs the
scheduler. Every forward and cache operation is sent to the other ranks first, then run on rank 0; the ranks meet in
the forward's collectives (engine/parallel/comm.py), and rank 0 gets the whole logits.

- On the CPU the other ranks are threads of this process (the stand-in CI tests: the same shards and forward code),
  or with processes=True processes, as on GPUs, their collectives through rank 0's pipes (the GPU ranks' protocol,
  tested where no GPU is).
- On GPUs each rank is a process of its own on GPU `rank` (engine/parallel/worker.py), fed over a pipe, NCCL between.
- Ranks on other hosts (ParallelConfig.local below size) connect to rank 0 over TCP (`engine tp-worker`), announce
  their rank and receive their job; then they are fed like the local ones, over that connection.

    backend, model = load_parallel(gguf, 2, device="cuda")
    cache = model.new_cache(n_blocks, block_size)
    logits = backend.forward(model, batch, cache)
"""
from __future__ import annotations

import multiprocessing
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from ..backends import BackendError, cuda_available, get_backend
from ..gguf import GGUFFile
from ..model import load_model
from ..model.config import ModelConfig
from .comm import LocalComm, NcclComm, PipeHub, ThreadGroup, disable_nvlink_multicast
from .config import ParallelConfig, address
from .shard import ffn_units, plan

START_TIMEOUT_S = 120.0     # a GPU rank's process starting (importing the engine)
READY_TIMEOUT_S = 900.0     # a GPU rank loading its shard (and its kernels)
JOIN_TIMEOUT_S = 600.0      # the ranks of other hosts connecting


class ParallelError(RuntimeError):
    pass


class RankState:
    """One rank: its backend, model shard and cache, and the operations rank 0 sends it."""

    def __init__(self, backend, model):
        self.backend, self.model, self.cache = backend, model, None

    def set_context(self, n_ctx):
        self.model.set_context(n_ctx)

    def new_cache(self, n_blocks, block_size, kv_type=None):
        self.cache = self.model.new_cache(n_blocks, block_size, kv_type)
        return self.cache

    def forward(self, batch):
        return self.backend.forward(self.model, batch, self.cache)

    def copy_prefix(self, src, dst, n):
        self.cache.copy_prefix(src, dst, n)


class ThreadRank:
    """A rank that is a thread of this process (its operations run in order on its own thread)."""

    def __init__(self, state: RankState, group: ThreadGroup):
        self.state, self.group = state, group
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="engine-rank")
        self.pending = None

    def submit(self, op: str, *args) -> None:
        def run():
            try:
                getattr(self.state, op)(*args)
            except BaseException:
                self.group.abort()           # the others wait in a collective: release them
                raise
        self.pending = self.pool.submit(run)

    def wait(self) -> None:
        self.pending.result()

    def cause(self, timeout: float = 5.0) -> str | None:
        """This rank's own failure in the operation under way (after the group's barrier was broken), if any."""
        try:
            self.pending.result(timeout)
        except (threading.BrokenBarrierError, TimeoutError):
            return None                           # released by another rank's failure (or still running)
        except Exception as e:
            return f"tensor-parallel rank {self.state.model.shard.rank}: {type(e).__name__}: {e}"
        return None

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class ProcessRank:
    """A rank that is a process (on its own GPU); each operation is acknowledged once done (on a GPU: queued).
    process: the local process, or None for a rank of another host (only its connection is known here)."""

    def __init__(self, rank: int, process, conn):
        self.rank, self.process, self.conn = rank, process, conn

    def _stopped(self) -> str:
        how = f"exit code {self.process.exitcode}" if self.process is not None else "its connection closed"
        return f"tensor-parallel rank {self.rank} stopped ({how})"

    def submit(self, op: str, *args) -> None:
        try:
            self.conn.send((op, args))
        except OSError:
            raise ParallelError(self._stopped()) from None

    def wait(self, timeout: float | None = None):
        """-> the operation's detail (at load: the tensor parts it holds as f32)."""
        if timeout is not None and not self.conn.poll(timeout):
            raise ParallelError(f"tensor-parallel rank {self.rank} did not answer in {timeout:.0f} s")
        try:
            status, detail = self.conn.recv()
        except (EOFError, OSError):
            raise ParallelError(self._stopped()) from None
        if status != "ok":
            raise ParallelError(f"tensor-parallel rank {self.rank}: {detail}")
        return detail

    def cause(self) -> None:
        """(A process rank's failure reaches rank 0 inside the collective itself: comm.CollectiveError.)"""
        return None

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        if self.process is None:
            self.conn.close()
            return
        self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()


class ParallelGroup:
    """Rank 0's state and handles on the others; run() sends an operation to all and returns rank 0's result."""

    def __init__(self, local: RankState, ranks: list, on_error=None):
        self.local, self.ranks, self.on_error = local, ranks, on_error
        self.broken: str | None = None

    @property
    def size(self) -> int:
        return 1 + len(self.ranks)

    def run(self, op: str, *args):
        if self.broken:
            raise ParallelError(f"the tensor-parallel group is broken ({self.broken}); restart the engine")
        try:
            for r in self.ranks:
                r.submit(op, *args)
            try:
                out = getattr(self.local, op)(*args)
            except BaseException as e:
                if self.on_error:
                    self.on_error()
                cause = next((c for c in (r.cause() for r in self.ranks) if c is not None), None)
                if cause is None:
                    raise
                raise ParallelError(cause) from e     # another rank's failure is why rank 0's collective broke
            for r in self.ranks:
                r.wait()
            return out
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def close(self) -> None:
        for r in self.ranks:
            r.close()
        self.ranks = []


class ParallelCache:
    """Rank 0's KV cache; copy_prefix runs on every rank."""

    def __init__(self, group: ParallelGroup, local):
        self.group, self.local = group, local

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.group.run("copy_prefix", src, dst, n)

    def __getattr__(self, name):
        return getattr(self.local, name)


class ParallelModel:
    """Rank 0's model shard; set_context and new_cache run on every rank."""

    def __init__(self, group: ParallelGroup):
        self.group = group
        self.local = group.local.model

    def set_context(self, n_ctx) -> None:
        self.group.run("set_context", n_ctx)

    def new_cache(self, n_blocks: int, block_size: int, kv_type: str | None = None) -> ParallelCache:
        return ParallelCache(self.group, self.group.run("new_cache", n_blocks, block_size, kv_type))

    def __getattr__(self, name):
        return getattr(self.local, name)


class ParallelBackend:
    """Rank 0's backend; forward runs on every rank (rank 0 returns the whole logits), the rest is rank 0's."""

    def __init__(self, group: ParallelGroup):
        self.group = group
        self.inner = group.local.backend
        self.tensor_parallel = group.size

    def forward(self, model, batch, cache):
        return self.group.run("forward", batch)

    @property
    def failure(self) -> str | None:
        """Why the group can no longer run (a rank stopped or failed), or None."""
        return self.group.broken and f"the tensor-parallel group is broken ({self.group.broken})"

    def close(self) -> None:
        self.group.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def load_parallel(gguf: GGUFFile, parallel: ParallelConfig | int, device: str = "auto", exact: bool = False,
                  kv_f32: bool = False, cuda=None, processes: bool = False) -> tuple[ParallelBackend, ParallelModel]:
    """The model split over ranks (ParallelConfig, or just their number): one process per GPU on CUDA; threads on the
    CPU, or processes (processes=True, or ranks on other hosts)."""
    cfg = ParallelConfig.of(parallel)
    cfg.validate()
    model_cfg = ModelConfig.from_gguf(gguf)
    shards = plan(model_cfg, cfg.size, ffn_units(gguf, model_cfg))
    if device == "auto":
        device = "cuda" if not exact and cuda_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise BackendError(f"unknown device {device!r} (cpu, cuda or auto)")
    if device == "cpu" and not processes and cfg.n_local == cfg.size:
        group = ThreadGroup(cfg.size)
        states = []
        for shard in shards:
            backend = get_backend("cpu", exact)
            backend.comm = LocalComm(group, shard.rank)
            states.append(RankState(backend, load_model(gguf, backend, shard)))
        pg = ParallelGroup(states[0], [ThreadRank(s, group) for s in states[1:]], on_error=group.abort)
        return ParallelBackend(pg), ParallelModel(pg)
    return _load_processes(gguf, shards, cfg, device, exact, kv_f32, cuda)


def _load_processes(gguf: GGUFFile, shards, cfg: ParallelConfig, device: str, exact: bool, kv_f32: bool, cuda):
    """Ranks 1..local-1 as processes here (worker.rank_main), the others joining from other hosts, rank 0 here."""
    from .worker import rank_main
    size = len(shards)
    uid, widths = None, [len(s.vocab) for s in shards]
    if device == "cuda":
        import cupy as cp
        if not cuda_available() or cp.cuda.runtime.getDeviceCount() < cfg.n_local:
            n = cp.cuda.runtime.getDeviceCount() if cuda_available() else 0
            raise BackendError(f"--tensor-parallel {size}: {n} CUDA GPU(s) visible here, {cfg.n_local} ranks to hold")
        disable_nvlink_multicast()
        uid = NcclComm.unique_id()
    job = {"path": gguf.path, "device": device, "uid": uid, "widths": widths, "exact": exact, "kv_f32": kv_f32,
           "cuda": cuda}
    ctx = multiprocessing.get_context("spawn")
    ranks = []
    for shard in shards[1:cfg.n_local]:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(gguf.path, shard, device, uid, widths, exact, kv_f32, cuda, child),
                        name=f"engine-rank{shard.rank}", daemon=True)
        p.start()
        child.close()
        ranks.append(ProcessRank(shard.rank, p, parent))
    try:
        if cfg.n_local < size:
            ranks += _accept_remote_ranks(cfg, shards, job)
        for r in ranks:                    # (a rank that failed to start would leave NCCL's init waiting forever)
            r.wait(START_TIMEOUT_S)
        if device == "cuda":
            cp.cuda.Device(0).use()
            backend = get_backend("cuda", kv_f32=kv_f32, cuda=cuda)
            backend.comm = NcclComm(size, uid, 0, widths)            # joins when every rank has
        else:
            backend = get_backend("cpu", exact)
            backend.comm = PipeHub([r.conn for r in ranks])
        model = load_model(gguf, backend, shards[0])
        backend.prepare_kernels()
        expanded = shards[0].expanded + [name for r in ranks for name in r.wait(READY_TIMEOUT_S)]
    except BaseException:
        for r in ranks:
            if r.process is not None:
                r.process.terminate()
            else:
                r.conn.close()
        raise
    if expanded:
        print(f"engine: {len(expanded)} tensor parts held as f32 (a rank's split falls inside quant blocks), "
              f"e.g. {expanded[0]}", file=sys.stderr)
    pg = ParallelGroup(RankState(backend, model), ranks)
    return ParallelBackend(pg), ParallelModel(pg)


def _accept_remote_ranks(cfg: ParallelConfig, shards, job: dict) -> list[ProcessRank]:
    """Ranks local..size-1 from other hosts: each connects to cfg.listen with cfg.key, says its rank, gets the job
    and its shard. -> their ProcessRanks in rank order; ParallelError if they are not all there in JOIN_TIMEOUT_S."""
    from multiprocessing.connection import Listener
    listener = Listener(address(cfg.listen), authkey=cfg.key.encode())
    waiting = set(range(cfg.n_local, cfg.size))
    joined: dict[int, ProcessRank] = {}
    done = threading.Event()

    def accept():
        while waiting:
            try:
                conn = listener.accept()
                if not conn.poll(30):
                    conn.close()
                    continue
                tag, rank = conn.recv()
            except Exception:                     # a bad key, a stray connection; or the listener closed
                if done.is_set():
                    return
                continue
            if tag != "hello" or rank not in waiting:
                conn.send(("refused", f"rank {rank} is not one this group waits for ({sorted(waiting)})"))
                conn.close()
                continue
            conn.send(("job", {**job, "shard": shards[rank]}))
            waiting.discard(rank)
            joined[rank] = ProcessRank(rank, None, conn)
        done.set()

    thread = threading.Thread(target=accept, name="engine-tp-accept", daemon=True)
    thread.start()
    finished = done.wait(JOIN_TIMEOUT_S)
    done.set()
    listener.close()
    if not finished:
        raise ParallelError(f"ranks {sorted(waiting)} did not join at {cfg.listen} in {JOIN_TIMEOUT_S:.0f} s "
                            f"(start them with `engine tp-worker {cfg.listen} --ranks ...`)")
    return [joined[r] for r in sorted(joined)]
