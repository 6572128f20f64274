"""Where a benchmark's run goes: printed, and with ``--out DIR`` also ``<name>-<date>.md``
(the report, folded by hand into ``benchmarks/results/<name>.md``) and
``<name>-<date>.json`` (every figure) under DIR. Without ``--out`` nothing is written: a
smoke run or a trial leaves no file among the results."""

from __future__ import annotations

import datetime as dt
import json
import pathlib
from typing import Any


def write(out: str | pathlib.Path | None, name: str, text: str, record: Any) -> pathlib.Path | None:
    """Print ``text``; with ``out``, write the report and the record there (the report's path)."""
    print(text)
    if out is None:
        return None
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    day = dt.date.today().isoformat()
    md = folder / f"{name}-{day}.md"
    md.write_text(text)
    (folder / f"{name}-{day}.json").write_text(json.dumps(record, indent=2, default=str))
    return md
