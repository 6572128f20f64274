# Cython declarations for _op.py when it is compiled (see _stream.pxd): TensorMath is an
# extension type (of no fields) so that Tensor, which derives from it, can be one.

cdef class TensorMath:
    pass
