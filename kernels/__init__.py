"""The trio-cuda kernel library, installed as ``trio_cuda.kernels``.

Kernel definitions only, written against :func:`trio_cuda.kernel`. Each is a
launcher: call it with tensors, partitions, ops and scalars to get a DeviceOp.
"""

from ._decode import MATVEC_ROWS, matvec, rms_norm
from ._elementwise import add, saxpy
from ._timing import sleep

__all__ = ["MATVEC_ROWS", "add", "matvec", "rms_norm", "saxpy", "sleep"]
