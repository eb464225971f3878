"""Build every kernel family ahead of time with nvcc: one cubin per (family, architecture) and a manifest.

    python -m engine.cuda.aot [--out DIR] [--arch sm_80,sm_90] [--jobs N]

`pip install` runs this (setup.py) when nvcc is on the machine; engine/cuda/build.py loads the result. The manifest
holds, per family, the source key the cubins were built from, the architectures, and each name expression's mangled
symbol (read from the cubin's ELF symbol table and demangled with c++filt, so no GPU is needed to build).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import build


def find_nvcc() -> str | None:
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    return None


def elf_kernel_symbols(data: bytes) -> list[str]:
    """The global function symbols of a cubin (a 64-bit little-endian ELF file)."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise build.KernelBuildError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:                                   # SHT_SYMTAB
            continue
        strtab = sections[link][4]
        for j in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", data, offset + j * entsize)
            if st_info == 0x12:                         # STB_GLOBAL, STT_FUNC
                names.append(data[strtab + st_name:data.index(b"\0", strtab + st_name)].decode())
    return names


def symbol_table(cubin: Path, family: str) -> dict[str, str]:
    """{canonical name expression: mangled symbol} for every kernel of the family in the cubin."""
    mangled = elf_kernel_symbols(cubin.read_bytes())
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    found = {build.canonical_name(d): m for d, m in zip(demangled, mangled)}
    table = {}
    for name in build.name_expressions(family):
        key = build.canonical_name(name)
        if key not in found:
            raise build.KernelBuildError(f"{cubin.name}: no symbol for {name}")
        table[key] = found[key]
    return table


def compile_family(nvcc: str, family: str, arch: str, out: Path, work: Path) -> Path:
    src = work / f"{family}.{arch}.cu"
    src.write_text(build.instantiation_source(family))
    cubin = out / f"{family}.{arch}.cubin"
    r = subprocess.run([nvcc, "-cubin", f"-arch={arch}", *build.COMPILE_OPTIONS, *build.NVCC_OPTIONS, "-o",
                        str(cubin), str(src)], capture_output=True, text=True)
    if r.returncode != 0 or "warning" in r.stderr.lower():
        raise build.KernelBuildError(f"nvcc {family}.cu for {arch} failed or warned:\n{r.stderr[-4000:]}")
    return cubin


def is_current(out: Path, archs=build.PREBUILT_ARCHS) -> bool:
    """Whether out holds every family's cubins for archs, built from the current sources and options."""
    path = out / "manifest.json"
    if not path.exists():
        return False
    manifest = json.loads(path.read_text())
    for f in build.FAMILIES:
        built = build.family_archs(f, archs)
        if built and not (f in manifest and manifest[f]["key"] == build.source_key(f)
                          and manifest[f]["archs"] == list(built)
                          and all((out / f"{f}.{a}.cubin").exists() for a in built)):
            return False
    return True


def build_all(out: Path = build.PREBUILT_DIR, archs=build.PREBUILT_ARCHS, jobs: int | None = None,
              log=print) -> dict:
    """Compile every family for every arch into out, write out/manifest.json; returns the manifest."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise build.KernelBuildError("nvcc not found")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.cubin"):
        old.unlink()
    # the largest families first, so the pool ends together
    built = {f: build.family_archs(f, archs) for f in build.FAMILIES}
    todo = sorted(((f, a) for f in build.FAMILIES for a in built[f]),
                  key=lambda fa: -len(build.name_expressions(fa[0])))
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        cubins = dict(zip(todo, pool.map(lambda fa: compile_family(nvcc, *fa, out, Path(tmp)), todo)))
    manifest = {f: {"key": build.source_key(f), "archs": list(built[f]),
                    "symbols": symbol_table(cubins[(f, built[f][0])], f)} for f in build.FAMILIES if built[f]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    log(f"engine: built {len(todo)} CUDA kernel binaries ({', '.join(archs)}) in {time.time() - start:.0f} s")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.cuda.aot", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=build.PREBUILT_DIR, help="output folder (default: %(default)s)")
    p.add_argument("--arch", default=",".join(build.PREBUILT_ARCHS), help="architectures (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc runs (default: the CPU count)")
    a = p.parse_args(argv)
    try:
        build_all(a.out, tuple(a.arch.split(",")), a.jobs)
    except build.KernelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
