"""fixup_zero_kv_rows and mask_empty_context, one benchmark parametrised over the op, beside
their torch-eager equivalents (bench/baselines.py); and the GPU time of an empty kernel launched
as zerokv launches (the floor of the 0-empty-rows case; bench/yardsticks.py).

The batch: ``T = 32768 + 8192`` rows in requests of 64 rows, ``H = 128``, ``D = 128``, bf16;
``E`` empty rows (0, 64, 1024, 4096, 32768) are ``E / 64`` requests spread evenly over it.
Rotating input sets share the output and move the empty requests, so that each set writes
other rows. GB/s and % of copy are on the bytes written: ``E x H x (2 D + 4)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import numpy as np

import zerokv
from zerokv import reference

from . import baselines, yardsticks
from .common import Bench, Entry, Row, Sets, Task, max_error, to_np, written_bytes

NAN = float("nan")


def _fixup(out, lse, cu, kv, cu_kv):
    zerokv.fixup_zero_kv_rows(out, lse, kv, cu)
    return out, lse


def _mask(out, lse, cu, kv, cu_kv):
    zerokv.mask_empty_context(out, lse, cu, cu_kv)
    return out, lse


def _eager_fixup(out, lse, cu, kv, cu_kv):
    return baselines.eager_fixup_zero_kv_rows(out, lse, kv, cu)


def _eager_mask(out, lse, cu, kv, cu_kv):
    return baselines.eager_mask_empty_context(out, lse, cu, cu_kv)


# op -> implementations, each taking (out, lse, cu_seqlens_q, kv_lens, cu_seqlens_kv)
OPS = {
    "fixup_zero_kv_rows": [("zerokv", _fixup), ("torch eager", _eager_fixup)],
    "mask_empty_context": [("zerokv", _mask), ("torch eager", _eager_mask)],
}


class Layout(NamedTuple):
    rows_per_request: int
    T: int
    H: int
    D: int
    counts: tuple[int, ...]  # empty rows measured, multiples of rows_per_request


def layout(mode: str) -> Layout:
    if mode == "dry":  # the same batch and counts, narrow rows: the CPU path stays quick
        return Layout(64, 32768 + 8192, 2, 8, (0, 64, 4096, 32768))
    counts = (0, 4096, 32768) if mode == "quick" else (0, 64, 1024, 4096, 32768)
    return Layout(64, 32768 + 8192, 128, 128, counts)


def tasks(b: Bench, part: str) -> list[Task]:
    lay = layout(b.mode)
    out = [Task(part, "empty kernel launch", run_empty_launch)]
    out += [
        Task(part, f"{op} {E} empty rows of {lay.T}", partial(run, op, lay, E))
        for op in OPS
        for E in lay.counts
    ]
    return out


def run_empty_launch(b: Bench) -> list[Row]:
    call = (lambda: None) if b.dry else yardsticks.empty_launch(b.device.index)
    t = b.timer.time(call, Sets(1, lambda k: ()))
    return [
        Row(
            op="empty_launch",
            impl="zerokv launcher",
            us=t.us,
            event_us=t.event_us,
            stats=t.stats,
            note=t.note,
        )
    ]


def empty_requests(B: int, n_empty: int, shift: int) -> np.ndarray:
    """``[B]`` bool: ``n_empty`` requests spread evenly, moved ``shift`` requests on."""
    flags = np.zeros(B, dtype=bool)
    if n_empty:
        flags[(np.arange(n_empty) * B // n_empty + shift) % B] = True
    return flags


def _spread(idx: np.ndarray, n: int) -> np.ndarray:
    if len(idx) <= n:
        return idx
    return idx[np.linspace(0, len(idx) - 1, n).round().astype(np.int64)]


def run(op: str, lay: Layout, E: int, b: Bench) -> list[Row]:
    torch, dev = b.torch, b.device
    R, T, H, D = lay.rows_per_request, lay.T, lay.H, lay.D
    B = T // R
    n_empty = E // R
    nbytes = written_bytes("bf16", E, H, D)
    K = b.n_sets(nbytes)
    step = max(1, (B // max(n_empty, 1)) // K)
    out = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    lse = torch.randn(T, H, device=dev)
    cu = torch.arange(0, T + 1, R, dtype=torch.int32, device=dev)
    flags = [empty_requests(B, n_empty, k * step) for k in range(K)]

    def make(k: int) -> tuple:
        kv = torch.from_numpy(np.where(flags[k], 0, 100).astype(np.int32)).to(dev)
        cu_kv = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), kv.cumsum(0).to(torch.int32)])
        return out, lse, cu, kv, cu_kv

    sets = Sets(K, make)
    rows0 = np.repeat(flags[0], R)  # [T] rows emptied by set 0
    idx = np.concatenate([_spread(np.flatnonzero(rows0), 128), _spread(np.flatnonzero(~rows0), 128)])
    idx_t = torch.from_numpy(idx).to(dev)
    rows0_t = torch.from_numpy(rows0).to(dev)

    def check(fn: Any) -> float:
        out.normal_()
        lse.normal_()
        out[rows0_t] = NAN  # the scratch an attention kernel leaves in empty rows
        before = to_np(out[idx_t]), to_np(lse[idx_t])
        fn(*sets[0])
        b.sync()
        want_o, want_l = reference.write_empty_rows(before[0], before[1], rows0[idx])
        return max(max_error(to_np(out[idx_t]), want_o), max_error(to_np(lse[idx_t]), want_l))

    params = {"empty_rows": E, "requests": B, "rows_per_request": R}
    entries = [Entry(name, fn, sets, check, dict(params)) for name, fn in OPS[op]]
    return b.measure(op, entries, nbytes, dtype="bf16", T=T, H=H, D=D)
