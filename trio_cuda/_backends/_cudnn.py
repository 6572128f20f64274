"""Fused attention on cuDNN through its Python frontend, nvidia-cudnn-frontend (CUDA
backend only; an optional dependency, imported at the first attention).

One cuDNN handle per device, made with the device's primary context current, and bound
to the stream of each call (``cudnn.set_stream`` only when the stream changes: each
bind costs several driver queries). One SDPA graph per problem (:class:`AttentionDesc`:
shapes, strides, dtype, scale, causal, bias shape) and kind (free to use a workspace,
or not), validated, planned and built at its first call, then executed with a variant
pack of raw device pointers.

Workspace: a stream's grows to the largest a plan run on it needs, from the device's
memory pool; the smaller one it replaces is freed stream-ordered on that stream (after
the calls that used it), the last one with the stream (CudaDevice.destroy_stream).
Inside a graph capture and on another library's stream only plans that need no
workspace run (a graph must not depend on a stream's workspace, which may be gone when
it replays; another library may destroy its stream and reuse the handle): when cuDNN's
best plan needs one, a plan without is built for those calls; a problem with none is
refused (GraphCaptureError inside a capture, LaunchError otherwise).

Plans are never evicted (one could still be running when it would be: nothing tells when
the kernels of a built cuDNN plan are done with it); a reset drops them all with the
context.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._errors import DeviceError, GraphCaptureError, LaunchError
from ._boundary import AttentionDesc

__all__ = ["Attentions", "load"]

_import_lock = threading.Lock()
_cudnn: Any = None


def load() -> Any:
    """The ``cudnn`` module, imported on first use; ImportError saying what to install."""
    global _cudnn
    if _cudnn is None:
        with _import_lock:
            if _cudnn is None:
                try:
                    import cudnn
                except ImportError as err:
                    raise ImportError(
                        "ops.scaled_dot_product_attention on CUDA needs cuDNN's Python frontend "
                        "(pip install 'trio-cuda[cuda]' or pip install nvidia-cudnn-frontend)"
                    ) from err
                _cudnn = cudnn
    return _cudnn


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return out[::-1]


class _Plan:
    """A built cuDNN SDPA forward graph for one AttentionDesc."""

    def __init__(self, cudnn: Any, handle: Any, desc: AttentionDesc, workspace_ok: bool) -> None:
        dt = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}[desc.dtype]
        f32 = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        qs, ks, vs, os_ = desc.shapes
        self.q = g.tensor(name="q", dim=list(qs), stride=list(desc.q_strides), data_type=dt)
        self.k = g.tensor(name="k", dim=list(ks), stride=list(desc.k_strides), data_type=dt)
        self.v = g.tensor(name="v", dim=list(vs), stride=list(desc.v_strides), data_type=dt)
        kw: dict[str, Any] = {}
        self.bias = None
        if desc.bias_shape is not None:
            bs = desc.bias_shape
            self.bias = kw["bias"] = g.tensor(name="bias", dim=list(bs), stride=_c_strides(bs), data_type=dt)
        if desc.causal:  # top-left aligned: query i sees keys j <= i
            kw["diagonal_alignment"] = cudnn.diagonal_alignment.TOP_LEFT
            kw["diagonal_band_right_bound"] = 0
        o, _ = g.sdpa(name="sdpa", q=self.q, k=self.k, v=self.v, attn_scale=float(desc.scale), generate_stats=False, **kw)
        o.set_output(True).set_dim(list(os_)).set_stride(list(desc.o_strides)).set_data_type(dt)
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if not workspace_ok:
            g.deselect_workspace_greater_than(0)
        g.check_support()
        g.build_plans()
        self.workspace = int(g.get_workspace_size())
        if self.workspace and not workspace_ok:
            raise RuntimeError(f"cuDNN has no plan without a workspace for it (the best needs {self.workspace} bytes)")
        self.graph = g
        self.handle = handle

    def run(self, q: int, k: int, v: int, bias: int, o: int, ws: int) -> None:
        pack = {self.q: q, self.k: k, self.v: v, self.o: o}
        if self.bias is not None:
            pack[self.bias] = bias
        self.graph.execute(pack, ws if self.workspace else None, handle=self.handle)


class Attentions:
    """The cuDNN state of one device (used under the runtime lock)."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.stream: int | None = None  # the stream the handle is bound to
        self.plans: dict[tuple[AttentionDesc, bool], _Plan] = {}
        self.workspaces: dict[int, tuple[int, int]] = {}  # stream handle -> (device pointer, bytes)

    def plan(self, desc: AttentionDesc, workspace_ok: bool) -> _Plan:
        """The plan of ``desc``; without ``workspace_ok`` one that needs no workspace."""
        p = self.plans.get((desc, workspace_ok))
        if p is not None:
            return p
        if not workspace_ok:
            best = self.plans.get((desc, True))
            if best is not None and not best.workspace:
                self.plans[(desc, False)] = best
                return best
        cudnn = load()
        if self.handle is None:
            self.handle = cudnn.create_handle()
        p = _Plan(cudnn, self.handle, desc, True)
        self.plans[(desc, True)] = p
        if not workspace_ok and p.workspace:
            p = _Plan(cudnn, self.handle, desc, False)
        self.plans[(desc, workspace_ok)] = p
        return p

    def call(
        self,
        desc: AttentionDesc,
        q: int,
        k: int,
        v: int,
        bias: int,
        o: int,
        stream: int,
        capturing: bool,
        foreign: bool,
        alloc: Callable[[int], int],
        free: Callable[[int], None],
        ordinal: int,
    ) -> None:
        """Enqueue ``desc`` on ``stream`` (CudaDevice.attention; ``alloc(nbytes)`` and
        ``free(ptr)``: device memory ordered on that stream): inside a capture and on
        another library's stream, a plan that needs no workspace."""
        try:
            plan = self.plan(desc, not (capturing or foreign))
        except ImportError:
            raise
        except Exception as exc:  # the library refuses the problem (or has no plan without a workspace)
            raise _error(desc, capturing, "cannot run", exc, ordinal) from exc
        ws = 0
        if plan.workspace:
            ws = self.workspace(stream, plan.workspace, alloc, free)
        try:
            self.bind(stream)
            plan.run(q, k, v, bias, o, ws)
        except Exception as exc:
            raise _error(desc, capturing, "failed to enqueue", exc, ordinal) from exc

    def bind(self, stream: int) -> None:
        """Run the handle's next calls on ``stream``."""
        if stream != self.stream:
            load().set_stream(self.handle, stream)
            self.stream = stream

    def workspace(self, stream: int, nbytes: int, alloc: Callable[[int], int], free: Callable[[int], None]) -> int:
        """``stream``'s workspace, of at least ``nbytes`` (grown stream-ordered: ``free``
        releases the old one after the calls queued on the stream so far)."""
        have = self.workspaces.get(stream)
        if have is not None and have[1] >= nbytes:
            return have[0]
        ptr = alloc(nbytes)
        if have is not None:
            free(have[0])
        self.workspaces[stream] = (ptr, nbytes)
        return ptr

    def drop_stream(self, stream: int) -> int | None:
        """``stream`` is being destroyed: its workspace (to free on it), if any; the
        handle goes back to the null stream if it was bound to it (a new stream may get
        the same handle value, which ``cudnn.set_stream`` would take as unchanged)."""
        if self.stream == stream and self.handle is not None:
            load().set_stream(self.handle, 0)
            self.stream = 0
        ws = self.workspaces.pop(stream, None)
        return None if ws is None else ws[0]

    def forget(self) -> None:
        """After a reset: the handle, plans and workspaces went with the context."""
        self.handle = None
        self.stream = None
        self.plans = {}
        self.workspaces = {}


def _error(desc: AttentionDesc, capturing: bool, what: str, exc: Exception, ordinal: int) -> DeviceError:
    qs, ks, vs, _ = desc.shapes
    err = GraphCaptureError if capturing else LaunchError
    during = " inside a graph capture" if capturing else ""
    return err(
        f"cuDNN {what} scaled_dot_product_attention of q {qs}, k {ks}, v {vs} ({desc.dtype}){during}: {exc}",
        device=ordinal,
        op="scaled_dot_product_attention",
    )
