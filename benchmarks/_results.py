"""Where a benchmark's run goes: ``<name>-<date>.md`` (the report, folded by hand into
``benchmarks/results/<name>.md``) and ``<name>-<date>.json`` (every figure), under
``--out``."""

from __future__ import annotations

import datetime as dt
import json
import pathlib
from typing import Any


def write(out: str | pathlib.Path, name: str, text: str, record: dict[str, Any]) -> pathlib.Path:
    """Print ``text`` and write the report and the record; the report's path."""
    print(text)
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    day = dt.date.today().isoformat()
    md = folder / f"{name}-{day}.md"
    md.write_text(text)
    (folder / f"{name}-{day}.json").write_text(json.dumps(record, indent=2, default=str))
    return md
