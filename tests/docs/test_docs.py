"""Every fenced Python block in README.md and docs/ is a complete program that runs.

Each block runs in a fresh interpreter on the simulated device and must exit 0 (the
blocks check their own results with asserts). Blocks meant as illustrations only are
not marked ``python``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for path in FILES:
        for i, m in enumerate(FENCE.finditer(path.read_text())):
            line = path.read_text()[: m.start()].count("\n") + 1
            out.append((f"{path.relative_to(ROOT)}:{line}#{i}", m.group(1)))
    return out


BLOCKS = _blocks()


def test_the_docs_have_python_blocks() -> None:
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_runs(where: str, code: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_CUDA_")}
    env.update(TRIO_CUDA_QUIET="1", TRIO_CUDA_SIM_DEVICES="2")
    if "TRIO_CUDA_BACKEND" in os.environ:
        env["TRIO_CUDA_BACKEND"] = os.environ["TRIO_CUDA_BACKEND"]
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, f"{where} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
