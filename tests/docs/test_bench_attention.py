"""benchmarks/bench_attention.py runs end to end in its smoke mode (on the simulated
device): every case is timed, and trio-cuda's output is checked against numpy."""

from __future__ import annotations

import pathlib

from ..helpers.benchmarks import run_smoke


def test_bench_attention_smoke(tmp_path: pathlib.Path) -> None:
    text, record = run_smoke("attention", tmp_path)
    assert "every output checked against numpy's" in text and "PROBLEM" not in text
    cases = [r["case"] for r in record["rows"]]
    assert cases == ["bf16 b1 h2 s16 d16", "bf16 b1 h2 s16 d16 causal", "bf16 b1 h2 s32 d16", "bf16 b1 h2 s32 d16 causal"]
    for r in record["rows"]:
        assert r["trio_tflops"] > 0 and r["max_abs_diff"] < 0.02
