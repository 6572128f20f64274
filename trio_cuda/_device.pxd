# Cython declarations for _device.py when it is compiled (see _stream.pxd). Device is
# final (nothing derives from it) so its C-level methods need no check for overrides;
# it keeps a __dict__ for what tests and callers set on an instance.

cimport cython

from trio_cuda._device_stats cimport Counters
from trio_cuda._stream cimport Event, Stream


@cython.final
cdef class Device:
    cdef dict __dict__
    cdef object __weakref__
    cdef public object ordinal
    cdef public object generation
    cdef public object _driver
    cdef public object _backend_name
    cdef public object _new_waker
    cdef public object _resetting
    cdef public object _slow_lock
    cdef public object _streams
    cdef public object _utility
    cdef public object _policy
    cdef public object _pick
    cdef public object _dead_streams
    cdef public object _lingering
    cdef public object _event_pool
    cdef public object _dead_buffers
    cdef public object _dead_graphs
    cdef public object _bytes_in_use
    cdef public Counters _stats
    cdef public object _reset_callbacks
    cdef public object _blocking
    cdef public object _peer_readers
    cdef public object _idle_wakers
    cdef public object _host_cond
    cdef public object _host_readers
    cdef public object _foreign_streams
    cdef public object _cross_device

    @cython.locals(s=Stream, last=Event)
    cpdef bint poll(self, Event ev) except -1
    cpdef bint _newest_done(self, Stream s, Event last) except -1
