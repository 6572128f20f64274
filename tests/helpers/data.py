"""Host data for the tests."""

from __future__ import annotations

import numpy as np

RNG = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return RNG.uniform(-2, 2, shape).astype(np.float32)
