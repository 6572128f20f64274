"""PyTorch's optimizer formulas in numpy (float64): the references of the optimizer-step tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def adamw_ref(p: Any, g: Any, m: Any, v: Any, lr: float, step: int, b1: float, b2: float, eps: float, wd: float) -> Any:
    """torch.optim.AdamW's update (decoupled weight decay, bias correction): (p, m, v)."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr / (1 - b1**step) * m / (np.sqrt(v) / np.sqrt(1 - b2**step) + eps)
    return p, m, v


def sgd_ref(p: Any, g: Any, buf: Any, lr: float, momentum: float, dampening: float, wd: float, nesterov: bool) -> Any:
    """torch.optim.SGD's update, the buffer starting at zero: (p, buf)."""
    g = g + wd * p
    if momentum:
        buf = momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf
