"""benchmarks/bench_loops.py runs end to end in its smoke mode (on the simulated device)
and measures every loop it can run."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from ..helpers.benchmarks import run_smoke

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_loops.py"

LABELS = [
    "round trip, us",
    "sync after every op, us/op",
    "decode step, await per kernel, ms/token",
    "awaits/s, 8 tasks",
]


def test_bench_loops_smoke(tmp_path: pathlib.Path) -> None:
    text, record = run_smoke("loops", tmp_path, "--loops", "trio,asyncio")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4:
            rows[cells[0]] = cells
    assert rows["figure"] == ["figure", "trio", "asyncio", "asyncio / trio"]
    for label in LABELS:
        assert label in rows, f"no row {label!r} in\n{text}"
        assert float(rows[label][1].replace(",", "")) > 0 and float(rows[label][2].replace(",", "")) > 0
        assert rows[label][3].endswith(("met", "MISSED")), rows[label]
    assert [len(record["rounds"][n]) for n in ("trio", "asyncio")] == [2, 2]
    assert "every result checked" in text and "WRONG" not in text


def test_bench_loops_refuses_a_list_without_trio_first(tmp_path: pathlib.Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--loops", "asyncio", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "trio first" in r.stderr
    assert not list(tmp_path.iterdir())
