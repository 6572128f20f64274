"""The launch commands of docs/multi-gpu.md (its ``sh`` blocks) run as written: the
data-parallel example and benchmark under mpiexec with a process per device, the Ray
example on a local Ray instance, torchrun and srun where they are installed. On the
simulated device every process has one device of its own."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import trio_cuda

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "multi-gpu.md"
SH = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)
COMMANDS = [line.strip() for block in SH.findall(DOC.read_text()) for line in block.splitlines() if line.strip()]
# what each program prints when it checked itself
CHECKED = {"train_mlp_ddp.py": "correct", "bench_ddp.py": "replicas identical: True", "ray_data_parallel.py": "correct"}
RANKS = ("-n", "--nproc-per-node", "--workers")


def test_the_doc_has_the_launchers_commands() -> None:
    assert {shlex.split(c)[0] for c in COMMANDS} >= {"mpiexec", "python", "torchrun", "srun"}


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("command", COMMANDS)
def test_the_documented_command_runs(command: str) -> None:
    words = shlex.split(command)
    launcher = words[0]
    if launcher == "mpiexec":
        found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
        if found is None or not _have("mpi4py"):
            pytest.skip("needs mpi4py and mpiexec (pip install mpi4py mpich)")
        words[0] = found
    elif launcher == "torchrun":
        if shutil.which("torchrun") is None or not _have("torch"):
            pytest.skip("needs torch (torchrun)")
    elif launcher == "srun":
        if shutil.which("srun") is None or "SLURM_JOB_ID" not in os.environ:
            pytest.skip("needs a Slurm allocation")
    script = next(w for w in words if w.endswith(".py"))
    if script.endswith("ray_data_parallel.py") and not _have("ray"):
        pytest.skip("needs Ray (pip install 'trio-cuda[ray]')")
    ranks = next((int(words[i + 1]) for i, w in enumerate(words[:-1]) if w in RANKS), 1)
    if trio_cuda.backend_name() == "cuda" and ranks > trio_cuda.device_count():
        pytest.skip(f"{ranks} ranks need {ranks} GPUs")
    words = [sys.executable if w == "python" else w for w in words]
    env = dict(os.environ, TRIO_CUDA_SIM_DEVICES="1")  # a simulated device per process
    r = subprocess.run(words, capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert CHECKED[pathlib.Path(script).name] in r.stdout, r.stdout
