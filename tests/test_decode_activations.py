"""--decode-activations auto: 16-bit decode activations for small model files, q8_1 for large ones (engine/cli.py)."""
import pytest

from engine import cli


def _args(*flags: str, command: str = "generate"):
    return cli.build_parser().parse_args([command, "model.gguf", *flags])


@pytest.fixture
def model_file(tmp_path):
    def make(n_bytes: int) -> str:
        path = tmp_path / f"m{n_bytes}.gguf"
        with open(path, "wb") as f:
            f.truncate(n_bytes)     # sparse: only its size matters here
        return str(path)
    return make


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_auto_is_the_default(command):
    assert _args(command=command).decode_activations == "auto"


def test_auto_takes_q16_up_to_the_size_limit_and_q8_1_above(model_file):
    args = _args()
    assert cli._exact_decode(args, model_file(cli.EXACT_DECODE_MAX_FILE_BYTES))
    assert not cli._exact_decode(args, model_file(cli.EXACT_DECODE_MAX_FILE_BYTES + 1))
    assert cli._cuda_config(args, model_file(1000)).exact_decode


def test_an_explicit_choice_wins_over_the_size(model_file):
    assert not cli._exact_decode(_args("--decode-activations", "q8_1"), model_file(1000))
    assert cli._exact_decode(_args("--decode-activations", "q16"), model_file(1 << 40))


def test_auto_keeps_q8_1_with_batch_invariance_and_on_the_cpu(model_file):
    small = model_file(1000)
    assert not cli._exact_decode(_args("--batch-invariant"), small)
    assert not cli._exact_decode(_args("--device", "cpu"), small)
    cli._cuda_config(_args("--batch-invariant"), small)     # a valid CudaConfig: invariance refuses exact_decode


def test_a_missing_file_is_left_to_the_loader(tmp_path):
    assert not cli._exact_decode(_args(), str(tmp_path / "absent.gguf"))


def test_the_real_models_fall_under_the_limit(model_path):
    import os
    for name in ("smol", "gemma"):
        assert os.path.getsize(model_path(name)) <= cli.EXACT_DECODE_MAX_FILE_BYTES
