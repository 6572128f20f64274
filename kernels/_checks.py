"""Argument checks shared by the library kernels (run before any GPU work)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio_cuda


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    return x.shape, x.dtype


def same_shape(name: str, *positions: int) -> Callable[..., None]:
    """A validator: the arguments at ``positions`` are tensors/partitions of one shape and dtype."""

    def check(*args: Any) -> None:
        first = None
        for p in positions:
            a = args[p]
            if not isinstance(a, (trio_cuda.Tensor, trio_cuda.Partition)):
                raise TypeError(f"{name}: argument {p} must be a tensor or partition, got {type(a).__name__}")
            sd = _shape_dtype(a)
            if first is None:
                first = (p, sd)
            elif sd[0] != first[1][0]:
                raise ValueError(f"{name}: argument {p} has shape {sd[0]}, argument {first[0]} has {first[1][0]}")
            elif sd[1] != first[1][1]:
                raise TypeError(f"{name}: argument {p} has dtype {sd[1]}, argument {first[0]} has {first[1][1]}")
            if a.ndim > 3:
                raise ValueError(f"{name}: at most 3 dims, got shape {a.shape}")

    return check
