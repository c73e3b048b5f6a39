"""What every benchmark shares: the row and task records, the byte floors, the rotating input
sets, the ``Bench`` context each task receives (which checks and times the implementations of
a shape and turns bytes and µs into GB/s and % of copy), the copy bandwidth every figure is
compared with and the error against the float64 reference.

Units: µs of GPU time per call (how it is timed: ``timing``). GB/s = 1e9 bytes (read + written)
per second; % of copy = GB/s over the GB/s of a torch ``dst.copy_(src)`` measured in the same
run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

COPY_BYTES = 2**30  # each of the copy benchmark's two buffers
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


# --- the context of a task --------------------------------------------------------------------


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
    else:  # an SM copy: torch's copy_ in a graph is a copy-engine node (see yardsticks.COPY)
        from .yardsticks import copy_launch

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
