"""docs/api.md is generated from the docstrings (scripts/gen_api.py) and must be current."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_api_reference_is_current() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_CUDA_")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_api.py"), "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, (
        f"docs/api.md is stale: run `python3 scripts/gen_api.py` and commit the result\n{r.stdout}{r.stderr}"
    )


def test_api_reference_has_no_runnable_blocks() -> None:
    # tests/docs/test_docs.py runs every ```python block of docs/*.md; the reference has none.
    assert "```python" not in (ROOT / "docs" / "api.md").read_text()
