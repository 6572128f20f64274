"""Tensor constructors and copies: ``from trio_cuda import api``.

Each function returns a lazy :class:`~trio_cuda.DeviceOp`; see ``trio_cuda._api``.
"""

from ._api import arange, dup, empty, from_host, full, memcpy, ones, zeros

__all__ = ["arange", "dup", "empty", "from_host", "full", "memcpy", "ones", "zeros"]
