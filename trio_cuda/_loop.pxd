# Cython declarations for _loop.py when it is compiled (see _stream.pxd): the schedule
# points every await passes, called from the compiled modules as C functions.

cpdef object loop_name()
cpdef object current_task()
cpdef object checkpoint()
cpdef object checkpoint_if_cancelled()
cpdef object cancel_shielded_checkpoint()
