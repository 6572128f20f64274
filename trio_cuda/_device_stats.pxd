# Cython declarations for _device_stats.py when it is compiled (see _stream.pxd): the
# counters are an extension type so the hot paths bump C struct fields.

cdef class Counters:
    cdef public object allocations
    cdef public object bytes_allocated
    cdef public object bytes_freed
    cdef public object copies
    cdef public object frees
    cdef public object graph_launches
    cdef public object launches
    cdef public object staging_bytes
    cdef public object staging_pins
    cdef public object staging_unpinning
    cdef public object staging_unpins
    cdef public object stream_waits
    cdef public object streams_destroyed
    cdef public object submissions
