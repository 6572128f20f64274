"""benchmarks/probes/probe_norm.py runs end to end in its smoke mode (the simulated device):
every layer_norm / rms_norm variant it times gives numpy's result."""

from __future__ import annotations

import os
import subprocess
import sys

from ..helpers.benchmarks import BENCHMARKS


def test_probe_norm_smoke() -> None:
    env = dict(os.environ, TRIO_CUDA_BACKEND="sim")
    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / "probes" / "probe_norm.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| layer_norm", "| rms_norm"))]
    assert len(rows) == 2 * 2 * 2 * 6, r.stdout  # ops x shapes x dtypes x variants
    assert "best variant per case" in r.stdout
