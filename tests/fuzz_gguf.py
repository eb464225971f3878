"""Mutated GGUF files, and the check every one must pass: an error of the engine's own kinds, on one line, or success.

    case = mutate(header, rng)                      # header = Header.read(path): metadata entries, tensor table
    write_case(out_path, case, src_path, header)    # the mutated header, then the source file's tensor data
    problem = check_file(out_path, generate=True)   # None, or what went wrong (a traceback's last line, ...)

Mutations: a metadata value replaced by one of another type or range (0, -1, 2^32, 2^64-1, NaN, inf, an array, a
string with control characters), an entry dropped or duplicated, a tensor's dims, type or offset changed, a tensor
duplicated, random bytes flipped in the header, the file cut short. tests/test_fuzz.py runs a few hundred on CI;
scripts/fuzz.py runs thousands with a time and memory bound per file.
"""
from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from engine.gguf import _NP_SCALARS, _SCALARS, T_ARRAY, T_STRING, GGUFFile

_U64 = [0, 1, 2, 3, 255, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40, 2 ** 63 - 1, 2 ** 64 - 1]
_KEYS = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
         "attention.key_length", "rope.dimension_count", "rope.freq_base", "attention.layer_norm_rms_epsilon",
         "context_length", "vocab_size", "attention.sliding_window"]


@dataclass
class Header:
    version: int
    kv: list = field(default_factory=list)        # [key, value type, value]
    tensors: list = field(default_factory=list)   # [name, dims, type id, offset]
    alignment: int = 32
    data_offset: int = 0                          # where the source file's tensor data starts

    @classmethod
    def read(cls, path) -> "Header":
        f = GGUFFile(path)
        raw = open(path, "rb")
        h = cls(f.version, alignment=int(f.metadata.get("general.alignment", 32)), data_offset=f.data_offset)
        # value types are not kept by GGUFFile: read them again with a light walk
        raw.seek(24)
        for key, value in f.metadata.items():
            n = struct.unpack("<Q", raw.read(8))[0]
            raw.seek(n, 1)
            vtype = struct.unpack("<I", raw.read(4))[0]
            etype = None
            if vtype == T_ARRAY:
                etype = struct.unpack("<I", raw.read(4))[0]
            _skip_value(raw, vtype, etype)
            h.kv.append([key, (vtype, etype), value])
        for name, t in f.tensors.items():
            h.tensors.append([name, list(t.shape), int(t.type), t.offset - f.data_offset])
        return h

    def to_bytes(self) -> bytes:
        out = io.BytesIO()
        out.write(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv)))
        for key, (vtype, etype), value in self.kv:
            out.write(_str(key) + struct.pack("<I", vtype))
            _write_value(out, vtype, etype, value)
        for name, dims, type_id, offset in self.tensors:
            out.write(_str(name) + struct.pack("<I", len(dims)))
            out.write(b"".join(struct.pack("<Q", d % 2 ** 64) for d in dims))
            out.write(struct.pack("<IQ", type_id % 2 ** 32, offset % 2 ** 64))
        return out.getvalue()


def _str(s: str) -> bytes:
    b = s.encode("utf-8", errors="surrogatepass")
    return struct.pack("<Q", len(b)) + b


def _skip_value(raw, vtype, etype) -> None:
    if vtype in _SCALARS:
        raw.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == T_STRING:
        raw.seek(struct.unpack("<Q", raw.read(8))[0], 1)
    elif vtype == T_ARRAY:
        count = struct.unpack("<Q", raw.read(8))[0]
        if etype in _NP_SCALARS:
            raw.seek(count * np.dtype(_NP_SCALARS[etype]).itemsize, 1)
        else:
            for _ in range(count):
                _skip_value(raw, etype, None)


def _write_value(out, vtype, etype, value) -> None:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        try:
            out.write(struct.pack(fmt, value))
        except (struct.error, TypeError, OverflowError):
            out.write(struct.pack(fmt, 0))
    elif vtype == T_STRING:
        out.write(_str(str(value)))
    elif vtype == T_ARRAY:
        items = list(value) if isinstance(value, (list, np.ndarray)) else [value]
        out.write(struct.pack("<IQ", etype, len(items)))
        if etype in _NP_SCALARS:
            out.write(np.asarray(items).astype(_NP_SCALARS[etype]).tobytes())
        else:
            for item in items:
                _write_value(out, etype, None, item)


def _bad_value(rng):
    """(value type, element type, value): a value of some other type or an extreme of its range."""
    pick = int(rng.integers(0, 9))
    if pick == 0:
        return (10, None), int(rng.choice(_U64))                                # u64
    if pick == 1:
        return (5, None), int(rng.choice([0, -1, -2 ** 31, 2 ** 31 - 1]))        # i32
    if pick == 2:
        return (6, None), float(rng.choice([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e30]))
    if pick == 3:
        return (T_ARRAY, 4), [int(x) for x in rng.integers(0, 100, int(rng.integers(0, 4)))]
    if pick == 4:
        return (T_STRING, None), "\x1b[31mred\x1b[0m\x07" * int(rng.integers(1, 2000))
    if pick == 5:
        return (7, None), bool(rng.integers(0, 2))
    if pick == 6:
        return (4, None), int(rng.integers(0, 2 ** 32))
    if pick == 7:
        return (T_ARRAY, T_STRING), ["x"] * int(rng.integers(0, 3))
    return (12, None), float(rng.choice([np.nan, 1e308, 5e-324]))


def mutate(h: Header, rng) -> tuple[bytes, int | None]:
    """-> (header bytes, cut) where cut is a length to truncate the whole file to, or None."""
    import copy
    m = copy.deepcopy(h)
    kind = int(rng.integers(0, 10))
    arch = next((v for k, _, v in m.kv if k == "general.architecture"), "llama")
    if kind <= 2 and m.kv:                              # a hyperparameter or another entry gets a bad value
        keys = [i for i, (k, _, _) in enumerate(m.kv) if any(k.endswith(s) for s in _KEYS)]
        i = int(rng.choice(keys)) if keys and kind < 2 else int(rng.integers(0, len(m.kv)))
        m.kv[i][1], m.kv[i][2] = _bad_value(rng)
    elif kind == 3 and m.kv:                            # an entry dropped or duplicated
        i = int(rng.integers(0, len(m.kv)))
        if rng.integers(0, 2):
            del m.kv[i]
        else:
            m.kv.insert(i, copy.deepcopy(m.kv[i]))
    elif kind == 4:                                      # a new, inconsistent entry
        key = f"{arch}.{rng.choice(_KEYS)}"
        m.kv = [e for e in m.kv if e[0] != key] + [[key, *_bad_value(rng)]]
    elif kind in (5, 6) and m.tensors:                  # a tensor's dims, type or offset
        t = m.tensors[int(rng.integers(0, len(m.tensors)))]
        part = int(rng.integers(0, 4))
        if part == 0:
            t[1][int(rng.integers(0, len(t[1])))] = int(rng.choice(_U64))
        elif part == 1:
            t[2] = int(rng.choice([0, 1, 2, 8, 12, 14, 30, 99, 2 ** 32 - 1]))
        elif part == 2:
            t[3] = int(rng.choice(_U64 + [t[3] + 32, max(0, t[3] - 32)]))
        else:
            t[1] = t[1] + [1] if len(t[1]) < 4 else t[1][:1]
    elif kind == 7 and m.tensors:                       # a tensor listed twice, or a name changed
        i = int(rng.integers(0, len(m.tensors)))
        if rng.integers(0, 2):
            m.tensors.insert(i, copy.deepcopy(m.tensors[i]))
        else:
            m.tensors[i][0] = m.tensors[i][0] + "\x1b[2J"
    data = bytearray(m.to_bytes())
    if kind == 8:                                        # random bytes flipped in the header
        for _ in range(int(rng.integers(1, 9))):
            pos = int(rng.integers(4, len(data)))
            data[pos] = int(rng.integers(0, 256))
    cut = None
    if kind == 9:                                        # the file cut short
        cut = int(rng.integers(0, len(data) + 4096))
    return bytes(data), cut


def write_case(path, case: tuple[bytes, int | None], src_path, h: Header) -> None:
    """The mutated header, padding to the alignment, then the source's tensor data (cut if the case says so)."""
    header, cut = case
    pad = (-len(header)) % h.alignment
    with open(path, "wb") as out, open(src_path, "rb") as src:
        out.write(header + b"\0" * pad)
        src.seek(h.data_offset)
        size = os.path.getsize(src_path) - h.data_offset
        if cut is not None:
            size = max(0, min(size, cut - len(header) - pad))
        while size > 0:
            chunk = src.read(min(size, 1 << 24))
            if not chunk:
                break
            out.write(chunk)
            size -= len(chunk)
    if cut is not None and cut < len(header):
        os.truncate(path, cut)


CLEAN_ERRORS = ("GGUFError", "ModelLoadError", "TokenizerError", "NonFiniteLogitsError")
MAX_MESSAGE = 300


def check_file(path, generate: bool = False) -> str | None:
    """Open, describe and load a file (generate 2 tokens on the CPU when asked, else load with shape checks only):
    None if it worked or failed with one of CLEAN_ERRORS on one printable line under MAX_MESSAGE characters
    (after the path); otherwise what went wrong."""
    from engine.model import load_model
    from engine.model.config import ModelConfig
    from engine.tokenizer import Tokenizer
    try:
        f = GGUFFile(path)
        ModelConfig.from_gguf(f)
        tok = Tokenizer(f)
        if generate:
            from engine.runtime import Runtime
            rt = Runtime(f, device="cpu", n_ctx=64)
            list(rt.generate(tok.encode("hi") or [0], max_tokens=2))
        else:
            load_model(f, ShapeOnly())
    except Exception as e:   # noqa: BLE001 - sorting every error is the point
        name, msg = type(e).__name__, str(e).replace(str(path), "FILE")
        if name not in CLEAN_ERRORS:
            return f"{name}: {msg[:300]}"
        if "\n" in msg or len(msg) > MAX_MESSAGE or not msg.isprintable():
            return f"unclean message ({len(msg)} chars): {msg[:120]!r}"
    return None


class ShapeOnly:
    """A backend stand-in for loading: weights are checked by the model's shape checks but not unpacked."""
    name = "shape-only"

    def weight(self, info, data):
        return info.np_shape
