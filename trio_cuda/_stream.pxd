# Cython declarations for _stream.py when it is compiled (see trio_cuda/_compiled.py):
# Event and Stream become extension types whose attributes are fields, read directly by
# the compiled modules that cimport them. Interpreted, the .py runs as it is.

cimport cython


cdef class Event:
    cdef object __weakref__
    cdef public object _pool
    cdef public object _stream
    cdef public object device
    cdef public object done
    cdef public object error
    cdef public object generation
    cdef public object handle
    cdef public object seq
    cdef public object stream_handle


cdef class _Token:
    cdef public object wref


cdef class Stream:
    cdef object __weakref__
    cdef public object _dropped
    cdef public object _events
    cdef public object _final
    cdef public object _foreign
    cdef public object _keep
    cdef public Event _last_event
    cdef public object _newest_pending
    cdef public object _ok_seq
    cdef public _Token _token
    cdef public dict _waited
    cdef public object _wref
    cdef public object capture
    cdef public object device
    cdef public object done_seq
    cdef public object generation
    cdef public object handle
    cdef public object seq

    cpdef Event event_at(self, seq)
    cpdef observe(self, seq)
    cpdef _succeeded(self, seq)


@cython.locals(ev=Event)
cdef Event _new_event(Stream stream, object seq, object handle)
