"""Helpers shared by the test modules (no test module imports another; they import these).

- ``devices``: the backend in use and device helpers (``ON_CUDA``, ``WORDS``, ``needs_devices``,
  ``words_only``, ``counter``, ``settle``, ``started``, ``snapshot``, ``Resetter``,
  ``run_with_deadline``).
- ``faults``: faulting a device on purpose, and child processes (``scribble``, ``ready_to_fault``,
  ``child``, ``child_ok``).
- ``data``: host data (``RNG``, ``f32``).
- ``fakes``: stand-ins for the driver and for completion words (``FakeDriver``, ``fake_cuda_driver``,
  the ctypes prototypes and ``address``, ``wordless_stream``).
- ``compiled``: helpers only the tests of the compiled hot path use (``operands``).
- ``examples``: where the examples are (``EXAMPLES``).
"""
