"""benchmarks/bench_optim.py runs end to end in its smoke mode (on the simulated device): the
fused AdamW step is checked against PyTorch's formula, eagerly and as a replayed graph."""

from __future__ import annotations

import pathlib

from ..helpers.benchmarks import run_smoke


def test_bench_optim_smoke(tmp_path: pathlib.Path) -> None:
    text, record = run_smoke("optim", tmp_path)
    assert "every result checked" in text and "PROBLEM" not in text
    assert record["problems"] == []
    assert record["params"] > 0 and record["tensors"] > 1
    for case in ("trio eager", "trio graph"):
        assert record["cases"][case]["GB_per_s"] > 0
