# Cython declarations for _direct.py when it is compiled (see _stream.pxd).

cimport cython

from trio_cuda._device cimport Device
from trio_cuda._memory cimport Buffer
from trio_cuda._stream cimport Event, Stream


@cython.locals(device=Device)
cpdef bint direct_ready(Stream s, object generation) except -1
@cython.locals(device=Device, c=dict)
cpdef Event direct_enqueue(Stream s, object step, object arg)

@cython.locals(b=Buffer)
cpdef object order_accesses(Stream s, object writes, object reads)
@cython.locals(b=Buffer)
cpdef object note_accesses(Stream s, object seq, object writes, object reads)
