"""Helpers shared by the test modules (no test module imports another; they import these).

- ``devices``: the backend in use and device helpers (``ON_CUDA``, ``needs_devices``,
  ``counter``, ``settle``, ``started``, ``snapshot``, ``Resetter``,
  ``run_with_deadline``).
- ``faults``: faulting a device on purpose, and child processes (``scribble``, ``ready_to_fault``,
  ``child``, ``child_ok``).
- ``data``: host data (``RNG``, ``f32``).
- ``fakes``: stand-ins for the driver (``FakeDriver``, ``fake_cuda_driver``, the ctypes
  prototypes and ``address``).
- ``arrays``: host arrays in and out of the device, and comparisons (``BINARY``, ``up``,
  ``host``, ``close``, ``same``).
- ``examples``: where the examples are (``EXAMPLES``, ``import_example``).
- ``benchmarks``: a benchmark or probe in its smoke mode (``run_smoke``, ``run_probe_smoke``).
- ``loops``: a test's body under each event loop (``Run``, ``LOOPS``).
- ``optim``: PyTorch's optimizer formulas in numpy (``adamw_ref``, ``sgd_ref``).
- ``stores``: an in-memory store for ``ProcessGroup.from_store`` (``MemoryStore``).
"""
