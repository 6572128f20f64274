"""benchmarks/probes/probe_roundtrip.py runs end to end in its smoke mode (the simulated
device): every batch prints its round trips, the counted batch its task steps, and every
launch ran once (the probe checks the counter)."""

from __future__ import annotations

import os
import subprocess
import sys

from ..helpers.benchmarks import BENCHMARKS


def test_probe_roundtrip_smoke() -> None:
    env = dict(os.environ, TRIO_CUDA_BACKEND="sim")
    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / "probes" / "probe_roundtrip.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    batches = [line for line in r.stdout.splitlines() if line.startswith("batch ")]
    assert len(batches) == 2, r.stdout
    assert "task steps an await" in batches[1] and "task steps" not in batches[0], r.stdout
