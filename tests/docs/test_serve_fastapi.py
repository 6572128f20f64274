"""examples/serve_fastapi.py's graph path: every batch bucket answers right by replaying
its captured forward; a request's deadline passing while its batch's replay is in flight
answers 504 and leaves the other requests and later batches right; concurrent batches
of one bucket get replays of their own; a replay cancelled on the GPU is not overtaken
by the next batch that uses its buffers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import trio_cuda
from trio_cuda import api, lowlevel
from trio_cuda.kernels import sleep

from ..helpers.devices import counter
from ..helpers.examples import import_example

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
serve = import_example("serve_fastapi")

FEATURES, HIDDEN, OUTPUTS, DEPTH = 8, 16, 4, 2
SLOW_NS = 1_500_000_000  # how long a held replay stays on the device (its deadline passes well before)


def run(body: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with asyncio.timeout(90):
            return await body()

    return asyncio.run(main())


async def loaded(max_batch: int = 32) -> Any:
    model = serve.Model(FEATURES, HIDDEN, OUTPUTS, DEPTH, max_batch=max_batch)
    await model.load()
    return model


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, FEATURES), np.float32)


def close(y: np.ndarray, want: np.ndarray) -> bool:
    return y.shape == want.shape and bool(np.allclose(y, want, rtol=1e-4, atol=1e-4))


async def hold(model: Any) -> lowlevel.Submitted:
    """Hold the model's next replays on the device for SLOW_NS: a slow write of the first
    layer's weights (the same values) that every replay reads, so waits for."""
    w, _ = model.dev[0]
    slow = sleep(counter(), SLOW_NS).then(lambda _: api.memcpy(w, model.host[0][0]))
    return await lowlevel.submit(slow)


def test_buckets() -> None:
    assert [serve.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64]
    with pytest.raises(ValueError, match="0"):
        serve.bucket(0)


def test_every_bucket_answers_right_by_a_replay_of_its_graph() -> None:
    async def body() -> None:
        model = await loaded()
        assert sorted(model.idle) == [1, 2, 4, 8, 16, 32] and model.captured == 6
        dev = trio_cuda.current_device()
        before = dev.statistics()
        sizes = [1, 2, 3, 4, 7, 8, 9, 16, 31, 32]
        for i, n in enumerate(sizes):
            x = rows(n, i)
            assert close(await model.forward(x), model.reference(x)), n
        after = dev.statistics()
        # One replay a batch, and nothing built: no kernel launch, no allocation.
        assert after.graph_launches - before.graph_launches == len(sizes) == model.replayed
        assert after.launches == before.launches and after.allocations == before.allocations
        assert model.captured == 6
        # A batch above the largest bucket captures its own at first need, then replays it.
        x = rows(40, 99)
        assert close(await model.forward(x), model.reference(x))
        assert model.captured == 7 and sorted(model.idle) == [1, 2, 4, 8, 16, 32, 64]
        # The eager DAG gives the same answers.
        x = rows(5, 7)
        np.testing.assert_allclose(await model.eager(x), await model.forward(x), rtol=1e-5, atol=1e-5)

    run(body)


def test_concurrent_batches_of_one_bucket_get_replays_of_their_own() -> None:
    async def body() -> None:
        model = await loaded(max_batch=4)
        captured = model.captured
        pending = await hold(model)  # (both batches are on the device at once)
        xs = [rows(3, 1), rows(4, 2), rows(3, 3)]  # all of bucket 4
        ys = await asyncio.gather(*(model.forward(x) for x in xs))
        assert [close(y, model.reference(x)) for x, y in zip(xs, ys, strict=True)] == [True] * 3
        assert model.captured == captured + 2 and len(model.idle[4]) == 3
        await pending.wait()
        ys = await asyncio.gather(*(model.forward(x) for x in reversed(xs)))  # the pool serves them again
        assert [close(y, model.reference(x)) for x, y in zip(reversed(xs), ys, strict=True)] == [True] * 3
        assert model.captured == captured + 2

    run(body)


def test_a_replay_cancelled_on_the_device_is_not_overtaken_by_the_next_batch() -> None:
    async def body() -> None:
        model = await loaded(max_batch=8)
        dev = trio_cuda.current_device()
        pending = await hold(model)
        replays = dev.statistics().graph_launches
        first = asyncio.create_task(model.forward(rows(8, 1)))
        while dev.statistics().graph_launches == replays:  # until its replay is enqueued
            await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not pending.event.query()  # its replay is still held on the device
        # The next batch of the bucket takes the same replay (its buffers) at once, and is
        # ordered after the cancelled one: its answer is its own.
        x = rows(6, 2)
        assert len(model.idle[8]) == 1
        captured = model.captured
        assert close(await model.forward(x), model.reference(x))
        assert model.captured == captured
        await pending.wait()

    run(body)


def test_a_deadline_passing_while_its_replay_is_in_flight() -> None:
    """Two requests in one batch, its replay held on the device: the one with a deadline
    answers 504 when it passes, the other gets its answer when the replay is done, and
    the next request of the same bucket is right."""

    async def body() -> None:
        model = serve.Model(FEATURES, HIDDEN, OUTPUTS, DEPTH, max_batch=2)
        app = serve.make_app(model, max_batch=2, window_ms=60_000)  # (the batch closes at 2 requests)
        dev = trio_cuda.current_device()
        xs = rows(4, 5)
        want = model.reference(xs)

        def answer(reply: tuple[int, bytes], i: int) -> bool:
            return reply[0] == 200 and close(np.array(json.loads(reply[1])["y"], np.float32), want[i])

        async with serve.serving(app) as url:
            conns = [await serve.Connection.open(url) for _ in range(2)]
            try:
                pending = await hold(model)
                replays = dev.statistics().graph_launches
                seen: dict[str, Any] = {}

                async def ask(i: int, deadline_ms: float | None = None) -> tuple[int, bytes]:
                    body = {"x": xs[i].tolist()} | ({} if deadline_ms is None else {"deadline_ms": deadline_ms})
                    reply = await conns[i % 2].request("POST", "/infer", json.dumps(body).encode())
                    if i == 0:  # (what the device was doing when the deadline answered)
                        seen["replays"] = dev.statistics().graph_launches - replays
                        seen["held"] = not pending.event.query()
                    seen.setdefault("order", []).append(i)
                    return reply

                late, ok = await asyncio.gather(ask(0, 300), ask(1))
                assert late[0] == 504
                assert seen["replays"] == 1 and seen["held"]  # its batch's replay was in flight
                assert seen["order"] == [0, 1] and answer(ok, 1)
                # The next batch of the same bucket (2) reuses the replay: right answers.
                assert all(answer(r, i) for i, r in zip((2, 3), await asyncio.gather(ask(2), ask(3)), strict=True))
                health = json.loads((await conns[0].request("GET", "/health"))[1])
                assert (health["batches"], health["served"], health["dropped"], health["largest_batch"]) == (2, 3, 0, 2)
            finally:
                for conn in conns:
                    await conn.close()
        assert model.replayed == 2 and model.captured == 2  # (buckets 1 and 2: nothing captured while serving)
        await pending.wait()

    run(body)


@pytest.mark.parametrize(
    "body",
    [
        {"x": "abc"},
        {"x": [1.0] * (FEATURES - 1) + ["a"]},
        {"x": [[1.0], [2.0, 3.0]]},
        {"x": [1.0] * FEATURES, "deadline_ms": "soon"},
        {"x": [1.0] * FEATURES, "deadline_ms": [1]},
        {"x": [1.0] * FEATURES, "deadline_ms": True},
        {"x": [1.0] * FEATURES, "deadline_ms": float("nan")},
    ],
    ids=["x-a-string", "x-not-numbers", "x-ragged", "deadline-a-string", "deadline-a-list", "deadline-a-bool", "deadline-nan"],
)
def test_bad_input_answers_422_before_it_is_queued(body: dict[str, Any]) -> None:
    """A request the service cannot read answers 422 naming the field, and is not queued:
    no batch runs for it (found by an adversarial review: these answered 500, the bad
    deadlines after their request had been queued and run; a NaN deadline was accepted)."""

    async def body_() -> None:
        model = serve.Model(FEATURES, HIDDEN, OUTPUTS, DEPTH, max_batch=2)
        async with serve.serving(serve.make_app(model, max_batch=2, window_ms=1)) as url:
            conn = await serve.Connection.open(url)
            try:
                status, answer = await conn.request("POST", "/infer", json.dumps(body).encode())
                assert status == 422, (status, answer)
                field = "deadline_ms" if "deadline_ms" in body else "x"
                assert field in json.loads(answer)["detail"]
                health = json.loads((await conn.request("GET", "/health"))[1])
                assert (health["batches"], health["served"], health["queued"]) == (0, 0, 0)
                # the service goes on answering
                x = rows(1, 3)
                status, answer = await conn.request("POST", "/infer", json.dumps({"x": x[0].tolist()}).encode())
                assert status == 200 and close(np.array([json.loads(answer)["y"]], np.float32), model.reference(x))
            finally:
                await conn.close()
        assert model.replayed == 1

    run(body_)
