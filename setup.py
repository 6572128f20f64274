"""The compiled parts of trio-cuda; everything else is in pyproject.toml.

* ``trio_cuda._backends._cudafast`` (trio_cuda/_backends/_cudafast.c): the CUDA backend's
  three driver calls of every await. Limited API (abi3): one binary serves every Python
  >= 3.11.
* The runtime's hot modules (``trio_cuda._compiled.MODULES``): the same ``.py`` files,
  compiled by Cython (pure-Python mode) into extensions that are imported in their place.

All are optional: without a C compiler or without Cython the install still succeeds and
the same code runs interpreted (the same behaviour, slower per await).
"""

import runpy
import sys

from setuptools import Extension, setup

ext_modules = [
    Extension(
        "trio_cuda._backends._cudafast",
        sources=["trio_cuda/_backends/_cudafast.c"],
        define_macros=[("Py_LIMITED_API", "0x030B0000")],
        py_limited_api=True,
        optional=True,
    ),
]

try:
    from Cython.Build import cythonize
except ImportError:
    cythonize = None
if cythonize is not None:
    for name in runpy.run_path("trio_cuda/_compiled.py")["MODULES"]:
        source = name.replace(".", "/") + ".py"
        try:
            ext_modules += cythonize(
                [Extension(name, sources=[source], optional=True)],
                language_level=3,
                # The code's annotations are for type checkers: compiled as it is, a
                # module behaves as it does interpreted (no checks of argument types).
                compiler_directives={"annotation_typing": False, "binding": True},
                quiet=True,
            )
        except Exception as exc:  # that module stays interpreted
            print(f"setup.py: {source} is not compiled: {exc}", file=sys.stderr)

setup(ext_modules=ext_modules)
