"""Writes small GGUF files byte by byte, valid or deliberately broken, for the reader's tests."""
import struct

import numpy as np


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def build(version=3, n_kv_override=None, tensor_offset_override=None, array_len_override=None, type_id=0, arch="llama") -> tuple[bytes, int]:
    """A tiny llama-like file with one F32 tensor 'w' of shape [8, 2]; returns (bytes, data_offset)."""
    kv = [
        _str("general.architecture") + struct.pack("<I", 8) + _str(arch),
        _str(f"{arch}.block_count") + struct.pack("<II", 4, 1),
        _str("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, array_len_override or 2) + struct.pack("<ff", 0.5, 1.5),
    ]
    n_kv = len(kv) if n_kv_override is None else n_kv_override
    header = b"GGUF" + struct.pack("<IQQ", version, 1, n_kv) + b"".join(kv)
    offset = 0 if tensor_offset_override is None else tensor_offset_override
    header += _str("w") + struct.pack("<I", 2) + struct.pack("<QQ", 8, 2) + struct.pack("<IQ", type_id, offset)
    data_offset = (len(header) + 31) // 32 * 32
    data = np.arange(16, dtype=np.float32).tobytes()
    return header + b"\0" * (data_offset - len(header)) + data, data_offset
