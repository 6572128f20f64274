"""benchmarks/bench_host.py runs end to end in its smoke mode (on the simulated device)."""

from __future__ import annotations

import pathlib
import re

from ..helpers.benchmarks import run_smoke

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host.py"

# The row labels of --smoke's sizes (2 layers: 8 kernels; 8 tasks, extra rows 1, 2, 4).
LABELS = [
    "dependent chain awaited once, us/op",
    "sync after every op, us/op",
    "one tiny op round trip in trio, us",
    "decode step, 8 kernels, await per kernel, ms/token",
    "awaits/s, 8 concurrent tasks, tiny kernels",
    "awaits/s, 1 task, tiny kernels",
    "awaits/s, 2 concurrent tasks, tiny kernels",
    "awaits/s, 4 concurrent tasks, tiny kernels",
]


def test_bench_host_smoke(tmp_path: pathlib.Path) -> None:
    text, _ = run_smoke("host", tmp_path)  # (one report and one record)
    header = next(line for line in text.splitlines() if line.startswith("| figure |"))
    assert [c.strip() for c in header.strip("|").split("|")][1] == "trio-cuda"
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7:
            rows[cells[0]] = cells
    for label in LABELS:
        assert label in rows, f"no row {label!r} in\n{text}"
        m = re.match(r"[0-9.]+", rows[label][1])
        assert m and float(m.group()) > 0, f"trio cell of {label!r}: {rows[label][1]!r}"
    idle = re.search(r"idle, notifier thread started: notifier thread ([0-9.]+) ms CPU per s of idle", text)
    assert idle, text
    assert "ERROR" not in text
