"""quants.py dequantization equals the gguf package's reference, exactly."""
import numpy as np
import pytest
from gguf import quants as ref

from engine.gguf import GGUFFile
from engine.quants import TYPES, dequantize, random_blocks

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
