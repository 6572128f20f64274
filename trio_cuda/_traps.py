"""trio's checkpoint, yielded straight from a generator-based ``__await__`` (issue 12).

``await op`` used to go through five frames each time the task yielded to trio and
came back: the coroutine wrapper of ``run_async``, ``run_async`` itself,
``trio.lowlevel.checkpoint``, ``cancel_shielded_checkpoint`` and trio's
``_async_yield``. The await of a lone kernel does this twice (the cancel check before
submitting, the schedule point before the first poll), and that cost 0.7 us of a
6.4 us await on the development machine with a null driver (12%; 14% with 256
tasks). Here the await is one generator that yields trio's trap object itself and
does trio's cancel checks inline, as ``checkpoint_if_cancelled`` and ``checkpoint`` do
them; a cancelled task goes through trio's own functions, which raise (a cancel found
at the schedule point before a poll is raised by trio's ``checkpoint()``, one scheduler
pass later than trio's own would raise it). The waits' polls use the same checkpoint
(:func:`checkpoint`).

This reads trio internals (the run context's current task, its cancel status and
checkpoint counters, the trap object). They are looked up once, at import: if any is
missing (a trio that changed them), ``available`` is False and every await goes
through trio's public functions, as before. ``TRIO_CUDA_TRIO_TRAPS=0`` does the same
(read at import; ``on`` may be set by tests and A/B runs).
"""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from typing import Any

import trio

from ._config import env_switch

__all__ = [
    "CANCEL_SHIELDED_CHECKPOINT",
    "RUN_CONTEXT",
    "after_pass",
    "available",
    "cancel_shielded_checkpoint",
    "checkpoint",
    "on",
    "trio_classes",
]


def _field_names(cls: Any) -> set[str]:
    """The instance fields ``cls`` declares (attrs, dataclass or slots)."""
    names = {a.name for a in getattr(cls, "__attrs_attrs__", ())}
    names.update(getattr(cls, "__dataclass_fields__", {}))
    for c in getattr(cls, "__mro__", ()):
        slots = c.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
    return names


def _lookup() -> tuple[Any, Any]:
    """trio's run context and cancel-shielded-checkpoint trap, or (None, None) when this
    trio does not have them as this module uses them."""
    try:
        from trio._core import _run, _traps  # guarded: private to trio

        ctx = _run.GLOBAL_RUN_CONTEXT
        trap = _traps.CancelShieldedCheckpoint
        task_fields = _field_names(_run.Task)
        runner_fields = _field_names(_run.Runner)
        status_fields = _field_names(_run.CancelStatus)
    except (ImportError, AttributeError):
        return None, None
    if (
        {"_cancel_status", "_runner", "_cancel_points"} <= task_fields
        and {"ki_pending", "main_task"} <= runner_fields
        and "effectively_cancelled" in status_fields
        # trio's own cancel_shielded_checkpoint must be this trap, yielded the same way
        and "CancelShieldedCheckpoint" in trio.lowlevel.cancel_shielded_checkpoint.__code__.co_names
    ):
        return ctx, trap
    return None, None


RUN_CONTEXT, CANCEL_SHIELDED_CHECKPOINT = _lookup()

#: Whether this trio has the internals used here.
available = RUN_CONTEXT is not None
#: Whether awaits yield the trap themselves (False: through trio's public functions).
on = available and env_switch("TRIO_CUDA_TRIO_TRAPS")


def trio_classes() -> dict[str, Any] | None:
    """trio's Task, CancelStatus and Runner, whose fields ``after_pass`` reads (for the
    compiled await, trio_cuda/_hotpath.c, which checks them), or None."""
    if not available:
        return None
    from trio._core import _run  # guarded by _lookup

    return {"Task": _run.Task, "CancelStatus": _run.CancelStatus, "Runner": _run.Runner}


def after_pass() -> bool:
    """trio's checkpoint() after its schedule point, in the current task: count the
    cancel point; True if the task is cancelled (or a KeyboardInterrupt is pending for
    the main task), which trio's checkpoint() then raises."""
    task = RUN_CONTEXT.task
    task._cancel_points += 1
    return task._cancel_status.effectively_cancelled or (task._runner.ki_pending and task is task._runner.main_task)


def _checkpoint() -> Generator[Any, Any, None]:
    RUN_CONTEXT.task  # noqa: B018 (outside trio: AttributeError, as before yielding)
    (yield CANCEL_SHIELDED_CHECKPOINT).unwrap()
    if after_pass():
        yield from trio.lowlevel.checkpoint().__await__()  # raises it, one pass later


def _cancel_shielded_checkpoint() -> Generator[Any, Any, None]:
    (yield CANCEL_SHIELDED_CHECKPOINT).unwrap()


class _Checkpoint:
    __slots__ = ("_gen",)

    def __init__(self, gen: Any) -> None:
        self._gen = gen

    def __await__(self) -> Generator[Any, Any, None]:
        return self._gen()  # type: ignore[no-any-return]


_CHECKPOINT = _Checkpoint(_checkpoint)
_CANCEL_SHIELDED_CHECKPOINT = _Checkpoint(_cancel_shielded_checkpoint)


def checkpoint() -> Awaitable[None]:
    """``await checkpoint()``: ``trio.lowlevel.checkpoint()`` in one generator frame while
    ``on`` (a cancel found after the schedule point is raised by trio's checkpoint(),
    one pass later), else trio's own."""
    return _CHECKPOINT if on else trio.lowlevel.checkpoint()


def cancel_shielded_checkpoint() -> Awaitable[None]:
    """``await cancel_shielded_checkpoint()``: trio's, in one generator frame while ``on``."""
    return _CANCEL_SHIELDED_CHECKPOINT if on else trio.lowlevel.cancel_shielded_checkpoint()
