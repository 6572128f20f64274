"""Pending host values (what device work will produce, resolved after its submission's
event), the continuation an op plans into, and the states of shared ops."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._errors import fresh
from ._guard import _tls

if TYPE_CHECKING:
    from ._stream import Stream

__all__ = ["Claimed", "Continue", "Done", "EXECUTING", "Failed", "Pending", "checked", "contains_pending", "resolve"]


# -- pending host values ------------------------------------------------------------
class Pending:
    """A host value that exists once the submission's work has completed.

    Resolving is thread-safe and happens once: a shared op's pending value may be
    resolved by several consumers at the same time; a failure is remembered and raised
    to each of them.
    """

    __slots__ = ("_done", "_error", "_fn", "_lock", "_value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = False
        self._error: BaseException | None = None
        self._value: Any = None
        self._lock = threading.Lock()

    def resolve(self) -> Any:
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        self._value = self._compute()
                    except BaseException as exc:
                        # A copy: the raised one collects the frames of the consumer it
                        # reaches (and keeps their locals alive while it is stored).
                        self._error = fresh(exc)
                        raise
                    finally:
                        self._done = True
                        self._fn = None  # type: ignore[assignment]
                    return self._value
        if self._error is not None:
            raise fresh(self._error)
        return self._value

    def _compute(self) -> Any:
        # Map callbacks over read-backs run here, after the wait; like every then/map
        # callback they must not execute ops (NestedExecutionError).
        tls = _tls
        was = tls.submitting
        tls.submitting = True
        try:
            return self._fn()
        finally:
            tls.submitting = was


def contains_pending(v: Any) -> bool:
    t = type(v)
    if isinstance(v, Pending):
        return True
    if t is tuple or t is list:
        return any(contains_pending(x) for x in v)
    return False


def resolve(v: Any) -> Any:
    """Replace pending host values in ``v`` (and in tuples/lists inside it) by their values."""
    t = type(v)
    if isinstance(v, Pending):
        return v.resolve()
    if t is tuple:
        return tuple(resolve(x) for x in v) if contains_pending(v) else v
    if t is list:
        return [resolve(x) for x in v]
    return v


def checked(value: Any, checks: list[Callable[[], None]]) -> Pending:
    """``value`` (resolved) once every check has passed: the output of a submission whose
    ops check something on the device (see Plan.check_when_done)."""

    def run() -> Any:
        for check in checks:
            check()
        return resolve(value)

    return Pending(run)


class Continue:
    """Returned by an op's ``_plan`` to continue with another op on the same lane."""

    __slots__ = ("op",)

    def __init__(self, op: Any) -> None:
        self.op = op


# -- shared-op states ------------------------------------------------------------------
class Claimed:
    """A shared op claimed by an unfinished plan; its output value is known."""

    __slots__ = ("pending", "plan", "value")

    # plan: the claiming Plan (typed loosely: plans, in _plan, stand above these states)
    def __init__(self, plan: Any, value: Any, pending: bool) -> None:
        self.plan = plan
        self.value = value
        self.pending = pending


class Done:
    """A shared op whose work was enqueued: consumers depend on (stream, seq)."""

    __slots__ = ("pending", "seq", "stream", "value")

    def __init__(self, value: Any, stream: Stream, seq: int, pending: bool) -> None:
        self.value = value
        self.stream = stream
        self.seq = seq
        self.pending = pending


class Failed:
    """A shared op whose execution failed: every consumer sees the error."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


EXECUTING = True  # the state of an op being planned (or executed, for single-use ops)
