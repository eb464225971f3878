from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "llamacpp"
MODEL_KEYS = {"smol": "smollm2-135m", "gemma": "gemma3-270m"}


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_path():
    """short name ('smol' | 'gemma') -> path of the real model file, fetched on first use."""
    from engine import hub

    def get(key: str) -> str:
        return str(hub.fetch(MODEL_KEYS[key]))
    return get


def read_prompts(key: str) -> list[str]:
    lines = (GOLDEN / f"{key}_pub.prompts.txt").read_text(encoding="utf-8").splitlines()
    out = []
    for line in lines:
        s, i = [], 0
        while i < len(line):  # unescape \n, \t, \\ only
            if line[i] == "\\" and i + 1 < len(line) and line[i + 1] in "nt\\":
                s.append({"n": "\n", "t": "\t", "\\": "\\"}[line[i + 1]])
                i += 2
            else:
                s.append(line[i])
                i += 1
        out.append("".join(s))
    return out


def read_golden(key: str, backend: str) -> list[dict]:
    import json
    return [json.loads(line) for line in (GOLDEN / f"{key}_pub.{backend}.jsonl").read_text().splitlines()]


def run_requests(sched, requests) -> list[list]:
    """Submit requests to a Scheduler, step it until idle -> each request's events."""
    events = [[] for _ in requests]
    for req, ev in zip(requests, events):
        sched.submit(req, ev.append)
    while sched.step():
        pass
    return events
