"""The batch behind the fixup and mask benchmarks, and their shared run.

A batch of ``T = 32768 + 8192`` rows in requests of 64 rows each, ``H = 128``, ``D = 128``, bf16;
``E`` empty rows (0, 64, 1024, 4096, 32768) are ``E / 64`` requests spread evenly over the batch.
Rotating input sets share the output buffer and move the empty requests, so that each set
writes other rows. GB/s and % of copy are on the bytes written: ``E x H x (2 D + 4)``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from zerokv import reference

from .common import Bench, Row, Sets, Task, max_err, to_np

NAN = float("nan")


class Layout(NamedTuple):
    rows_per_request: int
    T: int
    H: int
    D: int
    counts: tuple[int, ...]  # empty rows measured, multiples of rows_per_request


def layout(mode: str) -> Layout:
    if mode == "dry":
        return Layout(4, 32 + 16, 2, 16, (0, 4, 16, 32))
    return Layout(64, 32768 + 8192, 128, 128, (0, 64, 1024, 4096, 32768))


def written_bytes(E: int, H: int, D: int, itemsize: int = 2) -> int:
    return E * H * (D * itemsize + 4)


def empty_requests(B: int, n_empty: int, shift: int) -> np.ndarray:
    """``[B]`` bool: ``n_empty`` requests spread evenly, moved ``shift`` requests on."""
    flags = np.zeros(B, dtype=bool)
    if n_empty:
        flags[(np.arange(n_empty) * B // n_empty + shift) % B] = True
    return flags


# (cu_seqlens_q, kv_lens, cu_seqlens_kv) -> the op's arguments after out, lse
ArgOrder = Callable[[Any, Any, Any], tuple]


def tasks(part: str, op: str, impls: list[tuple[str, Any]], args: ArgOrder, mode: str) -> list[Task]:
    lay = layout(mode)
    return [
        Task(part, f"{op} {E} empty rows of {lay.T}", partial(run, op, impls, args, lay, E))
        for E in lay.counts
    ]


def run(op: str, impls: list[tuple[str, Any]], args: ArgOrder, lay: Layout, E: int, b: Bench) -> list[Row]:
    torch = b.torch
    dev = b.device
    R, T, H, D = lay.rows_per_request, lay.T, lay.H, lay.D
    B = T // R
    n_empty = E // R
    nbytes = written_bytes(E, H, D)
    K = b.n_sets(nbytes)
    step = max(1, (B // max(n_empty, 1)) // K)
    out = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    lse = torch.randn(T, H, device=dev)
    cu = torch.arange(0, T + 1, R, dtype=torch.int32, device=dev)
    flags = [empty_requests(B, n_empty, k * step) for k in range(K)]

    def make(k: int) -> tuple:
        kv = torch.from_numpy(np.where(flags[k], 0, 100).astype(np.int32)).to(dev)
        cu_kv = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), kv.cumsum(0).to(torch.int32)])
        return (out, lse, *args(cu, kv, cu_kv))

    sets = Sets(K, make)
    rows0 = np.repeat(flags[0], R)  # [T] rows emptied by set 0
    empty_idx, full_idx = np.flatnonzero(rows0), np.flatnonzero(~rows0)
    idx = np.concatenate([_spread(empty_idx, 128), _spread(full_idx, 128)])
    sample_empty = rows0[idx]
    idx_t = torch.from_numpy(idx).to(dev)
    rows0_t = torch.from_numpy(rows0).to(dev)

    def check(fn: Any) -> float:
        out.normal_()
        lse.normal_()
        out[rows0_t] = NAN  # the scratch an attention kernel leaves in empty rows
        before = to_np(out[idx_t]), to_np(lse[idx_t])
        fn(*sets[0])
        b.sync()
        want = reference.write_empty_rows(before[0], before[1], sample_empty)
        return max_err([to_np(out[idx_t]), to_np(lse[idx_t])], want)

    params = {"empty_rows": E, "requests": B, "rows_per_request": R}
    result = []
    for name, fn in impls:
        row = b.measure(op, name, fn, sets, nbytes, check, dtype="bf16", T=T, H=H, D=D, params=dict(params))
        if E == 0:
            row.params["empty_launch_us"] = b.empty_launch_us
        result.append(row)
    return result


def _spread(idx: np.ndarray, n: int) -> np.ndarray:
    if len(idx) <= n:
        return idx
    return idx[np.linspace(0, len(idx) - 1, n).round().astype(np.int64)]
