"""GPU time of a call: ``CudaTimer`` on a GPU, ``FakeTimer`` for the dry run on the CPU.

The timer a ``Bench`` carries takes a task's GPU time one way: µs of GPU time per call from
replaying a CUDA graph of many calls (no host cost inside; the implementations of a shape in
interleaved rounds, the median of each), and beside it the CUDA-event time of one call made
eagerly. ``Bench.measure`` (``common``) hands the timer the implementations of one shape; the
timer knows nothing of rows or reports.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

MIN_ROUNDS = 15  # interleaved rounds at least (CudaTimer.time_together)


class Timing(NamedTuple):
    us: float  # GPU µs per call in a graph replay (the event time when no graph could be made)
    event_us: float  # CUDA-event time of one eager call
    stats: dict[str, Any]
    note: str = ""


@dataclass
class _Prepared:
    """A call ready to be timed: its graph of ``n`` calls and what was measured on the way."""

    graph: Any
    n: int
    event_us: float
    stats: dict[str, Any]
    us: float
    note: str


class CudaTimer:
    """GPU time of a call, two ways, each call on the next input set:

    * graph: ``n`` calls (up to ``graph_calls``, fewer for long calls) captured in one CUDA
      graph, replayed; the median replay time over ``n``. No host cost is inside.
    * event: one eager call between two CUDA events, median over a few. A spin kernel queued
      first covers the host's time to enqueue them, so the events time the GPU's work.
    """

    def __init__(self, torch: Any, *, budget_us: float, graph_calls: int = 50, max_replays: int = 40) -> None:
        self.torch = torch
        self.budget_us = budget_us
        self.graph_calls = graph_calls
        self.max_replays = max_replays
        self.side = torch.cuda.Stream()  # captures run here, as torch.cuda.graph does
        self.cycles_per_us = self._calibrate()

    def _event(self) -> Any:
        return self.torch.cuda.Event(enable_timing=True)

    def _calibrate(self) -> float:
        """Spin-kernel cycles per µs: the highest of a few readings after the clocks ramped up,
        so that a spin never lasts less than intended."""
        torch = self.torch
        torch.cuda._sleep(20_000_000)
        torch.cuda.synchronize()
        cycles, best = 5_000_000, 0.0
        for _ in range(3):
            start, end = self._event(), self._event()
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            best = max(best, cycles / (start.elapsed_time(end) * 1e3))
        return best

    def _spin(self, us: float) -> None:
        self.torch.cuda._sleep(int(min(us, 200_000.0) * self.cycles_per_us))

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def time(self, call: Callable[..., Any], sets: Sequence[tuple], nbytes: int = 0) -> Timing:
        (t,) = self.time_together([(call, sets)], nbytes)
        if isinstance(t, Exception):
            raise t
        return t

    def time_together(
        self, items: Sequence[tuple[Callable[..., Any], Sequence[tuple]]], nbytes: int = 0
    ) -> list[Timing | Exception]:
        """``time`` for several calls (the implementations of one shape): each is warmed up,
        event-timed and captured, then the graphs are replayed in turn, round after round, and
        each call's figure is the median of its rounds. A GPU's clocks and caches drift over a
        run by more than the gaps between small kernels; interleaved, the drift falls on every
        implementation alike. A call that fails gives its exception in its place. ``nbytes``:
        what each call moves (only the dry run's synthetic times use it)."""
        torch = self.torch
        prepared: list[_Prepared | Exception] = []
        for call, sets in items:
            try:
                prepared.append(self._prepare(call, sets))
            except Exception as e:  # one implementation failing must not stop the others
                torch.cuda.synchronize()
                prepared.append(e)
        live = [p for p in prepared if isinstance(p, _Prepared) and p.graph is not None]
        if live:
            # each call's share of the budget, as when timed alone; at least MIN_ROUNDS rounds
            per_round = sum(p.n * p.event_us for p in live)
            share = self.budget_us / 2 * len(live) / max(per_round, 1.0)
            rounds = int(min(self.max_replays, max(MIN_ROUNDS, share)))
            for p in live:
                p.graph.replay()  # the first replay uploads the graph
            torch.cuda.synchronize()
            marks = [[(self._event(), self._event()) for _ in range(rounds)] for _ in live]
            self._spin(60.0 * rounds * len(live) + 50.0)
            # A new order every round, and each timed replay right after an untimed one of the
            # same graph: what a call leaves behind for the next (dirty cache lines, a heavy
            # eager baseline's temporaries) falls on the untimed replay, as when timed alone.
            order = list(range(len(live)))
            shuffle = random.Random(len(live) * 7919 + rounds).shuffle
            for r in range(rounds):
                shuffle(order)
                for i in order:
                    live[i].graph.replay()
                    marks[i][r][0].record()
                    live[i].graph.replay()
                    marks[i][r][1].record()
            torch.cuda.synchronize()
            for p, m in zip(live, marks, strict=True):
                per_call = [a.elapsed_time(b) * 1e3 / p.n for a, b in m]
                p.stats.update(
                    graph_calls=p.n, replays=rounds, interleaved_with=len(live) - 1,
                    replay_spread_us=[min(per_call), max(per_call)],
                )  # fmt: skip
                p.us = statistics.median(per_call)
                p.graph = None
        return [
            p if isinstance(p, Exception) else Timing(p.us, p.event_us, p.stats, p.note) for p in prepared
        ]

    def _prepare(self, call: Callable[..., Any], sets: Sequence[tuple]) -> _Prepared:
        """Warm-up, the event time of one eager call and the graph of ``n`` calls (None, with a
        note, when the call cannot be captured: then the event time is its figure)."""
        torch = self.torch
        K = len(sets)
        k = 0  # the rotation runs on through warm-up, events and the graph

        def take(n: int) -> list[tuple]:
            nonlocal k
            out = [sets[(k + j) % K] for j in range(n)]  # built before anything is queued
            k += n
            return out

        for s in take(min(K, 3) + 1):  # compile, load, autotune; first touch of the sets
            call(*s)
        torch.cuda.synchronize()
        host = math.inf  # host µs to enqueue one call (the GPU idle, nothing blocks)
        for s in take(3):
            t = time.perf_counter()
            call(*s)
            host = min(host, time.perf_counter() - t)
            torch.cuda.synchronize()
        host_us = host * 1e6
        todo = take(3)
        t = time.perf_counter()
        for s in todo:
            call(*s)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t) / 3 * 1e6

        reps = int(min(10, max(3, self.budget_us / 2 / max(wall_us, 1.0))))
        todo = take(reps)
        starts = [self._event() for _ in todo]
        ends = [self._event() for _ in todo]
        self._spin(2.0 * reps * host_us + 50.0)
        for s, e, args in zip(starts, ends, todo, strict=True):
            s.record()
            call(*args)
            e.record()
        ends[-1].synchronize()
        event_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))

        n = int(min(self.graph_calls, max(3, 2000.0 / max(event_us, 0.1))))
        stats: dict[str, Any] = {"sets": K, "event_reps": reps, "host_enqueue_us": host_us}
        try:
            graph = self._capture(call, take(n))
        except Exception as e:  # an op that syncs or allocates outside torch: events only
            torch.cuda.synchronize()
            stats["timed_by"] = "events"
            return _Prepared(
                None, n, event_us, stats, event_us, f"graph capture failed: {type(e).__name__}: {e}"[:200]
            )
        return _Prepared(graph, n, event_us, stats, event_us, "")

    def _capture(self, call: Callable[..., Any], todo: list[tuple]) -> Any:
        """One CUDA graph of ``call`` over ``todo``. Captured on a side stream by hand:
        ``torch.cuda.graph`` runs a garbage collection on entry (tens of ms per measurement)."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream())
        failure: Exception | None = None
        with torch.cuda.stream(self.side):
            graph.capture_begin()
            try:
                for s in todo:
                    call(*s)
            except Exception as e:
                failure = e
            try:
                graph.capture_end()
            except Exception as e:
                failure = failure or e
        torch.cuda.current_stream().wait_stream(self.side)
        if failure is not None:
            raise failure
        return graph


class FakeTimer:
    """The pipeline on the CPU (``--dry-run``): each call runs on a couple of sets, the time is
    synthetic (as if 3000 GB/s after 2 µs)."""

    def sync(self) -> None:
        pass

    def time(self, call: Callable[..., Any], sets: Sequence[tuple], nbytes: int = 0) -> Timing:
        todo = [sets[j % len(sets)] for j in range(min(len(sets), 4))]
        for s in todo[:2]:
            call(*s)
        us = 2.0 + nbytes / 3.0e3
        return Timing(us, us + 1.5, {"sets": len(sets), "timed_by": "fake"})

    def time_together(
        self, items: Sequence[tuple[Callable[..., Any], Sequence[tuple]]], nbytes: int = 0
    ) -> list[Timing | Exception]:
        out: list[Timing | Exception] = []
        for call, sets in items:
            try:
                out.append(self.time(call, sets, nbytes))
            except Exception as e:
                out.append(e)
        return out
