"""GGUF reader: the only module that touches a model file's bytes.

The file is memory-mapped; every read is bounds-checked against the file size before anything is allocated, so a
truncated or corrupt file raises GGUFError naming the file and the problem, never a crash, a hang or a huge allocation.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .quants import GGMLType, block_layout

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF metadata value types: id -> (name, struct format or None)
_U64 = struct.Struct("<Q")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
               12: "<f8"}
T_STRING, T_ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not a valid GGUF model; the message names the file and the problem."""


MAX_QUOTED = 80


def quoted(text: str, limit: int = MAX_QUOTED) -> str:
    """A string read from a file, safe to print: control characters escaped, at most `limit` characters once
    escaped (a control character takes up to 10)."""
    out, text = "", str(text)
    for i, c in enumerate(text):
        piece = c if c.isprintable() else repr(c)[1:-1]
        if len(out) + len(piece) > limit:
            return out + "..."
        out += piece
    return out


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLType
    shape: tuple[int, ...]   # ggml element order: shape[0] is the contiguous (row) dimension
    offset: int              # absolute byte offset in the file
    nbytes: int

    @property
    def np_shape(self) -> tuple[int, ...]:
        """The shape in numpy order (slowest dimension first), e.g. (rows, cols) of a weight matrix."""
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Bounds-checked sequential reads from the mapped file."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf, self.pos, self.path, self.size = memoryview(buf), 0, path, len(buf)   # slices of a memoryview are
        # cheap; a memmap's build a numpy object each (a 262k-token vocabulary: seconds)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated: {what} at byte {self.pos} needs {n} bytes, file has {self.size}")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        return self.strings(1, what)[0]

    def strings(self, count: int, what: str) -> list[str]:
        """count strings in a row, each its u64 length then UTF-8 bytes (bad bytes replaced); one loop for a
        vocabulary's 262k (Gemma 3)."""
        buf, pos, size, length = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.take(8, f"length of {what}")           # raises: truncated
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.take(n, what)                          # raises: truncated
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == T_STRING:
            return self.string(what)
        if vtype == T_ARRAY:
            etype = self.scalar("<I", f"element type of {what}")
            count = self.scalar("<Q", f"length of {what}")
            if etype in _NP_SCALARS:
                item = np.dtype(_NP_SCALARS[etype]).itemsize
                if count * item > self.size - self.pos:
                    raise self.fail(f"{what}: array claims {count} elements, more than the file holds")
                arr = np.frombuffer(self.take(count * item, what), dtype=_NP_SCALARS[etype]).copy()
                return arr.astype(bool) if etype == 7 else arr
            if etype == T_STRING:
                if count * 8 > self.size - self.pos:  # every string costs at least its 8-byte length
                    raise self.fail(f"{what}: array claims {count} strings, more than the file holds")
                return self.strings(count, what)
            if etype == T_ARRAY:
                if count > self.size - self.pos:
                    raise self.fail(f"{what}: array claims {count} nested arrays, more than the file holds")
                return [self.value(T_ARRAY, what) for _ in range(count)]
            raise self.fail(f"{what}: unknown array element type {etype}")
        raise self.fail(f"{what}: unknown metadata value type {vtype}")


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return f"the string '{quoted(value, 40)}'"
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)}"
    return f"a {type(value).__name__}"


class GGUFFile:
    """An opened, validated GGUF file: `metadata`, `tensors` (name -> TensorInfo), `tensor_data(name)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            self.file_size = os.path.getsize(self.path)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror or e}") from None
        if self.file_size == 0:
            raise GGUFError(f"{self.path}: empty file, not a GGUF model")
        if os.path.isdir(self.path):
            raise GGUFError(f"{self.path}: is a directory, not a GGUF model")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise GGUFError(f"{self.path}: cannot map file: {e}") from None
        cur = _Cursor(self._map, self.path)
        self._parse(cur)

    # -- parsing ---------------------------------------------------------------------------------------------
    def _parse(self, cur: _Cursor) -> None:
        if self.file_size < 4 or bytes(self._map[:4]) != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file (magic {bytes(self._map[:4])!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.scalar("<I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            raise cur.fail(f"unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        # each metadata entry needs >= 12 bytes (key length + type), each tensor entry >= 28 bytes
        if n_kv * 12 > self.file_size or n_tensors * 28 > self.file_size:
            raise cur.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, "
                           f"more than a {self.file_size}-byte file can hold")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar("<I", f"type of metadata '{quoted(key)}'")
            if key in self.metadata:
                raise cur.fail(f"metadata key '{quoted(key)}' appears twice")
            self.metadata[key] = cur.value(vtype, f"metadata '{quoted(key)}'")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            what = f"tensor '{quoted(name)}'"
            n_dims = cur.scalar("<I", f"dimension count of {what}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"{what} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            shape = tuple(cur.scalar("<Q", f"shape of {what}") for _ in range(n_dims))
            type_id = cur.scalar("<I", f"type of {what}")
            offset = cur.scalar("<Q", f"offset of {what}")
            infos.append((name, shape, type_id, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or \
                alignment & (alignment - 1) or alignment > 1 << 20:
            raise cur.fail(f"general.alignment {quoted(repr(alignment))} is not a power of two up to 2^20")
        self.data_offset = (cur.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in infos:
            if name in self.tensors:
                raise cur.fail(f"tensor '{quoted(name)}' appears twice")
            self.tensors[name] = self._check_tensor(name, shape, type_id, offset, alignment)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise cur.fail(f"the data of tensors '{quoted(a)}' and '{quoted(b)}' overlap")

    def _check_tensor(self, name, shape, type_id, offset, alignment) -> TensorInfo:
        where = f"{self.path}: tensor '{quoted(name)}'"
        try:
            gtype = GGMLType(type_id)
        except ValueError:
            raise GGUFError(f"{where} has unknown GGML type id {type_id}") from None
        if any(d <= 0 or d >= 2**40 for d in shape):
            raise GGUFError(f"{where} has invalid shape {list(shape)}")
        block, size = block_layout(gtype)
        if shape[0] % block:
            raise GGUFError(f"{where}: row length {shape[0]} is not a multiple of the {gtype.name} block size {block}")
        n_elements = int(np.prod(shape, dtype=object))
        nbytes = n_elements // block * size
        if offset % alignment:
            raise GGUFError(f"{where}: data offset {offset} is not aligned to {alignment}")
        start = self.data_offset + offset
        if start + nbytes > self.file_size:
            raise GGUFError(f"{where}: data [{start}, {start + nbytes}) runs past the end of the file "
                            f"({self.file_size} bytes): file truncated or corrupt")
        return TensorInfo(name, gtype, tuple(int(d) for d in shape), start, nbytes)

    # -- access ----------------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(f"{self.path}: metadata has no general.architecture string")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata by full key, or by a key relative to the architecture (`block_count` -> `llama.block_count`)."""
        if key in self.metadata:
            return self.metadata[key]
        arch = self.metadata.get("general.architecture")
        return self.metadata.get(f"{arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: required metadata '{key}' is missing")
        return value

    def integer(self, key: str, lo: int, hi: int, default: int | None = None) -> int:
        """An integer metadata value (required when default is None) within [lo, hi]."""
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise GGUFError(f"{self.path}: metadata '{key}' is {_kind(value)}, not an integer")
        if not lo <= int(value) <= hi:
            raise GGUFError(f"{self.path}: metadata '{key}' = {int(value)} is outside [{lo}, {hi}]")
        return int(value)

    def number(self, key: str, lo: float, hi: float, default: float) -> float:
        """A finite number metadata value within [lo, hi]."""
        value = self.get(key, default)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise GGUFError(f"{self.path}: metadata '{key}' is {_kind(value)}, not a number")
        if not np.isfinite(value) or not lo <= float(value) <= hi:
            raise GGUFError(f"{self.path}: metadata '{key}' = {float(value)!r} is outside [{lo:g}, {hi:g}]")
        return float(value)

    def tensor_data(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's bytes."""
        t = self.tensors[name]
        return self._map[t.offset:t.offset + t.nbytes]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors
