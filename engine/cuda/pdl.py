"""Programmatic dependent launch in captured graphs (sm_90 and later).

A graph captured from one stream chains its kernels with full dependencies: each kernel is launched only after the
one before has finished, and the gap between them (the last blocks' tail, then the next grid's launch) is idle GPU
time, ~300 times a decode step. Every kernel of the project starts with PDL_WAIT() (kernels/common.cuh:
griddepcontrol.wait), so an edge into one of them can be made programmatic with the launch-order port: the kernel is
launched as soon as every block of its predecessor has started, and waits, before touching memory, until that
predecessor has finished and its writes are visible. Edges into any other kernel (CuPy's, cuBLAS's), and every edge
from or to a memset or copy node, stay as captured.

`register` records a loaded kernel of the project (engine/cuda/build.py calls it); `programmatic_graph` rewrites a
captured graph's edges and instantiates it anew (CuPy instantiates at the end of a capture), for
engine/backends/cuda_graphs.py.
"""
from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, byref, c_int, c_size_t, c_ubyte, c_uint, c_void_p

MIN_COMPUTE_CAPABILITY = 90          # griddepcontrol (PTX ISA 7.8) exists from sm_90
NODE_TYPE_KERNEL = 0                 # CU_GRAPH_NODE_TYPE_KERNEL
DEPENDENCY_TYPE_PROGRAMMATIC = 1     # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
PORT_LAUNCH_ORDER = 2                # CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER: all the upstream blocks have begun

_own_kernels: set[int] = set()       # CUfunction handles of the project's loaded kernels


class EdgeData(ctypes.Structure):
    """CUgraphEdgeData (cuda.h): zero everywhere is a plain full dependency."""
    _fields_ = [("from_port", c_ubyte), ("to_port", c_ubyte), ("type", c_ubyte), ("reserved", c_ubyte * 5)]


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h); only `func` is read."""
    _fields_ = [("func", c_void_p), ("grid", c_uint * 3), ("block", c_uint * 3), ("shared_mem_bytes", c_uint),
                ("kernel_params", c_void_p), ("extra", c_void_p), ("kern", c_void_p), ("ctx", c_void_p)]


PROGRAMMATIC = EdgeData(PORT_LAUNCH_ORDER, 0, DEPENDENCY_TYPE_PROGRAMMATIC)


def register(function_handle: int) -> None:
    """Mark a loaded kernel (its CUfunction) as one that waits before it touches memory."""
    _own_kernels.add(int(function_handle))


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    signatures = {
        "cuGraphGetEdges_v2": (c_void_p, POINTER(c_void_p), POINTER(c_void_p), POINTER(EdgeData), POINTER(c_size_t)),
        "cuGraphRemoveDependencies_v2": (c_void_p, POINTER(c_void_p), POINTER(c_void_p), POINTER(EdgeData),
                                         c_size_t),
        "cuGraphAddDependencies_v2": (c_void_p, POINTER(c_void_p), POINTER(c_void_p), POINTER(EdgeData), c_size_t),
        "cuGraphNodeGetType": (c_void_p, POINTER(c_int)),
        "cuGraphKernelNodeGetParams_v2": (c_void_p, POINTER(KernelNodeParams)),
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed (CUresult {result})")


def _kernel_function(node: int, cache: dict[int, int | None]) -> int | None:
    """A graph node's CUfunction, or None when it is not a kernel node."""
    if node not in cache:
        cu = _driver()
        kind = c_int()
        _check(cu.cuGraphNodeGetType(node, byref(kind)), "cuGraphNodeGetType")
        func = None
        if kind.value == NODE_TYPE_KERNEL:
            params = KernelNodeParams()
            _check(cu.cuGraphKernelNodeGetParams_v2(node, byref(params)), "cuGraphKernelNodeGetParams")
            func = params.func or 0
        cache[node] = func
    return cache[node]


def supported(compute_capability: int) -> bool:
    return compute_capability >= MIN_COMPUTE_CAPABILITY


def make_programmatic(graph_handle: int) -> int:
    """Turn each plain kernel -> project-kernel edge of a captured graph (a cudaGraph_t: executables instantiated from
    it before keep the old edges) into a programmatic launch-order edge. -> the number of edges turned. Should the
    driver refuse one, it is put back and the rest of the graph is left as captured."""
    cu = _driver()
    n = c_size_t(0)
    _check(cu.cuGraphGetEdges_v2(graph_handle, None, None, None, byref(n)), "cuGraphGetEdges")
    src, dst, data = (c_void_p * n.value)(), (c_void_p * n.value)(), (EdgeData * n.value)()
    _check(cu.cuGraphGetEdges_v2(graph_handle, src, dst, data, byref(n)), "cuGraphGetEdges")
    functions: dict[int, int | None] = {}
    turned = 0
    for i in range(n.value):
        if bytes(data[i]) != bytes(EdgeData()):
            continue
        if _kernel_function(src[i], functions) is None or _kernel_function(dst[i], functions) not in _own_kernels:
            continue
        edge_src, edge_dst = (c_void_p * 1)(src[i]), (c_void_p * 1)(dst[i])
        _check(cu.cuGraphRemoveDependencies_v2(graph_handle, edge_src, edge_dst, (EdgeData * 1)(), 1),
               "cuGraphRemoveDependencies")
        if cu.cuGraphAddDependencies_v2(graph_handle, edge_src, edge_dst, (EdgeData * 1)(PROGRAMMATIC), 1) != 0:
            _check(cu.cuGraphAddDependencies_v2(graph_handle, edge_src, edge_dst, (EdgeData * 1)(), 1),
                   "cuGraphAddDependencies")
            break
        turned += 1
    return turned


class ProgrammaticGraph:
    """A captured CuPy graph, its edges made programmatic, instantiated again: launched and uploaded like it."""

    def __init__(self, graph, edges: int):
        from cupy.cuda import runtime
        self.graph = graph                   # owns the cudaGraph_t (and its first instantiation)
        self.edges = edges                   # edges made programmatic
        self.graph_exec = runtime.graphInstantiate(graph.graph)

    def launch(self, stream) -> None:
        from cupy.cuda import runtime
        runtime.graphLaunch(self.graph_exec, stream.ptr)

    def upload(self, stream) -> None:
        from cupy.cuda import runtime
        runtime.graphUpload(self.graph_exec, stream.ptr)

    def __del__(self):
        from cupy.cuda import runtime
        if getattr(self, "graph_exec", 0):
            runtime.graphExecDestroy(self.graph_exec)


def programmatic_graph(graph):
    """A captured CuPy graph with its edges into the project's kernels made programmatic: a ProgrammaticGraph, or the
    graph itself where no edge could be."""
    edges = make_programmatic(graph.graph)
    return ProgrammaticGraph(graph, edges) if edges else graph
