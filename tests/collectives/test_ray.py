"""examples/ray_data_parallel.py: one trio worker actor per device, placed by Ray on
this machine (a local Ray instance; each worker a process with a simulated device of
its own where there is no GPU), joined through a Ray actor's store."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..helpers.examples import EXAMPLES

pytest.importorskip("ray", reason="needs Ray (pip install 'trio-cuda[ray]')")


def test_the_ray_example_trains_identical_replicas() -> None:
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "ray_data_parallel.py"), "--workers", "2", "--steps", "40"],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "2 Ray workers on" in r.stdout and "correct" in r.stdout
