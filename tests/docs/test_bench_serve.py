"""benchmarks/bench_serve.py runs end to end in its smoke mode (on the simulated device):
its services (trio-cuda replaying graphs, and building each batch's DAG) start in
processes of their own, answer every request correctly, and stop."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ..helpers.benchmarks import run_smoke

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


def test_bench_serve_smoke(tmp_path: pathlib.Path) -> None:
    text, record = run_smoke("serve", tmp_path, "--services", "trio-cuda,trio-cuda eager")
    assert "every answer checked against numpy" in text and "PROBLEM" not in text
    assert "CUDA graph" in text  # (the results say that trio-cuda replays a graph)
    for name in ("trio-cuda", "trio-cuda eager"):
        (one,) = record["rounds"][name]
        assert one["requests_per_s"] > 0
        assert 0 < one["request_p50_ms"] <= one["request_p99_ms"]
        assert 0 < one["health_p50_ms"] <= one["health_p99_ms"]


def test_bench_serve_refuses_unknown_services(tmp_path: pathlib.Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--services", "trio-cuda,tensorflow", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--services" in r.stderr
    assert not list(tmp_path.iterdir())
