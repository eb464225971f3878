"""Each architecture against HF transformers: the tiny files of tests/tiny_archs.py, transformers' float32 logits
recorded once by scripts/record_transformers.py (tests/data/transformers/), the engine's paths compared here."""
from pathlib import Path

import numpy as np
import pytest

from engine.model import rope
from engine.runtime import Runtime
from tiny_archs import ARCHS, MOE_ARCHS, write_arch

DATA = Path(__file__).parent / "data" / "transformers"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("archs")
    return {name: write_arch(folder / f"{name}.gguf", name) for name in ARCHS}


def reference(name: str) -> dict:
    return dict(np.load(DATA / f"{name}.npz"))


def teacher_forced(rt: Runtime, tokens: list[int]) -> np.ndarray:
    """Logits of every position of one prefill: [len(tokens), n_vocab] float64."""
    return np.asarray(rt.prefill(tokens, all_logits=True), dtype=np.float64)


def greedy(rt: Runtime, prompt: list[int], n: int) -> list[int]:
    logits = rt.prefill(prompt)
    out = []
    for i in range(n):
        tok = int(np.argmax(logits[-1] if logits.ndim == 2 else logits))
        out.append(tok)
        logits = rt.decode([0], [tok], [len(prompt) + i])
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_exact_path_matches_transformers(files, name):
    """The float64 CPU path against transformers: every logit within 1e-4 of the logit range, and the same 16 greedy
    tokens."""
    ref = reference(name)
    rt = Runtime.load(files[name], device="cpu", exact=True, n_ctx=128)
    got = teacher_forced(rt, ref["tokens"].tolist())
    span = float(ref["logits"].max() - ref["logits"].min())
    assert np.abs(got - ref["logits"]).max() <= 1e-4 * span, (name, np.abs(got - ref["logits"]).max() / span)
    rt = Runtime.load(files[name], device="cpu", exact=True, n_ctx=128)
    prompt = ref["tokens"][:int(ref["greedy_prompt"])].tolist()
    assert greedy(rt, prompt, len(ref["greedy"])) == ref["greedy"].tolist()


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean KL(p || q) over positions, from logits."""
    def log_softmax(x):
        x = x - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ARCHS)
def test_fast_paths_near_the_exact_one(files, name, device):
    """The float32 CPU path and the CUDA path (decode through MMVQ, q8_1 activations) teacher-forced within KL 0.002
    of the float64 path."""
    tokens = reference(name)["tokens"].tolist()
    if device == "cuda" and name in MOE_ARCHS:          # no expert kernels yet: refused at load, naming the way out
        with pytest.raises(ValueError, match="CPU backend only"):
            Runtime.load(files[name], device=device, n_ctx=128)
        return
    exact = teacher_forced(Runtime.load(files[name], device="cpu", exact=True, n_ctx=128), tokens)
    rt = Runtime.load(files[name], device=device, n_ctx=128)
    got = teacher_forced(rt, tokens)
    assert kl(exact, got) <= 0.002, kl(exact, got)
    rt = Runtime.load(files[name], device=device, n_ctx=128)          # one token at a time: the decode kernels
    rows = [rt.prefill(tokens[:1])[-1]] + [rt.decode([0], [t], [i + 1])[0] for i, t in enumerate(tokens[1:])]
    stepped = np.asarray(rows, dtype=np.float64)
    assert kl(exact, stepped) <= 0.002, kl(exact, stepped)


def test_llama3_rope_factors_matter(files, monkeypatch):
    """Without rope_freqs.weight's factors the tiny Llama 3 is measurably off transformers (so the test above can
    fail), and with them on."""
    ref = reference("llama3")
    span = float(ref["logits"].max() - ref["logits"].min())
    monkeypatch.setattr(rope, "freq_factors", lambda *a: None)
    rt = Runtime.load(files["llama3"], device="cpu", exact=True, n_ctx=128)
    off = np.abs(teacher_forced(rt, ref["tokens"].tolist()) - ref["logits"]).max()
    assert off > 1e-2 * span, off / span


def test_unsupported_architecture_names_the_supported(tmp_path):
    import subprocess
    import sys
    from gguf import GGUFWriter
    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    for cmd in (["info", str(path)], ["generate", str(path), "hi", "-n", "1", "--device", "cpu"]):
        r = subprocess.run([sys.executable, "-m", "engine.cli", *cmd], capture_output=True, text=True, timeout=120)
        if cmd[0] == "info":
            continue                                   # info describes any readable file
        assert r.returncode != 0 and "unsupported architecture 'mamba'" in r.stderr, r.stderr
        assert "qwen2" in r.stderr and "qwen3" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("name", ARCHS)
def test_info_and_generate_on_each_file(files, name):
    """`engine info` names the architecture and its hyperparameters; `engine generate` runs and exits 0."""
    import subprocess
    import sys
    from tiny_archs import GGUF_ARCH, HD
    r = subprocess.run([sys.executable, "-m", "engine.cli", "info", files[name]], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and f"architecture:    {GGUF_ARCH[name]}" in r.stdout, r.stdout + r.stderr
    assert f"head_dim:              {HD}" in r.stdout and "block_count:           2" in r.stdout
    r = subprocess.run([sys.executable, "-m", "engine.cli", "generate", files[name], "The capital of France is",
                        "-n", "8", "--temp", "0", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "generated 8 tokens" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["dynamic", "longrope_half"])
def test_unsupported_rope_scaling_is_refused(tmp_path, kind):
    """A file asking for rope scaling the engine does not implement (dynamic NTK), or LongRoPE with only one of its
    factor sets, fails to load with one line naming it, rather than running with the wrong frequencies."""
    from gguf import GGUFReader, GGUFWriter
    from engine.gguf import GGUFError
    src = write_arch(tmp_path / "src.gguf", "llama3" if kind == "dynamic" else "phi3_longrope")
    reader = GGUFReader(src)
    arch = "llama" if kind == "dynamic" else "phi3"
    w = GGUFWriter(str(tmp_path / "x.gguf"), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == field.types[0].ARRAY else None)
    if kind == "dynamic":
        w.add_string("llama.rope.scaling.type", "dynamic")
        w.add_rope_scaling_factor(4.0)
    for t in reader.tensors:
        if t.name != "rope_factors_short.weight":
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    with pytest.raises(GGUFError, match="'dynamic' is not supported|LongRoPE needs both"):
        Runtime.load(str(tmp_path / "x.gguf"), device="cpu", n_ctx=64)


def test_longrope_picks_its_factors_by_the_context(files, monkeypatch):
    """Up to the original context the short factors, above it the long ones (as llama.cpp chooses), and the long
    run is the one transformers matches (its sequence is past the original context); ignoring the factors is off."""
    from tiny_archs import LONGROPE_ORIG_CTX, longrope_factors
    short, long_ = longrope_factors()
    rt = Runtime.load(files["phi3_longrope"], device="cpu", exact=True, n_ctx=LONGROPE_ORIG_CTX)
    base = rope.inv_freq(rt.config.n_rot, rt.config.rope_base)
    np.testing.assert_allclose(rt.model.inv_freq, base / short.astype(np.float64), rtol=1e-12)
    rt = Runtime.load(files["phi3_longrope"], device="cpu", exact=True, n_ctx=LONGROPE_ORIG_CTX + 1)
    np.testing.assert_allclose(rt.model.inv_freq, base / long_.astype(np.float64), rtol=1e-12)
    ref = reference("phi3_longrope")
    span = float(ref["logits"].max() - ref["logits"].min())
    monkeypatch.setattr(rope, "freq_factors", lambda *a: None)
    rt = Runtime.load(files["phi3_longrope"], device="cpu", exact=True, n_ctx=128)
    assert np.abs(teacher_forced(rt, ref["tokens"].tolist()) - ref["logits"]).max() > 1e-2 * span


def test_yarn_matters(files, monkeypatch):
    """Without YaRN's blend and attention factor the tiny Qwen 2 is measurably off transformers' yarn."""
    from engine.model.rope import RopeScaling
    ref = reference("qwen2_yarn")
    span = float(ref["logits"].max() - ref["logits"].min())
    monkeypatch.setattr(RopeScaling, "from_gguf", classmethod(lambda cls, f: cls()))
    rt = Runtime.load(files["qwen2_yarn"], device="cpu", exact=True, n_ctx=128)
    assert np.abs(teacher_forced(rt, ref["tokens"].tolist()) - ref["logits"]).max() > 1e-2 * span


def test_mistral_window_matters(files, monkeypatch):
    """A llama file with attention.sliding_window (Mistral 7B v0.1's) attends to its window only: ignoring the window
    is measurably off transformers' Mistral (so the comparison above can fail)."""
    import dataclasses
    from engine.model.config import ModelConfig
    ref = reference("mistral")
    span = float(ref["logits"].max() - ref["logits"].min())
    from_gguf = ModelConfig.from_gguf
    monkeypatch.setattr(ModelConfig, "from_gguf",
                        classmethod(lambda cls, f: dataclasses.replace(from_gguf(f), sliding_window=None)))
    rt = Runtime.load(files["mistral"], device="cpu", exact=True, n_ctx=128)
    assert rt.config.sliding_window is None
    assert np.abs(teacher_forced(rt, ref["tokens"].tolist()) - ref["logits"]).max() > 1e-2 * span


def test_moe_routing_matters(files, monkeypatch):
    """Routed to every expert instead of the top expert_used_count, the tiny Qwen3-MoE is measurably off transformers
    (so the comparison above can fail)."""
    import dataclasses
    from engine.model.config import ModelConfig
    ref = reference("qwen3moe")
    span = float(ref["logits"].max() - ref["logits"].min())
    from_gguf = ModelConfig.from_gguf
    monkeypatch.setattr(ModelConfig, "from_gguf",
                        classmethod(lambda cls, f: dataclasses.replace(from_gguf(f), n_expert_used=from_gguf(f).n_expert)))
    rt = Runtime.load(files["qwen3moe"], device="cpu", exact=True, n_ctx=128)
    assert np.abs(teacher_forced(rt, ref["tokens"].tolist()) - ref["logits"]).max() > 1e-2 * span


@pytest.mark.parametrize("change", ["renormalize", "no_shared_expert"])
def test_qwen2moe_weights_as_they_are_and_its_shared_expert_matter(files, monkeypatch, change):
    """Qwen 2 MoE keeps the chosen experts' softmax weights as they are and adds its shared expert: either changed,
    the tiny file is measurably off transformers."""
    from engine.model.qwen2moe import Qwen2Moe
    ref = reference("qwen2moe")
    span = float(ref["logits"].max() - ref["logits"].min())
    monkeypatch.setattr(Qwen2Moe, "NORM_TOPK" if change == "renormalize" else "SHARED_EXPERT",
                        change == "renormalize")
    rt = Runtime.load(files["qwen2moe"], device="cpu", exact=True, n_ctx=128)
    assert np.abs(teacher_forced(rt, ref["tokens"].tolist()) - ref["logits"]).max() > 1e-2 * span
