"""benchmarks/bench_ddp.py runs end to end in its smoke mode, in the one-process form
(here) and with a process per device under mpiexec (tests/collectives/test_mpi.py)."""

from __future__ import annotations

import pathlib

from ..helpers.benchmarks import run_smoke


def rows(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            out[cells[0]] = cells
    return out


def test_bench_ddp_smoke_one_process(tmp_path: pathlib.Path) -> None:
    text, record = run_smoke("ddp", tmp_path)
    assert "one process, a collectives.Group over the devices" in text
    table = rows(text)
    assert sorted(table) == sorted(str(r["devices"]) for r in record)
    for r in record:
        assert r["trio_steps_s"] > 0 and r["trio_loss"] > 0
        assert float(table[str(r["devices"])][1]) > 0
