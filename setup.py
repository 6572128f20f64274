"""The one compiled part of trio-cuda: the CUDA backend's driver-call fast path
(trio_cuda/_backends/_cudafast.c, issue 12). Everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the
backend uses its pure-Python path (the same behaviour, about 2 us slower per await on
an H200). It uses the limited API, so one binary serves every Python >= 3.11.
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
        )
    ],
    # The wheel says what the binary is: abi3, for CPython 3.11 and later.
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
