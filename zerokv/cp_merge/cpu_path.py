"""``cp_merge`` on the CPU (gloo): the same steps as on the GPU, in float64 on the host.

The ranks first agree (one small all-gather of each rank's validated signature), so a rejected
call or a mismatch raises on every rank instead of hanging. Then, ``"allgather"``: every rank's
LSE gathered, this rank's share ``f_r V_r`` summed over the ranks by a reduce-scatter or an
all-reduce; ``"a2a"``: this rank's V with its LSE beside it sent in one chunk per peer with one
all-to-all, and the partials of this rank's heads merged with the shares of their LSEs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import cpu_path as _host
from ..core import dtypes as _dtypes
from ..core.tensors import view
from .args import EXCHANGES, SCATTERS, Args

# fields every rank must agree on, in the order of the exchanged vector
_AGREE = ("T", "H", "D", "v dtype", "wire_dtype", "scatter", "exchange", "lse_base", "sinks", "mask",
          "nan rule", "send buffer")  # fmt: skip


def run(torch, pg, N, rank, collectives, n, return_lse, validate, out, out_lse, nan_empty) -> Any:
    """Validate, agree with the other ranks, then combine in float64."""
    err, a = None, None
    try:
        a = validate()
    except (TypeError, ValueError) as e:
        err = e
    mine = [0] * (1 + len(_AGREE))
    if a is not None:
        codes = (a.T, a.H, a.D, _code(a.v.dtype), _code(a.wire), SCATTERS.index(a.scatter),
                 EXCHANGES.index(a.exchange), int(a.base == "2"), int(a.sinks is not None),
                 int(a.seq_lens is not None), int(nan_empty), int(a.send is not None))  # fmt: skip
        mine = [1, *codes]
    all_gather = collectives[0]
    table = torch.empty((N, len(mine)), dtype=torch.int64)
    all_gather(table.view(-1), torch.tensor(mine, dtype=torch.int64), group=pg)
    if err is not None:
        raise err
    rows = table.tolist()
    rejected = [r for r, row in enumerate(rows) if row[0] == 0]
    if rejected:
        raise ValueError(
            f"cp_merge: rank(s) {rejected} of the group rejected their arguments; nothing was written"
        )
    for i, field in enumerate(_AGREE, start=1):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"{n('v')}: {field} differs across the ranks of the group: {values} (by rank)")

    assert a is not None
    if out is None:
        out = torch.empty((a.T, a.Hn, a.D), dtype=getattr(torch, a.out_dtype))
    if out_lse is None and return_lse:
        out_lse = torch.empty((a.T, a.Hn), dtype=torch.float32)
    if a.T * a.H:
        vv, own = _state(a, nan_empty)
        step = _all_to_all if a.exchange == "a2a" else _all_gather
        total, lse = step(torch, pg, N, rank, collectives, a, vv, own, nan_empty)
        _host.write(view(out, "out"), _host.scaled(total, a.scale))
        if out_lse is not None:
            _host.write(view(out_lse, "out_lse"), lse)
    return (out, out_lse) if return_lse else out


def _state(a: Args, nan_empty: bool) -> tuple[np.ndarray, np.ndarray]:
    """This rank's ``V [T, H, D]`` and LSE ``[T, H]`` in float64, the empty-shard mask applied
    (and, with ``nan_empty``, NaN as -inf: what the GPU's pack does)."""
    T, H, D = a.T, a.H, a.D
    vv, own = _host.to_f64(a.v), _host.to_f64(a.s)
    if a.send is not None:  # [N, T, H/N, D] -> [T, H, D]
        vv = vv.transpose(1, 0, 2, 3).reshape(T, H, D)
        own = own.transpose(1, 0, 2).reshape(T, H)
    own = own.astype(np.float32).astype(np.float64)
    if a.seq_lens is not None:
        own[empty_shard_rows(_host.to_f64(a.seq_lens), _host.to_f64(a.qsl), T)] = -np.inf
    if nan_empty and a.exchange == "a2a":
        own[np.isnan(own)] = -np.inf
    return vv, own


def _all_gather(torch, pg, N, rank, collectives, a: Args, vv, own, nan_empty):
    all_gather, reduce_scatter, all_reduce, _ = collectives
    T, H, D, Hn = a.T, a.H, a.D, a.Hn
    gathered = torch.empty(N * T * H, dtype=torch.float32)
    all_gather(gathered, torch.from_numpy(own.astype(np.float32).reshape(-1)), group=pg)
    lses = gathered.view(N, T, H).double().numpy()
    sinks = None if a.sinks is None else _host.to_f64(a.sinks)
    f, lse = shares(lses, rank, a.base, sinks, nan_empty)
    f3 = f[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        part = f3 * np.where(f3 > 0, vv, 0.0)  # an empty share's V never used; a NaN share stays NaN
    if a.scatter == "none":
        total = torch.from_numpy(np.ascontiguousarray(part))
        if N > 1:
            all_reduce(total, group=pg)
        return total.numpy(), lse
    wire = torch.from_numpy(np.ascontiguousarray(part.reshape(T, N, Hn, D).transpose(1, 0, 2, 3)))
    total = torch.empty((T, Hn, D), dtype=torch.float64)
    if N > 1:
        reduce_scatter(total.view(-1), wire.view(-1), group=pg)
    else:
        total = wire[0]
    return total.numpy(), lse[:, rank * Hn : (rank + 1) * Hn]


def _all_to_all(torch, pg, N, rank, collectives, a: Args, vv, own, nan_empty):
    """Chunk j of the send buffer: heads ``[j Hn, (j+1) Hn)`` as ``[T, Hn, D + 1]``, the LSE in
    the last column (float64 holds it exactly)."""
    all_to_all = collectives[3]
    T, D, Hn = a.T, a.D, a.Hn
    packed = np.concatenate([vv, own[..., None]], axis=-1).reshape(T, N, Hn, D + 1).transpose(1, 0, 2, 3)
    send = torch.from_numpy(np.ascontiguousarray(packed))
    recv = torch.empty_like(send) if N > 1 else send
    if N > 1:
        all_to_all(recv.view(-1), send.view(-1), group=pg)
    got = recv.numpy()  # [N, T, Hn, D + 1]: every rank's partial of this rank's heads
    v_in, lses = got[..., :D], got[..., D]
    sinks = None if a.sinks is None else _host.to_f64(a.sinks)[rank * Hn : (rank + 1) * Hn]
    total = np.zeros((T, Hn, D))
    lse = None
    for r in range(N):
        f, lse = shares(lses, r, a.base, sinks, nan_empty)
        f3 = f[..., None]
        with np.errstate(invalid="ignore", over="ignore"):
            total = total + f3 * np.where(f3 > 0, v_in[r], 0.0)
    return total, lse


def _code(dtype: str) -> int:
    return list(_dtypes.TABLE).index(dtype)


def shares(
    lses: np.ndarray, rank: int, lse_base: str, sinks: np.ndarray | None = None, nan_empty: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """From the gathered LSEs ``[N, T, H]``: rank ``rank``'s factor ``[T, H]`` (0 for an empty
    row, NaN for a NaN row) and the global LSE ``[T, H]``, in float64. The sink is one more
    state with V = 0; ``nan_empty``: a NaN LSE counts as empty (vLLM)."""
    lses = np.asarray(lses, dtype=np.float64)
    base = np.e if lse_base == "e" else 2.0
    nan = np.zeros(lses.shape[1:], dtype=bool) if nan_empty else np.isnan(lses).any(axis=0)
    if sinks is not None:
        sk = np.broadcast_to(np.asarray(sinks, dtype=np.float64), lses.shape[1:])
        nan |= np.isnan(sk)
        lses = np.concatenate([lses, sk[None]])
    usable = np.isfinite(lses)
    m = np.where(usable, lses, -np.inf).max(axis=0)
    live = np.isfinite(m)
    m0 = np.where(live, m, 0.0)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        w = np.where(usable, np.power(base, np.where(usable, lses, 0.0) - m0), 0.0)
        total = np.where(live, w.sum(axis=0), 1.0)
        f = np.where(live, w[rank] / total, 0.0)
        lse = np.where(live, m0 + np.log(total) / np.log(base), -np.inf)
    if sinks is not None:
        plus = sk == np.inf
        f = np.where(plus, 0.0, f)
        lse = np.where(plus, np.inf, lse)
    return np.where(nan, np.nan, f), np.where(nan, np.nan, lse)


def empty_shard_rows(seq_lens: np.ndarray, query_start_loc: np.ndarray, T: int) -> np.ndarray:
    """vLLM's empty-shard rule, boolean ``[T]``: row t is empty when ``t >= qsl[B]`` or when its
    request ``q = min(#{i in 1..B : qsl[i] <= t}, B - 1)`` has ``seq_lens[q] == 0``. The count
    is the kernel's binary search (``searchsorted`` for non-decreasing offsets); B = 0 leaves only
    the first rule. Offsets are read, never used as addresses."""
    sl = np.asarray(seq_lens, dtype=np.int64)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    B = sl.shape[0]
    t = np.arange(T, dtype=np.int64)
    empty = t >= qsl[B]
    if B > 0:
        lo, hi = np.zeros(T, dtype=np.int64), np.full(T, B, dtype=np.int64)
        while (lo < hi).any():
            active = lo < hi
            mid = (lo + hi) >> 1
            right = active & (qsl[np.minimum(mid, B - 1) + 1] <= t)
            lo = np.where(right, mid + 1, lo)
            hi = np.where(active & ~right, mid, hi)
        empty |= sl[np.minimum(lo, B - 1)] == 0
    return empty
