"""Backend selection.

The backend is chosen once per process, when ``trio_cuda`` is imported:

* ``TRIO_CUDA_BACKEND=sim`` or ``=cuda`` forces one;
* otherwise CUDA is used when a driver and at least one device are present, and the
  simulated device when not.

numba's CUDA simulator is process-wide and must be switched on before
``numba.cuda`` is first imported, so the choice is made (and numba configured) at
import time; the backend object itself, which opens devices, is created lazily.
"""

from __future__ import annotations

import os
import sys
import threading

from .._config import env_choice, env_flag
from .._errors import DeviceUnavailable
from .._guard import check_not_forked, mark_started
from ._boundary import Backend

__all__ = ["backend", "backend_name", "select"]

_choice: tuple[str, str] | None = None  # (name, reason)
_backend: Backend | None = None
_lock = threading.Lock()


def _cuda_device_count() -> int:
    try:
        from cuda.bindings import driver
    except Exception:
        return 0
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        mark_started()  # a forked child cannot use an initialized CUDA driver
        err, count = driver.cuDeviceGetCount()
        return count if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


def select() -> tuple[str, str]:
    """Decide the backend (once) and configure numba for it. Returns (name, reason)."""
    global _choice
    if _choice is not None:
        return _choice
    forced = env_choice("TRIO_CUDA_BACKEND", ("sim", "cuda"), "")
    numba_sim = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    if forced == "sim":
        choice = ("sim", "TRIO_CUDA_BACKEND=sim")
    elif forced == "cuda":
        if numba_sim:
            raise ValueError("TRIO_CUDA_BACKEND=cuda contradicts NUMBA_ENABLE_CUDASIM=1")
        choice = ("cuda", "TRIO_CUDA_BACKEND=cuda")
    elif numba_sim:
        choice = ("sim", "NUMBA_ENABLE_CUDASIM=1")
    elif _cuda_device_count() > 0:
        choice = ("cuda", "a CUDA driver and device are present")
    else:
        choice = ("sim", "no CUDA driver or device found")
    _configure_numba(choice[0])
    _choice = choice
    return choice


def _configure_numba(name: str) -> None:
    want_sim = name == "sim"
    if "numba.cuda" in sys.modules:
        from numba import config

        if bool(config.ENABLE_CUDASIM) != want_sim:
            mode = "simulator" if config.ENABLE_CUDASIM else "CUDA"
            raise RuntimeError(
                f"numba.cuda was imported in {mode} mode before trio_cuda chose the "
                f"{name!r} backend; import trio_cuda before numba.cuda (or set "
                f"TRIO_CUDA_BACKEND={'sim' if config.ENABLE_CUDASIM else 'cuda'})"
            )
        return
    if want_sim:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        if "numba" in sys.modules:  # numba's config was read already; refresh it
            from numba.core import config

            config.reload_config()


def backend_name() -> str:
    """The name of the selected backend: ``"cuda"`` or ``"sim"``."""
    return select()[0]


def backend() -> Backend:
    """The process-wide backend, created (and announced on stderr) on first use.

    Raises:
        ForkedProcessError: This process was forked from one that had started trio-cuda.
    """
    global _backend
    check_not_forked()
    if _backend is not None:
        return _backend
    mark_started()  # before the lock: a child forked while it is held refuses to use it
    with _lock:
        if _backend is None:
            name, reason = select()
            if name == "cuda":
                if _cuda_device_count() == 0:
                    raise DeviceUnavailable(f"the CUDA backend was requested ({reason}) but no CUDA device is usable")
                from ._cuda import CudaBackend

                b: Backend = CudaBackend()
            else:
                from ._sim import SimBackend

                b = SimBackend()
            if not env_flag("TRIO_CUDA_QUIET"):
                print(f"trio-cuda: {b.description} [{reason}]", file=sys.stderr)
            _backend = b
    return _backend
