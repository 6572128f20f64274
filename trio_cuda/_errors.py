"""The error hierarchy of trio-cuda.

Everything the device or the driver can do wrong is a :class:`DeviceError`.
Bad arguments are builtin errors (``ValueError``, ``TypeError``) raised before
any GPU work, as in the rest of the Python ecosystem. ``trio.Cancelled`` is
never caught or wrapped.
"""

from __future__ import annotations

import copy

__all__ = [
    "DeviceError",
    "DeviceFault",
    "DeviceOutOfMemory",
    "DeviceReset",
    "DeviceUnavailable",
    "ExternalCallError",
    "ForkedProcessError",
    "GraphCaptureError",
    "LaunchError",
    "NestedExecutionError",
    "OpAlreadyExecuted",
    "fresh",
]


class DeviceError(Exception):
    """Base class of every error that comes from a device or its driver.

    Attributes:
        message: The message without the op and device.
        device: The ordinal of the device concerned, or ``None``.
        op: A short description of the operation (usually a kernel name), or ``None``.
    """

    def __init__(self, message: str, *, device: int | None = None, op: str | None = None) -> None:
        self.message = message
        self.device = device
        self.op = op
        where = []
        if op is not None:
            where.append(f"op {op}")
        if device is not None:
            where.append(f"device {device}")
        if where:
            message = f"{message} ({', '.join(where)})"
        super().__init__(message)

    def _fresh(self) -> DeviceError:
        """A new error like this one (see :func:`fresh`)."""
        return type(self)(self.message, device=self.device, op=self.op)


class LaunchError(DeviceError):
    """The driver refused to submit an operation (raised at submission)."""


class ExternalCallError(LaunchError):
    """The function of a :func:`trio_cuda.external` op raised while its submission was
    being enqueued (chained ``from`` that exception).

    The ops of the DAG enqueued before the call (``ran``) complete normally: their
    results land, and later ops on their tensors are ordered after them. The call's
    own ``writes`` may hold whatever the function enqueued before it raised. The ops
    after it (``not_run``) were not enqueued: tensors that only they would have
    written refuse use. Inside a graph capture nothing ran (``ran`` is empty).

    Attributes:
        ran: The ops enqueued before the call, in submission order, named as a trace
            names them (``"kernel add"``, ``"copy host->device"``, ``"fill"``, ...).
        not_run: The ops of the DAG after the call, which were not enqueued.
    """

    def __init__(
        self,
        message: str,
        *,
        device: int | None = None,
        op: str | None = None,
        ran: tuple[str, ...] = (),
        not_run: tuple[str, ...] = (),
    ) -> None:
        self.ran = tuple(ran)
        self.not_run = tuple(not_run)
        super().__init__(message, device=device, op=op)

    def _fresh(self) -> DeviceError:
        return type(self)(self.message, device=self.device, op=self.op, ran=self.ran, not_run=self.not_run)


class DeviceOutOfMemory(DeviceError):
    """A device allocation failed because the device has no memory left."""


class DeviceFault(DeviceError):
    """An asynchronous fault on the device (for example an illegal address).

    After a fault the device refuses new work until :meth:`Device.reset` is called.
    Every task waiting on the device sees this error. An op that waited for work of
    another device which faulted fails with this error too (naming that device),
    without faulting its own device.
    """


class DeviceReset(DeviceError):
    """The device was reset while this work was pending, or the object predates a reset.

    Every task or thread waiting for work of the old generation gets this error; no
    data of the old generation is returned.
    """


class DeviceUnavailable(DeviceError):
    """The device cannot take work: it is gone, or is being reset right now."""


class ForkedProcessError(DeviceUnavailable):
    """This process is a child made by ``os.fork`` of a process that had started trio-cuda.

    A forked child has none of its parent's threads (the simulated device's streams, the
    notifier, the staging janitor) and, on CUDA, cannot use the driver context the parent
    initialized: every use of the runtime in it raises this error instead of hanging.
    Start child processes with ``multiprocessing.get_context("spawn")`` or
    ``"forkserver"``, which begin a fresh interpreter.
    """


class GraphCaptureError(DeviceError):
    """An operation cannot be captured into a CUDA graph, or touched a capture in progress."""


class NestedExecutionError(RuntimeError):
    """A DeviceOp was executed from inside another op's submission.

    Executing an op inside a ``.then()``/``.map()`` callback would submit work onto
    another stream behind the runtime's back; return the op from the callback instead.
    """


class OpAlreadyExecuted(RuntimeError):
    """A single-use DeviceOp was executed a second time.

    Ops describe work that happens once. Use ``op.shared()`` for an op with several
    consumers.
    """


def fresh(err: BaseException) -> BaseException:
    """A new exception like ``err`` (same type and message), without its traceback.

    A stored error (a sticky fault, a failed shared op) raised again and again would grow
    its traceback with the frames of every waiter, and keep their objects alive.
    """
    if isinstance(err, DeviceError):
        new: BaseException = err._fresh()
    else:
        try:
            new = copy.copy(err)
        except Exception:  # an exception type that cannot be copied: raise it as it is
            return err.with_traceback(None)
    new.__traceback__ = None
    new.__cause__ = err.__cause__
    return new
