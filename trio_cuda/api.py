"""Tensor constructors and copies: ``from trio_cuda import api``.

Each function returns a lazy :class:`~trio_cuda.DeviceOp`; see ``trio_cuda._api``.
"""

from typing import Any

from ._api import arange, dup, empty, from_host, full, memcpy, ones, zeros
from ._interop import from_dlpack
from ._tensor import Tensor

__all__ = ["arange", "asarray", "dup", "empty", "from_dlpack", "from_host", "full", "memcpy", "ones", "zeros"]


def asarray(obj: Any, *, device: Any = None) -> Tensor:
    """``obj`` as a tensor without a copy: a tensor itself, or another library's array
    (see :func:`from_dlpack`); host data is uploaded with :func:`from_host` instead."""
    return from_dlpack(obj, device=device)
