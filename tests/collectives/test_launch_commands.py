"""The launch commands of docs/multi-gpu.md (its ``sh`` blocks) run as written: the
data-parallel example and benchmark under mpiexec with a process per device, the Ray
example on a local Ray instance, torchrun and srun where they are installed. On the
simulated device every process has one device of its own.

The commands of its "Several hosts" section need the hosts they name, so they are not
run: each must start a program that the commands above run, with options that program
defines, and give its launcher only options the launcher's ``--help`` names (where the
launcher is installed)."""

from __future__ import annotations

import ast
import itertools
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
ONE_HOST, _, _rest = DOC.read_text().partition("\n## Several hosts\n")
SEVERAL_HOSTS = _rest.split("\n## ", 1)[0]


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _commands(text: str) -> list[str]:
    return [line.strip() for block in SH.findall(text) for line in block.splitlines() if _words(line)]


COMMANDS = _commands(ONE_HOST)  # run here
MULTI_HOST = _commands(SEVERAL_HOSTS)  # name other hosts: checked, not run
# what each program prints when it checked itself
CHECKED = {"train_mlp_ddp.py": "correct", "bench_ddp.py": "replicas identical: True", "ray_data_parallel.py": "correct"}
RANKS = ("-n", "--nproc-per-node", "--workers")


def test_the_doc_has_the_launchers_commands() -> None:
    assert {_words(c)[0] for c in COMMANDS} >= {"mpiexec", "python", "torchrun", "srun"}
    assert {_words(c)[0] for c in MULTI_HOST} >= {"mpiexec", "python", "torchrun", "srun", "ray"}


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("command", COMMANDS)
def test_the_documented_command_runs(command: str) -> None:
    words = _words(command)
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


def _options(words: list[str]) -> set[str]:
    return {w.split("=", 1)[0] for w in words if w.startswith("-")}


def _defined_options(script: pathlib.Path) -> set[str]:
    """The options a program's argparse parser defines (read from its source)."""
    found = {"-h", "--help"}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            found |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return found


def _is_open_mpi(mpiexec: str) -> bool:
    # (Open MPI refuses even --version as root unless told twice that it may)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60, env=env)
    return any(name in r.stdout + r.stderr for name in ("Open MPI", "OpenRTE", "open-mpi"))


@pytest.mark.parametrize("command", MULTI_HOST)
def test_a_several_hosts_command_names_what_exists(command: str) -> None:
    words = _words(command)
    script = next((w for w in words if w.endswith(".py")), None)
    launcher = words if script is None else words[: words.index(script)]
    if script is not None:
        assert (ROOT / script).is_file(), script
        assert any(script in _words(c) for c in COMMANDS), f"no command of one host runs {script}"
        assert pathlib.Path(script).name in CHECKED
        unknown = _options(words[words.index(script) + 1 :]) - _defined_options(ROOT / script)
        assert not unknown, f"{script} defines no {sorted(unknown)}"
        if launcher == ["python"]:
            return
    found = shutil.which(launcher[0], path=os.path.dirname(sys.executable)) or shutil.which(launcher[0])
    if found is None:
        pytest.skip(f"{launcher[0]} is not installed: its options are not checked")
    if launcher[0] == "mpiexec" and _is_open_mpi(found):
        pytest.skip("this mpiexec is Open MPI's: the line is hydra's (MPICH, Intel MPI), the docs give Open MPI's form")
    subcommands = list(itertools.takewhile(lambda w: not w.startswith("-"), launcher[1:]))  # ray start
    r = subprocess.run([found, *subcommands, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    helptext = r.stdout + r.stderr
    unknown = {o for o in _options(launcher[1:]) if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", helptext)}
    assert not unknown, f"{launcher[0]} --help names no {sorted(unknown)}"
