"""Property-based fuzzing (hypothesis) of the GGUF reader and loader: whatever values a file's metadata and tensor
table hold, it loads and generates, or fails with one clean line of the engine's own errors. Hypothesis shrinks a
failure to the smallest file that shows it; scripts/fuzz.py runs the seeded mutation fuzzer for thousands of files."""
import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_gguf import Header, check_file, write_case
from tiny_models import write_tiny

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
BITS = {U8: (0, 2 ** 8 - 1), I8: (-2 ** 7, 2 ** 7 - 1), U16: (0, 2 ** 16 - 1), I16: (-2 ** 15, 2 ** 15 - 1),
        U32: (0, 2 ** 32 - 1), I32: (-2 ** 31, 2 ** 31 - 1), U64: (0, 2 ** 64 - 1), I64: (-2 ** 63, 2 ** 63 - 1)}
EDGES = [0, 1, 2, 3, 7, 8, 16, 255, 2 ** 15, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1]


def scalar(vtype: int):
    """Values of one GGUF scalar type, its range's edges and small counts likelier than the rest."""
    if vtype in BITS:
        lo, hi = BITS[vtype]
        return st.one_of(st.sampled_from([v for v in EDGES + [-1, lo, hi] if lo <= v <= hi]), st.integers(lo, hi))
    if vtype in (F32, F64):
        return st.floats(width=32 if vtype == F32 else 64)
    if vtype == BOOL:
        return st.booleans()
    return st.text(max_size=40)


@st.composite
def typed_value(draw, depth: int = 0):
    """(value type, element type, value) of any GGUF type, arrays of any element type up to 40 items."""
    vtype = draw(st.sampled_from([U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, U64, I64, F64] +
                                 ([ARRAY] * 3 if depth == 0 else [])))
    if vtype != ARRAY:
        return (vtype, None), draw(scalar(vtype))
    etype = draw(st.sampled_from([U8, I32, U32, F32, STRING, BOOL, I64]))
    return (ARRAY, etype), draw(st.lists(scalar(etype), max_size=40))


@st.composite
def edited_header(draw, header: Header) -> Header:
    """The header with 1-4 edits: an entry's value replaced (any type), an entry dropped or added, a tensor's dims,
    type or offset changed."""
    h = copy.deepcopy(header)
    arch = next(v for k, _, v in h.kv if k == "general.architecture")
    for _ in range(draw(st.integers(1, 4))):
        edit = draw(st.sampled_from(["value", "value", "drop", "add", "dims", "type", "offset"]))
        if edit == "value":
            i = draw(st.integers(0, len(h.kv) - 1))
            h.kv[i][1], h.kv[i][2] = draw(typed_value())
        elif edit == "drop" and len(h.kv) > 1:
            del h.kv[draw(st.integers(0, len(h.kv) - 1))]
        elif edit == "add":
            key = draw(st.sampled_from([f"{arch}.{s}" for s in (
                "context_length", "attention.sliding_window", "rope.scaling.factor", "attention.key_length",
                "attention.value_length", "expert_count", "rope.dimension_count", "vocab_size")]) | st.text(max_size=20))
            h.kv = [e for e in h.kv if e[0] != key] + [[key, *draw(typed_value())]]
        else:
            t = h.tensors[draw(st.integers(0, len(h.tensors) - 1))]
            if edit == "dims":
                t[1][draw(st.integers(0, len(t[1]) - 1))] = draw(scalar(U64))
            elif edit == "type":
                t[2] = draw(st.sampled_from([0, 1, 2, 3, 6, 8, 10, 12, 14, 20, 23, 30, 99]) | scalar(U32))
            else:
                t[3] = draw(scalar(U64))
    return h


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("hypothesis")
    return {a: write_tiny(d / f"{a}.gguf", a) for a in ("llama", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_any_metadata_loads_or_fails_cleanly(tiny, tmp_path_factory, arch):
    src = tiny[arch]
    header = Header.read(src)
    path = tmp_path_factory.mktemp("case") / "case.gguf"

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(h=edited_header(header))
    def check(h):
        write_case(path, (h.to_bytes(), None), src, header)
        problem = check_file(path, generate=True)
        assert problem is None, problem

    check()
