"""ProcessGroup.from_env in torchrun's environment, two processes on the simulated
device: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT say who each is, and
the join goes through ``torch.distributed.TCPStore``. torch is not needed here: a
stand-in ``torch.distributed`` (a TCPStore whose keys are files of one folder) is put
first on the path, and records how each rank made its store."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from ..helpers.examples import EXAMPLES

pytestmark = pytest.mark.sim_only

FAKE_TCPSTORE = """
import fcntl, json, os, pathlib, time

FOLDER = pathlib.Path(os.environ["FAKE_STORE_DIR"])


class TCPStore:
    def __init__(self, host, port, world_size=None, is_master=False, timeout=None, wait_for_workers=True):
        made = {"host": host, "port": port, "world_size": world_size, "is_master": is_master,
                "timeout_s": timeout.total_seconds(), "wait_for_workers": wait_for_workers}
        (FOLDER / f"made-{os.environ['RANK']}.json").write_text(json.dumps(made))

    def _path(self, key):
        return FOLDER / key.replace("/", "%")

    def set(self, key, value):
        tmp = self._path(key + ".tmp" + os.environ["RANK"])
        tmp.write_bytes(value.encode() if isinstance(value, str) else bytes(value))
        os.replace(tmp, self._path(key))

    def get(self, key):
        return self._path(key).read_bytes()

    def check(self, keys):
        return all(self._path(k).exists() for k in keys)

    def add(self, key, amount):
        with open(FOLDER / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            p = self._path(key)
            n = int(p.read_bytes()) + amount if p.exists() else amount
            self.set(key, str(n))
            return n

    def delete_key(self, key):
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False
"""


@pytest.mark.parametrize("agent", [False, True], ids=["rank 0's store", "the agent's store"])
def test_two_ranks_of_torchruns_environment_train_through_its_store(tmp_path: pathlib.Path, agent: bool) -> None:
    site = tmp_path / "site"
    (site / "torch" / "distributed").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "distributed" / "__init__.py").write_text(textwrap.dedent(FAKE_TCPSTORE))
    store = tmp_path / "store"
    store.mkdir()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_"))}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="29555",
            TRIO_CUDA_SIM_DEVICES="1",
            FAKE_STORE_DIR=str(store),
            PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        if agent:  # torchrun's agent hosts the store: every rank is a client
            env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="job7", TORCHELASTIC_RESTART_COUNT="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(EXAMPLES / "train_mlp_ddp.py"), "--processes", "--steps", "20"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err[-4000:]
    assert "2 process(es) (torchrun)" in outs[0][0] and "correct" in outs[0][0]
    assert outs[1][0] == ""  # rank 1 says nothing
    made = [json.loads((store / f"made-{r}.json").read_text()) for r in range(2)]
    # rank 0 hosts the store, unless torchrun's agent does; every rank's at MASTER_ADDR:MASTER_PORT
    assert [m["is_master"] for m in made] == [not agent, False]
    assert all((m["host"], m["port"], m["world_size"], m["wait_for_workers"]) == ("127.0.0.1", 29555, 2, False) for m in made)
    assert made[0]["timeout_s"] == 300
    # the keys are the run's and the restart's (a restarted job never meets the last one's)
    prefix = "trio_cuda%job7%1%" if agent else "trio_cuda%run%0%"
    assert (store / f"{prefix}joins%0").read_bytes() == b"1"
