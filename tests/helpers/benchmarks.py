"""Running a benchmark or a probe in its smoke mode on the simulated device."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def run_smoke(name: str, out: pathlib.Path, *args: str) -> tuple[str, dict[str, Any]]:
    """Run ``benchmarks/bench_<name>.py --smoke ARGS --out OUT`` on the simulated device;
    it must succeed and write one report and one record. Their text and content."""
    env = dict(os.environ, TRIO_CUDA_BACKEND="sim")
    script = BENCHMARKS / f"bench_{name}.py"
    r = subprocess.run(
        [sys.executable, str(script), "--smoke", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (md,) = out.glob(f"{name}-*.md")
    (js,) = out.glob(f"{name}-*.json")
    return md.read_text(), json.loads(js.read_text())


def run_probe_smoke(name: str) -> str:
    """Run ``benchmarks/probes/probe_<name>.py --smoke`` on the simulated device; it must
    succeed. Its output."""
    env = dict(os.environ, TRIO_CUDA_BACKEND="sim")
    script = BENCHMARKS / "probes" / f"probe_{name}.py"
    r = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout
