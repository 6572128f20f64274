"""Which of trio-cuda's own modules run compiled (by Cython, from the same ``.py``).

``MODULES`` is the list ``setup.py`` compiles when Cython and a C compiler are present at
install; each is optional (a failed compile leaves that module interpreted). This file
imports nothing of trio-cuda: setup.py reads ``MODULES`` from it without importing the
package.
"""

from __future__ import annotations

import importlib
import importlib.machinery

__all__ = ["MODULES", "check_required", "compiled_modules"]

#: The modules of the per-await and per-submission path, compiled as they are.
MODULES: tuple[str, ...] = (
    "trio_cuda._backends._cuda",
    "trio_cuda._backends._cudaerrors",
    "trio_cuda._backends._cudakernels",
    "trio_cuda._device",
    "trio_cuda._device_stats",
    "trio_cuda._direct",
    "trio_cuda._forecast",
    "trio_cuda._guard",
    "trio_cuda._kernel",
    "trio_cuda._loop",
    "trio_cuda._memory",
    "trio_cuda._notifier",
    "trio_cuda._op",
    "trio_cuda._ops._core",
    "trio_cuda._ops._elementwise",
    "trio_cuda._ops._layout",
    "trio_cuda._ops._matmul",
    "trio_cuda._ops._norm",
    "trio_cuda._ops._reduce",
    "trio_cuda._pending",
    "trio_cuda._plan",
    "trio_cuda._scheduling",
    "trio_cuda._stream",
    "trio_cuda._submission",
    "trio_cuda._tensor",
    "trio_cuda._writes",
    "trio_cuda.ops",
)


def compiled_modules() -> tuple[str, ...]:
    """The modules of ``MODULES`` that were imported from a compiled extension."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    out = []
    for name in MODULES:
        path = getattr(importlib.import_module(name), "__file__", None) or ""
        if path.endswith(suffixes):
            out.append(name)
    return tuple(out)


def check_required() -> None:
    """With ``TRIO_CUDA_REQUIRE_COMPILED=1`` (CI's compiled pass): raise ImportError
    unless every module of ``MODULES`` is compiled."""
    from ._config import env_flag  # (here, not at the top: setup.py reads this file alone)

    if not env_flag("TRIO_CUDA_REQUIRE_COMPILED"):  # a bad value raises, naming the variable
        return
    missing = sorted(set(MODULES) - set(compiled_modules()))
    if missing:
        raise ImportError(
            "TRIO_CUDA_REQUIRE_COMPILED=1, but these modules are not compiled: "
            + ", ".join(missing)
            + " (install with Cython and a C compiler present, or run `python setup.py build_ext --inplace`)"
        )
