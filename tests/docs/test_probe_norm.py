"""benchmarks/probes/probe_norm.py runs end to end in its smoke mode (the simulated device):
every layer_norm / rms_norm variant it times gives numpy's result."""

from __future__ import annotations

from ..helpers.benchmarks import run_probe_smoke


def test_probe_norm_smoke() -> None:
    stdout = run_probe_smoke("norm")
    rows = [line for line in stdout.splitlines() if line.startswith(("| layer_norm", "| rms_norm"))]
    assert len(rows) == 2 * 2 * 2 * 6, stdout  # ops x shapes x dtypes x variants
    assert "best variant per case" in stdout
