# Cython declarations for _ops/_core.py when it is compiled (see trio_cuda/_stream.pxd):
# a replayed op's recipe and its direct submission, typed.

cimport cython

from trio_cuda._device cimport Device
from trio_cuda._direct cimport direct_enqueue, direct_ready
from trio_cuda._memory cimport Buffer
from trio_cuda._stream cimport Event, Stream
from trio_cuda._tensor cimport Tensor


cdef class _Step:
    cdef public object cfg
    cdef public object fn
    cdef public object kernel
    cdef public object prepared
    cdef public object pure
    cdef public object reads
    cdef public object ready
    cdef public object specs
    cdef public object writes


cdef class _Recipe:
    cdef public object allocs
    cdef public object device
    cdef public object direct
    cdef public object generation
    cdef public object ops
    cdef public object result
    cdef public object steps
    cdef public object uses

    @cython.locals(st=_Step, device=Device, args=tuple, x=Tensor, b=Buffer)
    cpdef object submit_now(self, object op, Stream s)


@cython.locals(key=list, x=Tensor)
cpdef object _op_key(object op, tuple args)

@cython.locals(out=list, x=Tensor)
cpdef list _buffers(tuple args, tuple sources)
