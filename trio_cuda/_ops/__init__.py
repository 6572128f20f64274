"""The op library behind :mod:`trio_cuda.ops` (tensor math as DeviceOps).

``_core``: operands, dtypes, broadcasting, outputs and launches; ``_codegen``: the
numba-cuda kernels the ops generate (and their numpy twins for the simulated device);
one module per family above them; ``trio_cuda.ops`` is the public face.
"""
