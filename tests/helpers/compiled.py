"""Helpers only the tests of the compiled hot path (tests/compiled/) use."""

from __future__ import annotations

from typing import Any

import numpy as np

from trio_cuda import api
from trio_cuda.kernels import add


async def operands() -> tuple[Any, Any, Any]:
    x = await api.full((64,), 2.0, np.float32)
    y = await api.full((64,), 3.0, np.float32)
    z = await api.zeros((64,), np.float32)
    await add(z.partition((32,)), x, y)  # compiled, and its arguments seen: the next one is direct
    return x, y, z
