"""quants.py dequantization equals the gguf package's reference, exactly."""
import numpy as np
import pytest
from gguf import quants as ref

from engine.gguf import GGUFFile
from engine.quants import TYPES, GGMLType, dequantize

# byte ranges of each type's f16 scale fields: filled with finite random f16 values instead of random bytes
F16_FIELDS = {
    GGMLType.Q4_0: [0], GGMLType.Q4_1: [0, 2], GGMLType.Q5_0: [0], GGMLType.Q5_1: [0, 2], GGMLType.Q8_0: [0],
    GGMLType.Q2_K: [80, 82], GGMLType.Q3_K: [108], GGMLType.Q4_K: [0, 2], GGMLType.Q5_K: [0, 2],
    GGMLType.Q6_K: [208], GGMLType.IQ4_NL: [0], GGMLType.IQ4_XS: [0],
}


def random_blocks(t: GGMLType, n_blocks: int, rng) -> np.ndarray:
    info = TYPES[t]
    if not info.quantized:
        vals = rng.standard_normal(n_blocks).astype({GGMLType.F32: np.float32, GGMLType.F16: np.float16}.get(t, np.float32))
        if t == GGMLType.BF16:
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
        return vals.view(np.uint8).reshape(n_blocks, info.type_size)
    blocks = rng.integers(0, 256, size=(n_blocks, info.type_size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        blocks[:, off:off + 2] = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


@pytest.mark.parametrize("t", list(TYPES), ids=lambda t: t.name)
def test_random_blocks_match_gguf_reference(t):
    rng = np.random.default_rng()
    info = TYPES[t]
    rows, blocks_per_row = 3, 5
    blocks = random_blocks(t, rows * blocks_per_row, rng)
    ours = dequantize(blocks, t, (rows, blocks_per_row * info.block_size))
    theirs = ref.dequantize(blocks.reshape(rows, -1), t)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_every_tensor_of_real_models_matches(model_path, key):
    f = GGUFFile(model_path(key))
    for name, info in f.tensors.items():
        data = f.tensor_data(name)
        ours = dequantize(data, info.type, info.np_shape)
        theirs = ref.dequantize(np.asarray(data).reshape(info.np_shape[:-1] + (-1,)), info.type)
        assert ours.shape == theirs.shape, name
        assert np.abs(ours - theirs).max() == 0 and np.array_equal(ours, theirs), name
