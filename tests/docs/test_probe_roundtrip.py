"""benchmarks/probes/probe_roundtrip.py runs end to end in its smoke mode (the simulated
device): every batch prints its round trips, the counted batch its task steps, and every
launch ran once (the probe checks the counter)."""

from __future__ import annotations

from ..helpers.benchmarks import run_probe_smoke


def test_probe_roundtrip_smoke() -> None:
    stdout = run_probe_smoke("roundtrip")
    batches = [line for line in stdout.splitlines() if line.startswith("batch ")]
    assert len(batches) == 2, stdout
    assert "task steps an await" in batches[1] and "task steps" not in batches[0], stdout
