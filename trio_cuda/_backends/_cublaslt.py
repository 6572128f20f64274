"""GEMMs on cuBLASLt through nvmath-python's low-level bindings (CUDA backend only).

One cuBLASLt handle per device (made with the device's primary context current),
plans (descriptor, layouts, the heuristic's best algorithm) cached per problem
(:class:`GemmDesc`), and a 32 MiB workspace per stream, allocated from the device's
memory pool the first time a stream runs a GEMM and freed, stream-ordered, when the
stream is destroyed. Inside a graph capture GEMMs run without a workspace (a graph must
not depend on a stream's workspace, which may be gone when it replays).

A GEMM that a replayed recipe makes again (same desc, addresses and stream; see
CudaDevice.matmul) is captured once and launched as a graph from then on: the graph is
per stream (it may use the stream's workspace) and goes with the stream or the context.

Row-major ``D = A @ B`` is computed as column-major ``D^T = B^T A^T``: cuBLASLt's A is
our B and its B our A, so D needs no transpose and a bias of ``n`` elements (one per
output column, what a linear layer adds) is cuBLASLt's per-row bias.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ._boundary import GemmDesc, GemmOperand

__all__ = ["Gemms"]

WORKSPACE = 32 << 20
MAX_GRAPHS = 256  # replayed GEMMs kept as graphs per device (the least recently used goes first)
_import_lock = threading.Lock()
_mods: tuple[Any, Any, Any] | None = None


def _lt() -> tuple[Any, Any, Any]:
    """(cublasLt bindings, cublas enums, CUDA data types), imported on first use."""
    global _mods
    if _mods is None:
        with _import_lock:
            if _mods is None:
                try:
                    from nvmath import CudaDataType
                    from nvmath.bindings import cublas, cublasLt
                except ImportError as err:
                    raise ImportError(
                        "ops.matmul and ops.linear on CUDA need nvmath-python (pip install 'trio-cuda[cuda]' "
                        "or pip install nvmath-python)"
                    ) from err
                _mods = (cublasLt, cublas, CudaDataType)
    return _mods


def _set(setter: Any, dtype_of: Any, obj: int, attr: Any, value: Any) -> None:
    buf = np.array(value, dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


class _Plan:
    """A cuBLASLt matmul for one GemmDesc: descriptor, layouts, algorithm."""

    def __init__(self, handle: int, desc: GemmDesc, workspace: int) -> None:
        lt, cublas, DT = _lt()
        MD, ML, MP = lt.MatmulDescAttribute, lt.MatrixLayoutAttribute, lt.MatmulPreferenceAttribute
        dt = {"float16": DT.CUDA_R_16F, "bfloat16": DT.CUDA_R_16BF, "float32": DT.CUDA_R_32F, "float64": DT.CUDA_R_64F}[
            desc.dtype
        ]
        self.scalar: Any
        if desc.dtype == "float64":
            compute, scale, self.scalar = cublas.ComputeType.COMPUTE_64F, DT.CUDA_R_64F, np.float64
        elif desc.dtype == "float32" and desc.allow_tf32:
            compute, scale, self.scalar = cublas.ComputeType.COMPUTE_32F_FAST_TF32, DT.CUDA_R_32F, np.float32
        else:
            compute, scale, self.scalar = cublas.ComputeType.COMPUTE_32F, DT.CUDA_R_32F, np.float32
        self.lt = lt
        self._objs: list[tuple[Any, int]] = []
        d = lt.matmul_desc_create(compute, scale)
        self._objs.append((lt.matmul_desc_destroy, d))
        self.desc = d

        def set_desc(attr: Any, value: Any) -> None:
            _set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, d, attr, value)

        def layout(op: GemmOperand, rows: int, cols: int) -> int:
            # cuBLASLt sees our row-major (rows x cols) matrix as column-major (cols x rows).
            if op.col_major:
                lay = lt.matrix_layout_create(dt, rows, cols, op.ld)
            else:
                lay = lt.matrix_layout_create(dt, cols, rows, op.ld)
            self._objs.append((lt.matrix_layout_destroy, lay))
            if desc.batch > 1:
                _set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype, lay, ML.BATCH_COUNT, desc.batch)
                _set(
                    lt.matrix_layout_set_attribute,
                    lt.get_matrix_layout_attribute_dtype,
                    lay,
                    ML.STRIDED_BATCH_OFFSET,
                    op.batch_stride,
                )
            return int(lay)

        # cuBLASLt's A is our B^T (n x k), its B our A^T (k x m): a col-major operand of
        # ours is the transpose of what cuBLASLt expects.
        set_desc(MD.TRANSA, cublas.Operation.T if desc.b.col_major else cublas.Operation.N)
        set_desc(MD.TRANSB, cublas.Operation.T if desc.a.col_major else cublas.Operation.N)
        self.la = layout(desc.b, desc.k, desc.n)
        self.lb = layout(desc.a, desc.m, desc.k)
        self.ld = layout(GemmOperand(desc.m, desc.n, desc.n, False, desc.m * desc.n), desc.m, desc.n)
        epi = lt.Epilogue
        epilogue = {
            ("none", False): epi.DEFAULT,
            ("none", True): epi.BIAS,
            ("relu", False): epi.RELU,
            ("relu", True): epi.RELU_BIAS,
            ("gelu", False): epi.GELU,
            ("gelu", True): epi.GELU_BIAS,
        }[(desc.activation, desc.has_bias)]
        set_desc(MD.EPILOGUE, epilogue)
        self.has_bias = desc.has_bias
        if desc.has_bias:
            set_desc(MD.BIAS_POINTER, 0)
            set_desc(MD.BIAS_BATCH_STRIDE, 0)  # one bias for every matrix of the batch
        pref = lt.matmul_preference_create()
        self._objs.append((lt.matmul_preference_destroy, pref))
        _set(
            lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype, pref, MP.MAX_WORKSPACE_BYTES, workspace
        )
        for attr in (MP.MIN_ALIGNMENT_A_BYTES, MP.MIN_ALIGNMENT_B_BYTES, MP.MIN_ALIGNMENT_C_BYTES, MP.MIN_ALIGNMENT_D_BYTES):
            _set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype, pref, attr, desc.align)
        results = lt.MatmulHeuristicResult(8)
        count = np.zeros(1, np.int32)
        lt.matmul_algo_get_heuristic(handle, d, self.la, self.lb, self.ld, self.ld, pref, 8, results.ptr, count.ctypes.data)
        n = int(count[0])
        if n == 0:
            raise RuntimeError("cuBLASLt has no algorithm for this problem")
        self._results = results[:n]  # the algo pointer points into it
        self.algo = self._results[0]["algo"].ctypes.data
        # (a single heuristic result reads back as a scalar, not an array of one)
        self.workspace = int(np.asarray(self._results.workspace_size).reshape(-1)[0])
        # Pointers taken once (numpy's .ctypes costs microseconds per use).
        self.alpha = np.array(1, dtype=self.scalar)
        self.beta = np.array(0, dtype=self.scalar)
        self.alpha_ptr = self.alpha.ctypes.data
        self.beta_ptr = self.beta.ctypes.data
        self.bias_buf = np.zeros(1, dtype=lt.get_matmul_desc_attribute_dtype(MD.BIAS_POINTER))
        self.bias_ptr = self.bias_buf.ctypes.data
        self.bias_attr = MD.BIAS_POINTER
        self.handle = handle

    def run(self, a: int, b: int, d: int, bias: int, ws: int, ws_bytes: int, stream: int) -> None:
        lt = self.lt
        if self.has_bias:
            self.bias_buf[0] = bias
            lt.matmul_desc_set_attribute(self.desc, self.bias_attr, self.bias_ptr, self.bias_buf.itemsize)
        lt.matmul(
            self.handle,
            self.desc,
            self.alpha_ptr,
            b,
            self.la,
            a,
            self.lb,
            self.beta_ptr,
            d,
            self.ld,
            d,
            self.ld,
            self.algo,
            ws,
            ws_bytes,
            stream,
        )

    def close(self) -> None:
        for destroy, obj in reversed(self._objs):
            try:
                destroy(obj)
            except Exception:  # a context torn down by a reset: the objects went with it
                pass
        self._objs = []


class Gemms:
    """The cuBLASLt state of one device (used under the runtime lock)."""

    def __init__(self) -> None:
        self.handle: int | None = None
        self.plans: dict[tuple[GemmDesc, bool], _Plan] = {}
        self.workspaces: dict[int, int] = {}  # stream handle -> device pointer
        # Replayed GEMMs (CudaDevice.matmul with reuse): (desc, a, b, d, bias, stream
        # handle) -> (exec handle, exec) of the captured library call; the keys whose
        # call could not be captured; the stream captures run on. (``replay`` False, a
        # test hook, calls the library for every GEMM.)
        self.replay = True
        self.graphs: dict[tuple[Any, ...], tuple[int, Any]] = {}
        self.refused: set[tuple[Any, ...]] = set()
        self.capture_stream: Any = None
        self.capture_ok = True  # False once graphs were evicted faster than replayed
        self.evictions = 0
        self.captures = 0  # graphs made
        self.replays = 0  # GEMMs launched as a graph

    def plan(self, desc: GemmDesc, capturing: bool) -> _Plan:
        key = (desc, capturing)
        p = self.plans.get(key)
        if p is None:
            lt, _, _ = _lt()
            if self.handle is None:
                self.handle = lt.create()
            if len(self.plans) > 256:
                for old in self.plans.values():
                    old.close()
                self.plans.clear()
            p = self.plans[key] = _Plan(self.handle, desc, 0 if capturing else WORKSPACE)
        return p

    def refuse(self, key: tuple[Any, ...]) -> None:
        """The call of ``key`` cannot be captured: it is not tried again."""
        if len(self.refused) >= 4 * MAX_GRAPHS:
            self.refused.clear()
        self.refused.add(key)

    def keep(self, key: tuple[Any, ...], graph: tuple[int, Any], destroy: Any) -> tuple[int, Any]:
        """Keep the graph of ``key``, destroying the least recently used past MAX_GRAPHS
        (the driver frees one still running when it completes). A device whose graphs
        churn (more than one eviction per 8 replays, past the first 64) captures no more:
        each capture would cost far more than the library call it replaces."""
        graphs = self.graphs
        while graphs and len(graphs) >= MAX_GRAPHS:
            destroy(graphs.pop(next(iter(graphs)))[1])
            self.evictions += 1
            if self.evictions > 64 and self.evictions * 8 > self.replays:
                self.capture_ok = False
        graphs[key] = graph
        self.captures += 1
        return graph

    def drop(self, key: tuple[Any, ...], destroy: Any) -> None:
        """The graph of ``key`` failed to launch: it goes, and the key is refused."""
        g = self.graphs.pop(key, None)
        if g is not None:
            destroy(g[1])
        self.refuse(key)

    def drop_stream(self, stream: int, destroy: Any) -> None:
        """``stream`` is being destroyed: its graphs go (they use its workspace)."""
        for key in [k for k in self.graphs if k[5] == stream]:
            destroy(self.graphs.pop(key)[1])
        self.refused = {k for k in self.refused if k[5] != stream}

    def close(self, destroy_graph: Any, destroy_stream: Any) -> None:
        """Destroy the graphs and the capture stream now (at exit); no more are made."""
        self.replay = False
        graphs, self.graphs = self.graphs, {}
        for _, g in list(graphs.values()):
            destroy_graph(g)
        cs, self.capture_stream = self.capture_stream, None
        if cs is not None:
            destroy_stream(cs)

    def forget(self) -> None:
        """After a reset: every handle, plan, workspace and graph went with the context."""
        self.handle = None
        self.plans = {}
        self.workspaces = {}
        self.graphs = {}
        self.refused = set()
        self.capture_stream = None
