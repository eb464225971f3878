"""The GGUF reader: metadata, tensors, and a clear error for every kind of broken file."""
import struct
import subprocess
import sys

import numpy as np
import pytest

from engine.gguf import GGUFError, GGUFFile
from engine.quants import GGMLType
from gguf_craft import build


def write(tmp_path, data: bytes, name="m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_valid_file(tmp_path):
    data, _ = build()
    f = GGUFFile(write(tmp_path, data))
    assert f.architecture == "llama"
    assert f.get("block_count") == 1 and f.get("llama.block_count") == 1
    assert list(f.get("tokenizer.ggml.scores")) == [0.5, 1.5]
    t = f.tensors["w"]
    assert t.type == GGMLType.F32 and t.shape == (8, 2) and t.np_shape == (2, 8)
    assert np.array_equal(f.tensor_data("w").view(np.float32), np.arange(16, dtype=np.float32))


def broken_files():
    good, data_offset = build()
    v99 = bytearray(good)
    v99[4:8] = struct.pack("<I", 99)
    return {
        "empty": (b"", "empty file"),
        "wrong magic": (b"GGML" + good[4:], "not a GGUF file"),
        "version 99": (bytes(v99), "unsupported GGUF version 99"),
        "cut at 50% of header": (good[:data_offset // 2], "truncated"),
        "cut inside tensor data": (good[:data_offset + 20], "runs past the end"),
        "tensor offset past end": (build(tensor_offset_override=4096)[0], "runs past the end"),
        "2^40 metadata entries": (build(n_kv_override=2**40)[0], "metadata entries"),
        "2^40 array elements": (build(array_len_override=2**40)[0], "array claims"),
        "unknown type id": (build(type_id=77)[0], "unknown GGML type id 77"),
    }


@pytest.mark.parametrize("case", list(broken_files()))
def test_broken_file_gives_clear_error(tmp_path, case):
    data, message = broken_files()[case]
    path = write(tmp_path, data)
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    assert message in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("case", list(broken_files()))
def test_engine_info_on_broken_file_exits_nonzero_without_traceback(tmp_path, case):
    data, message = broken_files()[case]
    path = write(tmp_path, data)
    r = subprocess.run([sys.executable, "-m", "engine.cli", "info", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")


def test_quoted_bounds_the_escaped_text():
    """A name of control characters is cut at the limit after escaping (each \\x00 prints as 4 characters), so an
    error message that quotes it stays one short line (a fuzzed key of 26 NULs made a 314-character message)."""
    from engine.gguf import MAX_QUOTED, quoted
    for text in ("\x00" * 500, "ab\x00" * 200, "x" * 500, "\u2028" * 100):
        q = quoted(text)
        assert len(q) <= MAX_QUOTED + 3 and q.isprintable() and q.endswith("...")
    assert quoted("plain") == "plain" and quoted("a\nb") == "a\\nb"


def string_array_file() -> bytes:
    """A header of one metadata entry, a string array (as a vocabulary is), and no tensors."""
    def text(t: bytes) -> bytes:
        return struct.pack("<Q", len(t)) + t
    words = [b"a", b"", "\u00e9t\u00e9".encode(), b"\xff\xfe", b"longer word"]
    entry = text(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(words)) + b"".join(map(text, words))
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry


def test_string_arrays_read_and_every_cut_is_a_clear_error(tmp_path):
    """The string-array loop: the strings (bad UTF-8 replaced), and at each cut of the file a GGUFError naming the
    truncation, never another exception."""
    data = string_array_file()
    path = write(tmp_path, data)
    assert GGUFFile(path).get("tokenizer.ggml.tokens") == ["a", "", "\u00e9t\u00e9", "\ufffd\ufffd", "longer word"]
    for n in range(8, len(data)):
        path.write_bytes(data[:n])
        with pytest.raises(GGUFError, match="truncated|more than the file holds"):
            GGUFFile(path)


def test_every_cut_inside_the_header_is_a_clear_error(tmp_path):
    """Cut at each byte of the metadata and the tensor table: a GGUFError (its message names the cut: truncated,
    claims more than the file holds), never another exception."""
    good, data_offset = build()
    path = tmp_path / "cut.gguf"
    for n in range(8, data_offset):
        path.write_bytes(good[:n])
        with pytest.raises(GGUFError):
            GGUFFile(path)
