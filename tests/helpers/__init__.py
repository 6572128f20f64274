"""Helpers shared by the test modules (no test module imports another; they import these).

- ``devices``: the backend in use and device helpers (``ON_CUDA``, ``needs_devices``,
  ``counter``, ``settle``, ``started``, ``snapshot``, ``Resetter``,
  ``run_with_deadline``).
- ``faults``: faulting a device on purpose, and child processes (``scribble``, ``ready_to_fault``,
  ``child``, ``child_ok``).
- ``data``: host data (``RNG``, ``f32``).
- ``fakes``: stand-ins for the driver (``FakeDriver``, ``fake_cuda_driver``, the ctypes
  prototypes and ``address``).
- ``examples``: where the examples are (``EXAMPLES``).
"""
