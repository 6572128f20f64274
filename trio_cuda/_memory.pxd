# Cython declarations for _memory.py when it is compiled (see _stream.pxd).

cdef class Buffer:
    cdef object __weakref__
    cdef public object args
    cdef public object capture
    cdef public object device
    cdef public object generation
    cdef public dict lifetime
    cdef public object nbytes
    cdef public object owner
    cdef public object ptr
    cdef public dict readers
    cdef public object writer
