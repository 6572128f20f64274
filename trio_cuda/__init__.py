"""trio-cuda: CUDA work as a first-class citizen of trio's structured concurrency.

Describe GPU work as lazy :class:`DeviceOp` objects, compose them with ``then``,
``map``, :func:`trio_cuda.zip`, ``unzip`` and ``shared``, and ``await`` them inside
trio nurseries. The public API is everything re-exported here, plus
``trio_cuda.api`` (tensor constructors and copies), ``trio_cuda.ops`` (tensor math),
``trio_cuda.lowlevel`` (streams and events) and ``trio_cuda.kernels`` (the kernel library).

``trio_cuda.zip`` is not in ``__all__``: ``from trio_cuda import *`` must not shadow
the builtin ``zip``.

The backend (CUDA or the simulated device) is chosen when this package is imported;
import it before ``numba.cuda``.
"""

from typing import TYPE_CHECKING

from ._backends import select as _select

_select()

from . import (  # noqa: E402
    _interop,  # noqa: F401  (Tensor.__dlpack__ and the CUDA Array Interface)
    api,
    lowlevel,
    ops,
)
from ._backends import backend_name  # noqa: E402
from ._compiled import check_required as _check_required  # noqa: E402
from ._device import Device, DeviceStatistics  # noqa: E402
from ._errors import (  # noqa: E402
    DeviceError,
    DeviceFault,
    DeviceOutOfMemory,
    DeviceReset,
    DeviceUnavailable,
    ExternalCallError,
    ForkedProcessError,
    GraphCaptureError,
    LaunchError,
    NestedExecutionError,
    OpAlreadyExecuted,
)
from ._external import external  # noqa: E402
from ._graph import CudaGraph, GraphScope, capture_graph  # noqa: E402
from ._kernel import Kernel, kernel  # noqa: E402
from ._op import DeviceOp, ScheduledOp, SharedOp, SharedTensorOp, TensorValuedOp  # noqa: E402
from ._registry import current_device, device, device_count, devices, use_device  # noqa: E402
from ._scheduling import PoolStatistics, SchedulingPolicy, SingleStream, StreamPoolByLoad, StreamPoolRoundRobin  # noqa: E402
from ._stream import Stream  # noqa: E402
from ._tensor import Partition, Tensor  # noqa: E402
from ._zip import value  # noqa: E402
from ._zip import zip as zip  # noqa: E402  (public, but not in __all__: it would shadow the builtin)

_check_required()

__version__ = "0.2.0"

__all__ = [
    "CudaGraph",
    "Device",
    "DeviceError",
    "DeviceFault",
    "DeviceOp",
    "DeviceOutOfMemory",
    "DeviceReset",
    "DeviceStatistics",
    "DeviceUnavailable",
    "ExternalCallError",
    "ForkedProcessError",
    "GraphCaptureError",
    "GraphScope",
    "Kernel",
    "LaunchError",
    "NestedExecutionError",
    "OpAlreadyExecuted",
    "Partition",
    "PoolStatistics",
    "ScheduledOp",
    "SchedulingPolicy",
    "SharedOp",
    "SharedTensorOp",
    "SingleStream",
    "Stream",
    "StreamPoolByLoad",
    "StreamPoolRoundRobin",
    "Tensor",
    "TensorValuedOp",
    "api",
    "backend_name",
    "capture_graph",
    "current_device",
    "device",
    "device_count",
    "external",
    "devices",
    "kernel",
    "lowlevel",
    "ops",
    "trace",
    "use_device",
    "value",
]


if TYPE_CHECKING:
    from . import trace as trace


def __getattr__(name: str) -> object:
    # trio_cuda.trace (a callable module: trio_cuda.trace(path) opens a trace) is imported
    # on first use, so that ``python -m trio_cuda.trace`` runs it fresh
    if name == "trace":
        import importlib

        return importlib.import_module(".trace", __name__)
    raise AttributeError(f"module 'trio_cuda' has no attribute {name!r}")
