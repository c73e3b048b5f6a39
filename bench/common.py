"""What every benchmark shares: the row record, GPU timing by CUDA events over rotating input sets,
the copy bandwidth each figure is compared with, and the error against the float64 reference.

Units: µs of GPU time (median over the repetitions), GB/s = 1e9 bytes (read + written) per
second, % of copy = GB/s over the GB/s of a torch ``dst.copy_(src)`` measured in the same run.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_BYTES = 7e9  # shapes moving more than ~6 GB per call are skipped (65536 x 128 x 128 bf16 stays)
COPY_BYTES = 2**30  # size of each of the copy benchmark's two buffers
SAMPLE_ROWS = 256  # (token, head) rows compared with the float64 reference


@dataclass
class Row:
    """One measurement. ``bytes``: what the call must read + write (the bytes floor); for the
    empty-row ops: bytes written. ``us``: GPU µs (host µs for op "host", seconds x 1e6 for
    op "compile")."""

    op: str
    impl: str
    dtype: str = ""
    T: int | None = None
    H: int | None = None
    D: int | None = None
    bytes: int = 0
    us: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    max_err: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass
class Task:
    """One unit of work for the progress bar: ``run(bench)`` returns its rows."""

    part: str  # merge, fixup, mask, host, compile
    label: str
    run: Callable[[Bench], list[Row]]


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


class CudaTimer:
    """Median GPU time of one call by CUDA events, each call on the next input set.

    A spin kernel (``torch.cuda._sleep``) is queued before each batch of calls, long enough to
    cover the host's time to enqueue the batch, so the events time the GPU work and not the
    host's launch rate.
    """

    def __init__(self, torch: Any, budget_s: float, min_reps: int, max_reps: int) -> None:
        self.torch = torch
        self.budget_us = budget_s * 1e6
        self.min_reps, self.max_reps = min_reps, max_reps
        self.cycles_per_us = self._calibrate()

    def _event(self) -> Any:
        return self.torch.cuda.Event(enable_timing=True)

    def _calibrate(self) -> float:
        """Spin-kernel cycles per µs; the highest of a few readings after the clocks have
        ramped up, so that a spin never lasts less than intended."""
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

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def time_us(self, call: Callable[[tuple], Any], sets: Sequence[tuple], nbytes: int = 0) -> float:
        torch = self.torch
        n = len(sets)
        k = 0  # the rotation runs on through warm-up, estimates and timing

        def one() -> None:
            nonlocal k
            call(sets[k % n])
            k += 1

        for _ in range(min(n, 3) + 1):  # compile, load, autotune; first touch of the sets
            one()
        torch.cuda.synchronize()
        host = math.inf  # the host's time to enqueue one call (the GPU is idle, nothing blocks)
        for _ in range(3):
            t = time.perf_counter()
            one()
            host = min(host, time.perf_counter() - t)
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            one()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t) / 3 * 1e6
        host_us = host * 1e6
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_us / max(wall_us, 1.0))))
        batch = int(min(64, max(1, 4000 / max(host_us, 1.0))))
        times: list[float] = []
        while len(times) < reps:
            b = min(batch, reps - len(times))
            todo = [sets[(k + j) % n] for j in range(b)]
            k += b
            starts = [self._event() for _ in range(b)]
            ends = [self._event() for _ in range(b)]
            spin_us = min(200_000.0, 2.0 * b * host_us + 50.0 + 10.0 * b)
            torch.cuda._sleep(int(spin_us * self.cycles_per_us))
            for s, e, args in zip(starts, ends, todo, strict=True):
                s.record()
                call(args)
                e.record()
            ends[-1].synchronize()
            times += [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]
        return statistics.median(times)


class FakeTimer:
    """The harness on the CPU (``--dry-run``): each call runs once, the time is synthetic."""

    def sync(self) -> None:
        pass

    def time_us(self, call: Callable[[tuple], Any], sets: Sequence[tuple], nbytes: int = 0) -> float:
        for k in range(min(len(sets), 2)):
            call(sets[k])
        return 3.0 + nbytes / 3.0e3  # as if 3000 GB/s after a 3 µs launch


class Bench:
    """The context every task receives: device, timer, L2 size and the copy bandwidth."""

    def __init__(self, torch: Any, device: Any, timer: Any, *, l2_bytes: int, quick: bool, dry: bool):
        self.torch = torch
        self.device = device
        self.timer = timer
        self.l2_bytes = l2_bytes
        self.quick = quick
        self.dry = dry
        self.copy_gbps: float | None = None
        self.empty_launch_us: float | None = None
        self.shared: dict[str, Any] = {}  # figures one task leaves for a later one

    @property
    def mode(self) -> str:
        return "dry" if self.dry else ("quick" if self.quick else "full")

    def n_sets(self, set_bytes: float) -> int:
        """Rotating sets so that a set is out of L2 when it comes round again: one when a set
        alone is over 2 x L2, else at least 3 and more than 2 x L2 in all."""
        if set_bytes <= 0 or set_bytes > 2 * self.l2_bytes:
            return 1
        return max(3, int(2 * self.l2_bytes // set_bytes) + 1)

    def time_us(self, call: Callable[[tuple], Any], sets: Sequence[tuple], nbytes: int = 0) -> float:
        return self.timer.time_us(call, sets, nbytes)

    def sync(self) -> None:
        self.timer.sync()

    def row(self, op: str, impl: str, nbytes: int, us: float | None, **fields: Any) -> Row:
        gbps = nbytes / (us * 1e3) if us and nbytes else None
        pct = 100.0 * gbps / self.copy_gbps if gbps and self.copy_gbps else None
        return Row(op=op, impl=impl, bytes=int(nbytes), us=us, gbps=gbps, pct_copy=pct, **fields)

    def measure(
        self,
        op: str,
        impl: str,
        call: Callable[..., Any],
        sets: Sequence[tuple],
        nbytes: int,
        check: Callable[[Callable[..., Any]], float] | None = None,
        **fields: Any,
    ) -> Row:
        """Check (max error on a sample), then time ``call(*set)``; a failure becomes a row
        with a note instead of ending the run."""
        fields.setdefault("params", {})["sets"] = len(sets)
        try:
            err = check(call) if check is not None else None
            us = self.time_us(lambda s: call(*s), sets, nbytes)
        except Exception as e:  # one implementation failing must not stop the run
            return Row(
                op=op, impl=impl, bytes=int(nbytes), note=f"failed: {type(e).__name__}: {e}"[:300], **fields
            )
        return self.row(op, impl, nbytes, us, max_err=err, **fields)


# --- reference measurements -----------------------------------------------------------------


def copy_row(b: Bench, nbytes: int = COPY_BYTES) -> Row:
    """torch ``dst.copy_(src)`` of ``nbytes``; counts read + written (2 x nbytes)."""
    torch = b.torch
    src = torch.ones(nbytes, dtype=torch.uint8, device=b.device)
    dst = torch.empty_like(src)
    sets = Sets(b.n_sets(2 * nbytes), lambda k: (dst, src))
    us = b.time_us(lambda s: s[0].copy_(s[1]), sets, 2 * nbytes)
    b.copy_gbps = 2 * nbytes / (us * 1e3)
    return b.row("copy", "torch", 2 * nbytes, us, dtype="uint8", params={"buffer_bytes": nbytes})


class _Stream:
    """CuPy takes any object with an integer ``.ptr`` as a stream."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def empty_launch_row(b: Bench) -> Row:
    """GPU time of an empty kernel launched by CuPy on torch's current stream."""
    if b.dry:
        us = b.time_us(lambda s: None, Sets(1, lambda k: ()), 0)
    else:
        import cupy

        kernel = cupy.RawKernel('extern "C" __global__ void empty() {}', "empty")
        stream = _Stream(b.torch.cuda.current_stream().cuda_stream)
        us = b.time_us(lambda s: kernel((1,), (1,), (), stream=stream), Sets(1, lambda k: ()), 0)
    b.empty_launch_us = us
    return Row(op="empty_launch", impl="cupy", us=us)


# --- correctness on a sample ----------------------------------------------------------------


def to_np(t: Any) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def sample_rows(torch: Any, T: int, H: int, device: Any, n: int = SAMPLE_ROWS) -> tuple[Any, Any]:
    """Up to ``n`` distinct (token, head) pairs, always including the first and the last row."""
    total = T * H
    if total <= n:
        flat = torch.arange(total)
    else:
        g = torch.Generator().manual_seed(1234)
        flat = torch.randperm(total, generator=g)[:n]
        flat[0], flat[1] = 0, total - 1
    flat = flat.to(device)
    return flat // H, flat % H


def max_err(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """Largest absolute difference; ``inf`` when NaN or infinities are not at the same places."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if (np.isnan(a) != np.isnan(b)).any() or (np.isinf(a) != np.isinf(b)).any():
            return math.inf
        if (a[np.isinf(a)] != b[np.isinf(b)]).any():
            return math.inf
        fin = np.isfinite(b)
        if fin.any():
            worst = max(worst, float(np.abs(a[fin] - b[fin]).max()))
    return worst


def host_us(b: Bench, call: Callable[[], Any], n: int, warmup: int = 200) -> float:
    """Host µs per call: ``n`` calls back to back, synchronised before and after."""
    for _ in range(warmup):
        call()
    b.sync()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t = time.perf_counter()
        for _ in range(n):
            call()
        b.sync()
        return (time.perf_counter() - t) / n * 1e6
    finally:
        if gc_was_enabled:
            gc.enable()


def free_memory(b: Bench) -> None:
    gc.collect()
    if not b.dry:
        b.torch.cuda.empty_cache()
