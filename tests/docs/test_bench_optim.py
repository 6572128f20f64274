"""benchmarks/bench_optim.py runs end to end in its smoke mode (on the simulated device): the
fused AdamW step is checked against PyTorch's formula, eagerly and as a replayed graph; so
does its probe of launch variants."""

from __future__ import annotations

import pathlib

from ..helpers.benchmarks import run_probe_smoke, run_smoke


def test_bench_optim_smoke(tmp_path: pathlib.Path) -> None:
    text, record = run_smoke("optim", tmp_path)
    assert "every result checked" in text and "PROBLEM" not in text
    assert record["problems"] == []
    assert record["params"] > 0 and record["tensors"] > 1
    for case in ("trio eager", "trio graph"):
        assert record["cases"][case]["GB_per_s"] > 0


def test_probe_optim_smoke() -> None:
    """benchmarks/probes/probe_optim.py (the launch variants for the lead to pick from):
    every variant checked against numpy's formula, its launches counted."""
    stdout = run_probe_smoke("optim")
    assert "every variant right" in stdout and "PROBLEM" not in stdout
    rows = {line.split("|")[1].strip(): line.split("|") for line in stdout.splitlines() if line.startswith("| ")}
    # bench_optim's smoke shapes: 27 tensors; one launch per tensor, or per 8 (K=8), 4 or 12 of them
    assert rows["per-tensor"][6].strip() == "27"
    assert rows["default"][6].strip() == "4"
    assert rows["K4"][6].strip() == "7"
    assert rows["K12"][6].strip() == "3"
