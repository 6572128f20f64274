# Cython declarations for _kernel.py when it is compiled (see _stream.pxd): the launch's
# per-await functions, with the runtime's objects typed so their fields are read directly.

cimport cython

from trio_cuda._device cimport Device
from trio_cuda._direct cimport direct_enqueue, direct_ready, note_accesses, order_accesses
from trio_cuda._memory cimport Buffer
from trio_cuda._stream cimport Event, Stream
from trio_cuda._tensor cimport Partition, Tensor


cdef class _Config:
    cdef public object block
    cdef public object device
    cdef public object generation
    cdef public object grid
    cdef public object loaded
    cdef public object name
    cdef public object names
    cdef public object proto
    cdef public object reads
    cdef public object signature
    cdef public object writes


@cython.locals(key=list, p=Partition, t=Tensor)
cpdef object _prepared_key(tuple args)

@cython.locals(p=Partition, t=Tensor, b=Buffer, wpos=tuple, rpos=tuple)
cpdef object _enqueue_launch(Stream s, Device device, _Config cfg, tuple args, object prepared)

@cython.locals(args=tuple, device=Device, cfg=_Config, p=Partition, t=Tensor, hit=tuple)
cpdef object _launch_now(object op, Stream s)

@cython.locals(cfg=_Config, device=Device)
cpdef object enqueue_prepared(Stream s, tuple arg)

cpdef Event enqueue_direct(Stream s, _Config cfg, object prepared, list writes, list reads)
