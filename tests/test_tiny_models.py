"""Tiny random models run on the CPU (float32 against float64), and on the GPU against the CPU."""
import numpy as np
import pytest

from engine.runtime import Runtime
from tiny_models import N_VOCAB, write_tiny

ARCHS = ["llama", "gemma3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return {a: write_tiny(folder / f"{a}.gguf", a) for a in ARCHS}


def nmse(a, b):
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def run(rt: Runtime, prompt, decode):
    """All logits of the prompt (two ubatches), then logits of a few decoded tokens."""
    out = [rt.prefill(prompt, all_logits=True)]
    pos = len(prompt)
    for tok in decode:
        out.append(rt.decode([0], [tok], [pos]))
        pos += 1
    return np.concatenate(out)


def prompt_and_decode():
    rng = np.random.default_rng()
    return rng.integers(0, N_VOCAB, 40).tolist(), rng.integers(0, N_VOCAB, 5).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_float32_matches_float64(tiny, arch):
    prompt, dec = prompt_and_decode()
    f32 = run(Runtime.load(tiny[arch], device="cpu", n_ctx=64, n_ubatch=32), prompt, dec)
    f64 = run(Runtime.load(tiny[arch], device="cpu", n_ctx=64, n_ubatch=32, exact=True), prompt, dec)
    assert np.isfinite(f32).all() and f32.std() > 0.1
    assert nmse(f32, f64) < 1e-8


def load_cuda(path, kv_f32):
    from engine.backends.cuda import CUDABackend
    rt = Runtime.load(path, device="cuda", n_ctx=64, n_ubatch=32)
    if kv_f32:   # the same model with an f32 KV cache
        rt.backend = CUDABackend(kv_f32=True)
        rt.model.B = rt.backend
        rt.cache = rt.model.new_cache(1, 64)
    return rt


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_f32", [False, True])
def test_cuda_dequant_path_matches_cpu(tiny, arch, kv_f32, monkeypatch):
    """With every mul_mat on dequantize+cuBLAS the GPU computes the CPU's function up to f16 rounding."""
    monkeypatch.setenv("ENGINE_MUL_MAT_PATH", "dequant")
    prompt, dec = prompt_and_decode()
    cpu = run(Runtime.load(tiny[arch], device="cpu", n_ctx=64, n_ubatch=32), prompt, dec)
    gpu = run(load_cuda(tiny[arch], kv_f32), prompt, dec)
    assert nmse(gpu, cpu) < 1e-5
    assert np.array_equal(gpu.argmax(1), cpu.argmax(1))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_q8_1_paths_agree(tiny, arch, monkeypatch):
    """MMVQ and MMQ compute the same q8_1 product; against the CPU they differ by the activation rounding, which
    these random models amplify (measured nmse ~1e-3), so that comparison is a sanity bound."""
    prompt, _ = prompt_and_decode()
    outs = {}
    for path, ubatch in (("mmvq", 8), ("mmq", 32)):
        monkeypatch.setenv("ENGINE_MUL_MAT_PATH", path)
        rt = Runtime.load(tiny[arch], device="cuda", n_ctx=64, n_ubatch=ubatch)
        outs[path] = rt.prefill(prompt, all_logits=True)
    assert nmse(outs["mmvq"], outs["mmq"]) < 1e-9
    cpu = Runtime.load(tiny[arch], device="cpu", n_ctx=64).prefill(prompt, all_logits=True)
    assert nmse(outs["mmq"], cpu) < 1e-2 and np.mean(outs["mmq"].argmax(1) == cpu.argmax(1)) >= 0.85
