"""Backend selection and the one-line announcement."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import trio_cuda

from ..helpers.devices import ON_CUDA

PROGRAM = (
    "import trio_cuda; from trio_cuda import api; api.ones((2,)).sync(); api.ones((2,)).sync(); print(trio_cuda.backend_name())"
)


def run(env: dict[str, str], code: str = PROGRAM) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TRIO_CUDA_", "NUMBA_ENABLE_CUDASIM"))}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_forced_sim_announces_once() -> None:
    r = run({"TRIO_CUDA_BACKEND": "sim"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "sim"
    lines = [line for line in r.stderr.splitlines() if line.startswith("trio-cuda:")]
    assert len(lines) == 1 and "simulated device" in lines[0] and "TRIO_CUDA_BACKEND=sim" in lines[0]


def test_automatic_choice_matches_the_machine() -> None:
    r = run({})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("cuda" if ON_CUDA else "sim")


def test_quiet() -> None:
    r = run({"TRIO_CUDA_BACKEND": "sim", "TRIO_CUDA_QUIET": "1"})
    assert r.returncode == 0 and "trio-cuda:" not in r.stderr


def test_bad_backend_name() -> None:
    r = run({"TRIO_CUDA_BACKEND": "opencl"})
    assert r.returncode != 0 and "must be 'sim' or 'cuda'" in r.stderr


@pytest.mark.skipif(ON_CUDA, reason="needs a machine without CUDA")
def test_forced_cuda_without_a_gpu_is_a_clear_error() -> None:
    r = run({"TRIO_CUDA_BACKEND": "cuda"})
    assert r.returncode != 0
    assert "DeviceUnavailable" in r.stderr and "no CUDA device" in r.stderr


def test_numba_imported_first_in_the_wrong_mode_is_a_clear_error() -> None:
    code = "import numba.cuda; import trio_cuda"
    r = run({"TRIO_CUDA_BACKEND": "sim"}, code)
    assert r.returncode != 0 and "import trio_cuda before numba.cuda" in r.stderr


def test_sim_device_count_is_configurable() -> None:
    r = run({"TRIO_CUDA_BACKEND": "sim", "TRIO_CUDA_SIM_DEVICES": "5"}, "import trio_cuda; print(trio_cuda.device_count())")
    assert r.returncode == 0 and r.stdout.strip() == "5"


def test_backend_name_in_statistics() -> None:
    assert trio_cuda.device(0).statistics().backend == trio_cuda.backend_name()


def test_a_waker_wakes_once_for_posts_that_piled_up() -> None:
    # The notifier's helper re-examines every parked wait after each wake-up: posts that
    # arrived while it was busy (each armed completion posts) must not each cost a pass.
    from trio_cuda._backends import backend

    w = backend().new_waker()
    assert not w.wait(0.001)
    for _ in range(1000):
        w.post()
    assert w.wait(0.001)
    assert not w.wait(0.001), "the piled-up posts should all be consumed by one wake-up"
    w.post()
    assert w.wait(None)
