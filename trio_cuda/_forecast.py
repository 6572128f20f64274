"""When awaited device work will finish: what the adaptive wait learns (see docs/notifier.md).

The wait of an await (trio_cuda._notifier) polls work it expects to be short and sleeps
through work it expects to be long, waking shortly before the work should end. This
module keeps what that needs, learned from what awaits observe:

* per kind of work (a kernel launch on one argument geometry, a replayed op, a plan's
  op class), how long it took to run: from its submission, or from the predicted end
  of the work before it on its stream when it was queued behind that;
* how late a timed wake-up reaches the task, and how much that varies, so that the
  task asks to be woken that much earlier.

An estimate moves a quarter of the way to each exact observation (completion seen
while polling) and drops at once when the work was found finished on waking: a
wake-up too late leaves the GPU idle, one too early costs a little polling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SLEEP_MIN_NS", "Forecast", "Names", "WaitStatistics", "forecast"]

#: Work expected to take less than this is polled, not slept through.
SLEEP_MIN_NS = 150_000
_GUARD_NS = 15_000  # woken this much before the predicted end, on top of the learned lateness
_MAX_KINDS = 4096


class Names(list):  # type: ignore[type-arg]
    """The op names of a direct submission (what a fault names), which also serve as
    its kind of work: one such list per launch geometry or recipe, hashed and compared
    by identity (kept as a key, it is never confused with a later one at its address)."""

    __slots__ = ()
    __hash__ = object.__hash__  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return self is other


@dataclass(frozen=True)
class WaitStatistics:
    """How the adaptive wait slept (see :func:`trio_cuda.lowlevel.notifier_statistics`).

    Attributes:
        timed: Sleeps with a wake-up before the work's predicted end.
        timer_wakes: Timed sleeps woken by their timer (the task then polls).
        early: Sleeps until a predicted end woken because the work finished first (the
            prediction was too long; the sleeps of work still running past its
            prediction are not counted).
        late: Timer wake-ups that found the work already finished (woken too late).
        lateness_us: The learned lateness of a timer wake-up, timer to task running (us).
        kinds: Kinds of work with a learned duration.
    """

    timed: int
    timer_wakes: int
    early: int
    late: int
    lateness_us: float
    kinds: int


class Forecast:
    """Learned durations per kind of work, and the lateness of timed wake-ups."""

    __slots__ = ("_ends", "_est", "counts", "lateness_ns", "spread_ns")

    def __init__(self) -> None:
        self._est: dict[Any, int] = {}
        self._ends: dict[int, int] = {}  # per stream (its id): when its latest slept-through work should end
        self.lateness_ns = 60_000
        self.spread_ns = 20_000  # the mean deviation of the lateness
        self.counts = [0, 0, 0, 0]  # timed, timer_wakes, early, late

    def estimate(self, kind: Any) -> int:
        """The expected duration of ``kind`` from submission to completion (ns; 0: unknown)."""
        return self._est.get(kind, 0)

    def begin(self, stream: int, started: int, est: int) -> int:
        """When work submitted at ``started`` (perf_counter_ns) on ``stream`` should
        start running: after the work slept through before it on that stream is
        predicted to end (a stream runs in order). Notes this work's predicted end."""
        ends = self._ends
        prev = ends.get(stream, 0)
        base = prev if prev > started else started
        if len(ends) >= _MAX_KINDS:
            ends.clear()
        ends[stream] = base + est
        return base

    def forget(self, stream: int) -> None:
        """Nothing is known about when ``stream``'s latest work ends (a wait cancelled,
        or work predicted to end later than it did)."""
        self._ends.pop(stream, None)

    def ended(self, stream: int, predicted: int, at: int) -> None:
        """The work predicted to end at ``predicted`` on ``stream`` ended at ``at``."""
        if self._ends.get(stream) == predicted:
            self._ends[stream] = at

    def observed(self, kind: Any, ns: int) -> None:
        """Work of ``kind`` was seen to complete ``ns`` after its submission (while
        polling: exact within one pass of the scheduler)."""
        if kind is None or ns <= 0:  # (a stale prediction of the queue before it)
            return
        est = self._est
        e = est.get(kind)
        if e is None:
            if len(est) >= _MAX_KINDS:  # kinds come and go (geometries): forget the old ones
                est.clear()
            est[kind] = ns
        else:
            est[kind] = e + (ns - e) // 4

    def at_least(self, kind: Any, ns: int) -> None:
        """Work of ``kind`` was still running ``ns`` after its submission."""
        if kind is not None and self._est.get(kind, 0) < ns:
            self._est[kind] = ns

    def too_long(self, kind: Any, bound_ns: int) -> None:
        """Work of ``kind`` had finished when its task woke, ``bound_ns`` after submission:
        its estimate was too long (or the wake-up late). Shrinks the estimate."""
        if kind is None or bound_ns <= 0:
            return
        e = self._est.get(kind)
        if e is not None:
            # (it finished before the task ran again, which is about a wake-up's latency
            # after the work ended)
            self._est[kind] = max(0, min(bound_ns - self.lateness_ns, e - max(e // 16, 10_000)))

    def woke(self, late_ns: int) -> None:
        """A timed wake-up reached its task ``late_ns`` after its timer."""
        late = min(max(late_ns, 0), 2_000_000)
        self.spread_ns += (abs(late - self.lateness_ns) - self.spread_ns) // 8
        self.lateness_ns += (late - self.lateness_ns) // 8

    def lead_ns(self) -> int:
        """How long before the predicted end a sleeping task asks to be woken: the
        learned lateness, twice its spread, and a margin."""
        return self.lateness_ns + 2 * self.spread_ns + _GUARD_NS

    def statistics(self) -> WaitStatistics:
        timed, timer_wakes, early, late = self.counts
        return WaitStatistics(timed, timer_wakes, early, late, self.lateness_ns / 1e3, len(self._est))


_forecast = Forecast()


def forecast() -> Forecast:
    """The process-wide forecast."""
    return _forecast
