# Cython declarations for _tensor.py when it is compiled (see _stream.pxd).

from trio_cuda._memory cimport Buffer
from trio_cuda._op cimport TensorMath


cdef class Tensor(TensorMath):
    cdef public object _args
    cdef public Buffer _buffer
    cdef public object _offset
    cdef public object _strides
    cdef public object _tracked
    cdef public object dtype
    cdef public object shape


cdef class Partition:
    cdef public object _k
    cdef public object grid
    cdef public Tensor tensor
    cdef public object tile_shape
