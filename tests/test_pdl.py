"""Programmatic dependent launch (engine/cuda/pdl.py): the driver structs it passes, and the guarantee it rests on,
that every kernel waits (PDL_WAIT) before it reads or writes global memory. No GPU needed."""
import ctypes
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.cuda import aot, build, pdl
from engine.cuda.config import CudaConfig

NVCC = aot.find_nvcc()
# a PTX instruction that reaches global memory: loads, stores, atomics and reductions in any state space but the
# kernel's parameters, shared, local and constant memory (generic addresses count), async copies, prefetches, textures
MEMORY_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:(?:ld|st|atom|red)(?!\.(?:param|shared|local|const)\b)|cp\.async|"
                       r"prefetch|tex|suld|sust)[.\s]")


def test_driver_structs_have_cuda_h_layout():
    assert ctypes.sizeof(pdl.EdgeData) == 8
    assert ctypes.sizeof(pdl.KernelNodeParams) == 72
    assert pdl.KernelNodeParams.kernel_params.offset == 40
    assert pdl.KernelNodeParams.ctx.offset == 64
    assert bytes(pdl.PROGRAMMATIC)[:3] == bytes([pdl.PORT_LAUNCH_ORDER, 0, pdl.DEPENDENCY_TYPE_PROGRAMMATIC])


def test_only_sm_90_and_later_launch_programmatically():
    assert pdl.supported(90) and pdl.supported(100)
    assert not pdl.supported(89) and not pdl.supported(80)
    assert CudaConfig().programmatic_launch and not CudaConfig(programmatic_launch=False).programmatic_launch


def test_memory_op_pattern():
    for line in ("ld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd5];", "st.global.f32 [%rd1], %f1;",
                 "@%p1 atom.global.add.u32 %r1, [%rd1], 1;", "red.global.add.f32 [%rd2], %f3;", "ld.u32 %r1, [%rd1];",
                 "cp.async.cg.shared.global [%r1], [%rd1], 16;", "@!%p2 st.global.v2.f32 [%rd3], {%f1, %f2};"):
        assert MEMORY_OP.match(line), line
    for line in ("ld.param.u64 %rd1, [k_param_0];", "ld.shared.f32 %f1, [%r1];", "st.shared.u32 [%r2], %r3;",
                 "atom.shared.add.u32 %r1, [%r2], 1;", "cvta.to.global.u64 %rd2, %rd1;", "griddepcontrol.wait;",
                 "ld.local.u32 %r1, [%rd1];", "mov.u32 %r1, %tid.x;"):
        assert not MEMORY_OP.match(line), line


def kernel_entries(ptx: str) -> dict[str, str]:
    """Each .entry's name -> its body."""
    parts = re.split(r"^\.(?:visible\s+)?\.entry\s+(\w+)\(", ptx, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def first_memory_op(body: str) -> int | None:
    for i, line in enumerate(body.splitlines()):
        if MEMORY_OP.match(line):
            return i
    return None


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler on this machine")
def test_every_kernel_waits_before_it_touches_memory(tmp_path):
    """In the sm_90 PTX of every kernel of every family, griddepcontrol.wait comes before the first instruction that
    reaches global memory: an edge into any of them may be programmatic."""
    def ptx(family):
        src = tmp_path / f"{family}.cu"
        src.write_text(build.instantiation_source(family))
        out = tmp_path / f"{family}.ptx"
        r = subprocess.run([NVCC, "-ptx", "-arch=sm_90", *build.COMPILE_OPTIONS, *build.NVCC_OPTIONS, "-o", str(out),
                            str(src)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        return family, out.read_text()

    with ThreadPoolExecutor(8) as pool:
        texts = dict(pool.map(ptx, build.FAMILIES))
    checked = 0
    for family, text in texts.items():
        entries = kernel_entries(text)
        assert len(entries) == len(build.name_expressions(family)), family
        for name, body in entries.items():
            lines = body.splitlines()
            wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
            first = first_memory_op(body)
            assert wait is not None, f"{family}: {name} never waits"
            assert first is None or wait < first, f"{family}: {name} touches memory before it waits:\n{lines[first]}"
            checked += 1
    assert checked > 600


class FakeDriver:
    """The five driver calls make_programmatic uses, over a graph held as Python data: nodes {handle: (type, func)},
    edges [(src, dst, EdgeData bytes)]; `refuse_programmatic` makes the driver refuse programmatic edges."""

    def __init__(self, nodes, edges, refuse_programmatic=False):
        self.nodes, self.edges, self.refuse = nodes, list(edges), refuse_programmatic

    def cuGraphGetEdges_v2(self, graph, src, dst, data, n):
        count = n._obj
        if src is not None:
            for i, (a, b, d) in enumerate(self.edges[:count.value]):
                src[i], dst[i] = a, b
                ctypes.memmove(ctypes.addressof(data[i]), d, 8)
        count.value = len(self.edges)
        return 0

    def cuGraphRemoveDependencies_v2(self, graph, src, dst, data, n):
        edge = (src[0], dst[0], bytes(data[0]))
        if edge not in self.edges:
            return 1                                    # CUDA_ERROR_INVALID_VALUE
        self.edges.remove(edge)
        return 0

    def cuGraphAddDependencies_v2(self, graph, src, dst, data, n):
        if self.refuse and bytes(data[0]) != bytes(pdl.EdgeData()):
            return 801                                  # CUDA_ERROR_NOT_SUPPORTED
        self.edges.append((src[0], dst[0], bytes(data[0])))
        return 0

    def cuGraphNodeGetType(self, node, kind):
        kind._obj.value = self.nodes[node][0]
        return 0

    def cuGraphKernelNodeGetParams_v2(self, node, params):
        params._obj.func = self.nodes[node][1]
        return 0


KERNEL, MEMSET = pdl.NODE_TYPE_KERNEL, 2
PLAIN, TURNED = bytes(pdl.EdgeData()), bytes(pdl.PROGRAMMATIC)


@pytest.fixture
def fake_graph(monkeypatch):
    """own kernels (funcs 0x100, 0x101) at nodes 1, 4, 6; a foreign one (CuPy's, cuBLAS's) at 2; a memset at 3."""
    monkeypatch.setattr(pdl, "_own_kernels", {0x100, 0x101})
    nodes = {1: (KERNEL, 0x100), 2: (KERNEL, 0x200), 3: (MEMSET, None), 4: (KERNEL, 0x101), 6: (KERNEL, 0x100)}
    edges = [(1, 2, PLAIN), (2, 4, PLAIN), (4, 3, PLAIN), (3, 6, PLAIN), (1, 4, PLAIN), (4, 6, PLAIN)]

    def make(**kw):
        driver = FakeDriver(nodes, edges, **kw)
        monkeypatch.setattr(pdl, "_driver", lambda: driver)
        return driver
    return make


def test_only_kernel_edges_into_own_kernels_turn(fake_graph):
    driver = fake_graph()
    assert pdl.make_programmatic(1234) == 3
    assert sorted(driver.edges) == sorted([(1, 2, PLAIN), (2, 4, TURNED), (4, 3, PLAIN), (3, 6, PLAIN),
                                           (1, 4, TURNED), (4, 6, TURNED)])


def test_a_refused_edge_is_put_back_and_the_rest_left_as_captured(fake_graph):
    driver = fake_graph(refuse_programmatic=True)
    before = sorted(driver.edges)
    assert pdl.make_programmatic(1234) == 0
    assert sorted(driver.edges) == before


def test_edges_already_annotated_are_left_alone(fake_graph):
    driver = fake_graph()
    driver.edges = [(2, 4, TURNED), (1, 4, PLAIN)]
    assert pdl.make_programmatic(1234) == 1
    assert sorted(driver.edges) == [(1, 4, TURNED), (2, 4, TURNED)]


def test_a_driver_error_is_raised():
    class Broken:
        def cuGraphGetEdges_v2(self, *args):
            return 999
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pdl, "_driver", lambda: Broken())
        with pytest.raises(RuntimeError, match="cuGraphGetEdges failed"):
            pdl.make_programmatic(1)
