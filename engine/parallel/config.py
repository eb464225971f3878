"""How a model is split over ranks, and where the ranks run."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """`size` ranks; ranks 0..local-1 start on this host (rank 0 in this process, the others one process each, on
    GPUs 0..local-1), ranks local..size-1 join from other hosts (`engine tp-worker`) over TCP at `listen`
    (HOST:PORT), authenticated by `key`. NCCL then connects the GPUs of all hosts itself."""
    size: int = 1
    local: int | None = None       # None: every rank on this host
    listen: str | None = None
    key: str | None = None

    @classmethod
    def of(cls, value: "ParallelConfig | int") -> "ParallelConfig":
        """A ParallelConfig from itself or a rank count."""
        return value if isinstance(value, cls) else cls(int(value))

    @property
    def n_local(self) -> int:
        return self.size if self.local is None else self.local

    def validate(self) -> None:
        if self.size < 1:
            raise ValueError("--tensor-parallel must be >= 1")
        if not 1 <= self.n_local <= self.size:
            raise ValueError(f"--tp-local must be between 1 and --tensor-parallel ({self.size})")
        if self.n_local < self.size and not (self.listen and self.key):
            raise ValueError("ranks on other hosts (--tp-local below --tensor-parallel) need --tp-listen and --tp-key")


def address(text: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)
