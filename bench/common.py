"""What every benchmark shares: the row and task records, the byte floors, GPU timing, the copy
bandwidth every figure is compared with, the error against the float64 reference and the
progress display.

Units: µs of GPU time per call, from replaying a CUDA graph of many calls (no host cost inside;
the implementations of a shape in interleaved rounds, the median of each); beside it the
CUDA-event time of one call made eagerly. GB/s = 1e9 bytes (read + written) per
second; % of copy = GB/s over the GB/s of a torch ``dst.copy_(src)`` measured in the same run.
"""

from __future__ import annotations

import gc
import math
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

COPY_BYTES = 2**30  # each of the copy benchmark's two buffers
MIN_ROUNDS = 15  # interleaved rounds at least (CudaTimer.time_together)
SAMPLE_ROWS = 256  # (token, head) rows compared with the float64 reference

# --- records ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One measurement.

    ``op`` names the table and the PNG panel, ``impl`` the column and the line. ``bytes``: what
    the call must move (read + written; bytes written for the empty-row ops). ``us``: GPU µs per
    call from a CUDA-graph replay (host µs for op "host", seconds x 1e6 for op "compile");
    ``event_us``: CUDA-event time of one eager call. ``params``: what identifies the
    configuration (layout, N, empty rows, mode...); ``stats``: how it was measured.
    """

    op: str
    impl: str
    dtype: str = ""
    T: int | None = None
    H: int | None = None
    D: int | None = None
    bytes: int = 0
    us: float | None = None
    event_us: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    max_err: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass
class Task:
    """One step of the progress bar: ``run(bench)`` returns its rows."""

    part: str  # the --only name it belongs to
    label: str
    run: Callable[[Bench], list[Row]]


# --- sizes ------------------------------------------------------------------------------------

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # label -> torch dtype name
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def merge_bytes(dtype: str, T: int, H: int, D: int) -> int:
    """merge_state: read 2 V + 2 LSE, write 1 V + 1 LSE (LSE float32)."""
    return T * H * (3 * D * ITEMSIZE[dtype] + 3 * 4)


def states_bytes(dtype: str, N: int, T: int, H: int, D: int) -> int:
    """merge_states: read N V + N LSE, write 1 V + 1 LSE."""
    return (N + 1) * T * H * (D * ITEMSIZE[dtype] + 4)


def written_bytes(dtype: str, E: int, H: int, D: int) -> int:
    """fixup / mask: V and LSE of the E empty rows written."""
    return E * H * (D * ITEMSIZE[dtype] + 4)


class Sets:
    """``count`` rotating input sets; set ``k`` is ``make(k)`` (views into pools with a leading
    set dimension), built on first use so that only the sets a measurement touches exist."""

    def __init__(self, count: int, make: Callable[[int], tuple]) -> None:
        self.count = count
        self._make = make
        self._built: dict[int, tuple] = {}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, k: int) -> tuple:
        k %= self.count
        s = self._built.get(k)
        if s is None:
            s = self._built[k] = self._make(k)
        return s


# --- timing -----------------------------------------------------------------------------------


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


class Entry(NamedTuple):
    """One implementation of a shape for ``Bench.measure``."""

    impl: str
    call: Callable[..., Any]
    sets: Sequence[tuple]
    check: Callable[[Callable[..., Any]], float] | None
    params: dict[str, Any]


class Bench:
    """The context every task receives: device, timer, mode, L2 size and the copy bandwidth."""

    def __init__(self, torch: Any, device: Any, timer: Any, *, l2_bytes: int, mode: str) -> None:
        self.torch = torch
        self.device = device
        self.timer = timer
        self.l2_bytes = l2_bytes
        self.mode = mode  # "full", "quick" or "dry"
        self.copy_gbps: float | None = None
        self.shared: dict[str, Any] = {}  # figures one task leaves for a later one

    @property
    def dry(self) -> bool:
        return self.mode == "dry"

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    def n_sets(self, set_bytes: float) -> int:
        """Rotating sets so that a set is out of L2 when it comes round again: one when a set
        alone is over 2 x L2, else at least 3 and more than 2 x L2 in all."""
        if set_bytes <= 0 or set_bytes > 2 * self.l2_bytes:
            return 1
        return max(3, int(2 * self.l2_bytes // set_bytes) + 1)

    def free_bytes(self) -> int:
        if self.dry:
            return 2**40
        free, _ = self.torch.cuda.mem_get_info(self.device)
        return int(free)

    def sync(self) -> None:
        self.timer.sync()

    def row(self, op: str, impl: str, nbytes: int, us: float | None, **fields: Any) -> Row:
        gbps = nbytes / (us * 1e3) if us and nbytes else None
        pct = 100.0 * gbps / self.copy_gbps if gbps and self.copy_gbps else None
        return Row(op=op, impl=impl, bytes=int(nbytes), us=us, gbps=gbps, pct_copy=pct, **fields)

    def measure(self, op: str, entries: Sequence[Entry], nbytes: int, **fields: Any) -> list[Row]:
        """The implementations of one shape: each checked (max error on a sample), then all timed
        together, their graphs replayed in interleaved rounds (``CudaTimer.time_together``); a
        failure becomes a row with a note instead of ending the run."""
        errors: list[float | None | Exception] = []
        for e in entries:
            try:
                errors.append(e.check(e.call) if e.check is not None else None)
            except Exception as x:
                errors.append(x)
        todo = [i for i, err in enumerate(errors) if not isinstance(err, Exception)]
        timings = dict(
            zip(
                todo,
                self.timer.time_together([(entries[i].call, entries[i].sets) for i in todo], nbytes),
                strict=True,
            )
        )
        rows = []
        for i, e in enumerate(entries):
            t = timings.get(i, errors[i])
            if isinstance(t, Exception):
                note = f"failed: {type(t).__name__}: {t}"[:300]
                rows.append(Row(op=op, impl=e.impl, bytes=int(nbytes), note=note, params=e.params, **fields))
                continue
            row = self.row(
                op,
                e.impl,
                nbytes,
                t.us,
                event_us=t.event_us,
                max_err=errors[i],
                stats=t.stats,
                params=e.params,
                **fields,
            )
            row.note = t.note
            rows.append(row)
        return rows


def copy_row(b: Bench) -> Row:
    """torch ``dst.copy_(src)``; counts read + written (2 x the buffer)."""
    torch = b.torch
    nbytes = 2**20 if b.dry else COPY_BYTES
    src = torch.ones(nbytes, dtype=torch.uint8, device=b.device)
    dst = torch.empty_like(src)
    if b.dry:
        call, label = (lambda d, s: d.copy_(s)), "torch copy_"
    else:  # an SM copy: torch's copy_ in a graph is a copy-engine node (see baselines.COPY)
        from .baselines import copy_launch

        call, label = copy_launch(dst, src), "SM copy (16-byte words)"
    t = b.timer.time(call, Sets(1, lambda k: (dst, src)), 2 * nbytes)
    b.copy_gbps = 2 * nbytes / (t.us * 1e3)
    row = b.row("copy", label, 2 * nbytes, t.us, dtype="uint8", event_us=t.event_us, stats=t.stats)
    row.params["buffer_bytes"] = nbytes
    return row


# --- correctness on a sample ------------------------------------------------------------------


def to_np(t: Any) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def sample_rows(torch: Any, T: int, H: int, device: Any, n: int = SAMPLE_ROWS) -> tuple[Any, Any]:
    """Up to ``n`` distinct (token, head) pairs, always the first and the last row."""
    total = T * H
    if total <= n:
        flat = torch.arange(total)
    else:
        g = torch.Generator().manual_seed(1234)
        flat = torch.randperm(total, generator=g)[:n]
        flat[0], flat[1] = 0, total - 1
    flat = flat.to(device)
    return flat // H, flat % H


def max_error(actual: Any, expected: Any) -> float:
    """``zerokv.reference.max_error``, the one error measure of the self-check, the bench and
    the tests (imported on use: the compile child times zerokv's import itself)."""
    from zerokv.reference import max_error as reference_max_error

    return reference_max_error(actual, expected)


def free_memory(b: Bench) -> None:
    """Hand cached blocks back after a task that held a lot (a collection costs tens of ms, so
    not after every task)."""
    if b.dry:
        return
    torch = b.torch
    if torch.cuda.memory_reserved(b.device) > 8 * 2**30:
        gc.collect()
        torch.cuda.empty_cache()


# --- progress ---------------------------------------------------------------------------------


def brief(rows: list[Row]) -> str:
    """A few words per row: implementation, µs, % of copy (or what went wrong)."""
    parts = []
    for r in rows[:6]:
        if r.us is None:
            parts.append(f"{r.impl}: {r.note.split(':')[0] or '-'}")
        elif r.op == "compile":
            parts.append(f"{r.impl} {r.params.get('item')} {r.us / 1e6:.2f} s")
        elif r.pct_copy is not None:
            parts.append(f"{r.impl} {r.us:.1f} µs {r.pct_copy:.0f}%")
        else:
            parts.append(f"{r.impl} {r.us:.2f} µs")
    return "; ".join(parts)


class Progress:
    """A tqdm bar on a terminal when tqdm is installed, one plain line per task otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.count = 0
        self.bar: Any = None
        if sys.stderr.isatty() and shutil.get_terminal_size((0, 0)).columns >= 40:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="task", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(label[:48])

    def done(self, label: str, rows: list[Row], seconds: float) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(
                f"[{self.count}/{self.total}] {label}: {brief(rows)} ({seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
