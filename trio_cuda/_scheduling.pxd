# Cython declarations for _scheduling.py when it is compiled (see _stream.pxd): the
# default policy's state, whose choice runs on every await, with typed fields.

cimport cython

from trio_cuda._loop cimport current_task
from trio_cuda._stream cimport Stream


cdef class _Pool:
    cdef public object device
    cdef public Py_ssize_t asked
    cdef public Py_ssize_t cap
    cdef public Py_ssize_t choices
    cdef public Py_ssize_t cursor
    cdef public Py_ssize_t grown
    cdef public list handed
    cdef public list handed_at
    cdef public Py_ssize_t idle
    cdef public Py_ssize_t kept
    cdef public dict of
    cdef public list owners
    cdef public Py_ssize_t shared
    cdef public list spare
    cdef public list streams

    @cython.locals(s=Stream, i=Py_ssize_t)
    cpdef Stream submission_stream(self)
    cpdef Stream next_stream(self)
    @cython.locals(s=Stream, streams=list, n=Py_ssize_t, start=Py_ssize_t, pick=Py_ssize_t, k=Py_ssize_t, i=Py_ssize_t, asked=Py_ssize_t)
    cpdef Stream choose(self, object me, Py_ssize_t own)
    cpdef bint reserved(self, Py_ssize_t i) except -1
    cpdef object hand_out(self, Py_ssize_t i, object me)
