# Cython declarations for _notifier.py when it is compiled (see _stream.pxd): the loop's
# schedule points as C calls.

from trio_cuda._loop cimport cancel_shielded_checkpoint, checkpoint
