"""Where scaled_dot_product_attention's host time goes on CUDA: cuDNN frontend's execute
called with a uid map of raw pointers (what trio-cuda does today), with the ordered form
(``tensor_uids=``, a tuple of pointers), with a map of torch tensors, against PyTorch's SDPA.

Usage: python benchmarks/probes/probe_sdpa_host.py [--calls 300] [--seq 1024]

bf16, batch 8, heads 16, head_dim 128, causal and not. Each form is first checked against
PyTorch (largest difference printed), then ``--calls`` calls are enqueued back to back on
one stream: the host's time per call (the loop alone) and the wall time per call with
the final synchronize (host-bound when the first is the larger). Needs PyTorch and
cudnn-frontend; the plan is trio-cuda's own (``_backends._cudnn._Plan``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from trio_cuda._backends._boundary import AttentionDesc
from trio_cuda._backends._cudnn import _c_strides, _Plan, load


def timed(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def case(cudnn: Any, handle: Any, s: int, causal: bool, calls: int) -> None:
    """One case's forms, checked and timed, as table rows."""
    b, h, d = 8, 16, 128
    shape = (b, h, s, d)
    strides = tuple(_c_strides(shape))
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    desc = AttentionDesc(b, h, s, s, d, d, "bfloat16", d**-0.5, causal, strides, strides, strides, strides)  # type: ignore[arg-type]
    plan = _Plan(cudnn, handle, desc, True)
    ws = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device="cuda")
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
    uids = tuple(t.get_uid() for t in (plan.q, plan.k, plan.v, plan.o))
    wsp = ws.data_ptr() if plan.workspace else None
    forms: dict[str, Callable[[], Any]] = {
        "uid map of pointers (today)": lambda: plan.run(*ptrs[:3], 0, ptrs[3], ws.data_ptr()),
        "ordered pointers (tensor_uids)": lambda: plan.graph.execute(ptrs, wsp, handle=handle, tensor_uids=uids),
        "map of torch tensors": lambda: plan.graph.execute(
            {plan.q: q, plan.k: k, plan.v: v, plan.o: o}, ws if plan.workspace else None, handle=handle
        ),
    }
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    name_of_case = f"s{s} {'causal' if causal else 'full'}"
    for name, fn in forms.items():
        try:
            o.zero_()
            fn()
            torch.cuda.synchronize()
            diff = float((o.float() - want.float()).abs().max())
            host, wall = timed(fn, calls)
            print(f"| {name_of_case} | {name} | {host:.1f} | {wall:.1f} | {diff:.3g} |")
        except Exception as exc:  # a form this frontend refuses: say so, go on
            print(f"| {name_of_case} | {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | |")
    host, wall = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), calls)
    print(f"| {name_of_case} | torch SDPA | {host:.1f} | {wall:.1f} | 0 |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    cudnn = load()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    print(f"cudnn-frontend {getattr(cudnn, '__version__', '?')}, cuDNN {cudnn.backend_version()}, torch {torch.__version__}")
    print("| case | form | host us/call | wall us/call | max diff |")
    print("|---|---|---|---|---|")
    for causal in (False, True):
        case(cudnn, handle, a.seq, causal, a.calls)


if __name__ == "__main__":
    main()
