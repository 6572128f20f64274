"""The examples run, check their own results, and exit 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..helpers.examples import EXAMPLES


@pytest.mark.parametrize(
    "name,args",
    [
        ("async_add.py", []),
        ("async_saxpy.py", []),
        ("cuda_graphs_deviceop.py", ["--tokens", "1"]),
        # small sizes on both backends (the full-size runs are recorded in benchmarks/results)
        ("async_mlp.py", ["--batch", "96", "--features", "24", "--hidden", "40", "--reps", "1"]),
        ("train_mlp_ddp.py", ["--steps", "60", "--batch", "96", "--features", "16", "--hidden", "32", "--outputs", "4"]),
        # a FastAPI service under uvicorn (asyncio): 200 requests over 20 connections, checked
        ("serve_fastapi.py", ["--self-check"]),
    ],
)
def test_example_runs_and_checks_itself(name: str, args: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600, env=dict(os.environ)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "correct" in r.stdout
