"""Models that cannot be run give one clear error, from the library and from the CLI."""
import subprocess
import sys

import pytest

from engine.gguf import GGUFError, GGUFFile
from engine.model import ModelLoadError, load_model
from engine.backends.cpu import CPUBackend
from gguf_craft import build


def crafted(tmp_path, **kw):
    p = tmp_path / "m.gguf"
    p.write_bytes(build(**kw)[0])
    return p


def test_unknown_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model(GGUFFile(crafted(tmp_path, arch="mamba")), CPUBackend())


def test_missing_hyperparameters(tmp_path):
    with pytest.raises(GGUFError, match="required metadata 'embedding_length' is missing"):
        load_model(GGUFFile(crafted(tmp_path)), CPUBackend())


def test_generate_on_unusable_file_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "generate", str(crafted(tmp_path)), "hi", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "engine: error:" in r.stderr
