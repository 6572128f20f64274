"""The compiled parts of trio-cuda (issue 12); everything else is in pyproject.toml.

* ``trio_cuda._backends._cudafast`` (trio_cuda/_backends/_cudafast.c): the CUDA backend's
  three driver calls of every await. Limited API (abi3): one binary serves every Python
  >= 3.11.
* ``trio_cuda._hotpath`` (trio_cuda/_hotpath.c): the runtime's direct submission of a
  prepared kernel launch (and of a replayed op's one launch), its poll, the general
  path's planning and enqueue of prepared launches, and the per-call path (the await,
  the kernel call, the event pool). It reads the runtime's ``__slots__``
  at their offsets, which needs CPython's own structures: built for the Python at hand.

Both are optional: without a C compiler the install still succeeds and the pure-Python
paths run (the same behaviour, slower per await).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trio_cuda._backends._cudafast",
            sources=["trio_cuda/_backends/_cudafast.c"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            optional=True,
        ),
        Extension("trio_cuda._hotpath", sources=["trio_cuda/_hotpath.c"], optional=True),
    ],
)
