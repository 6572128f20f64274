"""The GEMM and the data-dependence/cancellation examples run, check themselves, and exit 0.

Each runs as its own process with its default sizes (small on the simulated device,
4096^3 for the GEMM on CUDA), as a user would run it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..helpers.examples import EXAMPLES


@pytest.mark.parametrize("name", ["async_gemm.py", "async_and_then.py"])
def test_reference_example_runs_and_checks_itself(name: str) -> None:
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "correct" in r.stdout, r.stdout + r.stderr
