"""Context-parallel combine of partial attention states over ``torch.distributed``.

Each rank of a context-parallel group holds the partial output and LSE of every row over its
own slice of the KV. ``cp_merge`` all-gathers the LSEs, rescales this rank's output by its share
of the global normaliser straight into the layout the collective needs (one kernel), sums over
the ranks with a reduce-scatter over heads or an all-reduce, and converts the sum to the output
dtype (one kernel, skipped when the collective can write the output itself). CPU tensors (gloo)
take the same steps in float64 on the host.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import numpy as np

from .core import checks as _checks
from .core import cpu_path as _host
from .core import device as _device
from .core import dtypes as _dtypes
from .core import kernels as _kernels
from .core import plans as _plans
from .core.tensors import Tensor, view

_SCATTER = ("heads", "none")
_WARP_THREADS = 32


def cp_merge(
    v: Any,
    s: Any,
    group: Any = None,
    *,
    scatter: str = "heads",
    lse_base: str | int = "e",
    return_lse: bool = False,
    wire_dtype: Any = None,
    sinks: Any = None,
    out: Any = None,
    out_lse: Any = None,
    out_scale: Any = None,
) -> Any:
    """Combine this rank's partial attention state with those of the other ranks of ``group``.

    Args:
        v: ``[T, H, D]`` torch tensor, float16 / bfloat16 / float32: this rank's partial output
            over its slice of the KV; head_dim contiguous, token and head strides free.
        s: ``[T, H]`` float32 LSE of ``v``, any strides (pass ``lse.T`` for an ``[H, T]`` buffer).
        group: a ``torch.distributed`` process group (NCCL for CUDA tensors, gloo for CPU
            tensors); ``None``: the default group. Every rank calls with the same T, H, D,
            dtypes and options.
        scatter: ``"heads"``: rank r receives heads ``[r*H/N, (r+1)*H/N)``, output
            ``[T, H/N, D]`` (a reduce-scatter; ``H % N == 0`` required); ``"none"``: every rank
            receives all heads, ``[T, H, D]`` (an all-reduce). Any N.
        lse_base: ``"e"`` (natural log) or ``2`` (FlashInfer / trtllm-gen).
        return_lse: also return the global LSE of this rank's output heads (``[T, H/N]``, or
            ``[T, H]`` for ``"none"``), written into ``out_lse`` when given.
        wire_dtype: the dtype the collective sums: float32 by default (one rounding, at the
            end), or float16 / bfloat16 (half the traffic; each share rounded before the sum).
        sinks: float32 ``[H]`` attention-sink logits, in the LSE's base, counted once in the
            final normaliser: ``S' = logaddexp(S, sink_h)``, ``out *= base^(S - S')``.
        out: the output, ``[T, H/N, D]`` (or ``[T, H, D]``), float16 / bfloat16 / float32 or
            float8_e4m3fn with ``out_scale``; head_dim contiguous. ``None``: allocated in
            ``v``'s dtype.
        out_lse: float32 ``[T, H/N]`` (or ``[T, H]``), any strides: the global LSE is written
            there (whether or not ``return_lse``).
        out_scale: float32 tensor of one element: fp8 output ``clamp(merged / scale)``.

    Empty rule, per rank and row: an LSE of -inf or +inf is empty: weight 0, and that rank's V
    never reaches the output (it may hold NaN/Inf scratch). Every rank empty: ``(0, -inf)``.
    NaN in any rank's LSE (or in a sink) makes the row NaN on every rank.

    CUDA: an all-gather of the LSE, one kernel, the reduce-scatter / all-reduce, and one
    conversion kernel when the output dtype or layout differs from the wire's; on the current
    stream of ``v``'s device, no host sync, so a call can be captured in a CUDA graph (the
    collective's buffers are allocated with torch on that stream). A wire of 256 MiB or more per
    rank that needs the conversion is sent in chunks of tokens, each chunk's collective running
    beside the kernels of the next. Ranks that disagree on shapes are not detected (that would
    take a host sync).
    CPU tensors: the same steps in float64 through gloo (``wire_dtype`` ignored); shapes that
    differ between ranks, or a rank that rejects its arguments, raise ``ValueError`` on every
    rank instead of hanging. Mutates ``out`` and ``out_lse`` only.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``.

    Example::

        out = zerokv.cp_merge(partial_out, partial_lse, dcp_group)  # [T, H / N, D]
    """
    return combine(
        v, s, group, scatter=scatter, lse_base=lse_base, return_lse=return_lse, wire_dtype=wire_dtype,
        sinks=sinks, out=out, out_lse=out_lse, out_scale=out_scale,
    )  # fmt: skip


class _Args(NamedTuple):
    """A validated call."""

    v: Tensor
    s: Tensor
    sinks: Tensor | None
    scale: Tensor | None
    seq_lens: Tensor | None
    qsl: Tensor | None
    T: int
    H: int
    D: int
    Hn: int  # heads of the output
    wire: str  # dtype name
    out_dtype: str
    base: str
    device: int


def combine(
    v: Any,
    s: Any,
    group: Any,
    *,
    scatter: str = "heads",
    lse_base: Any = "e",
    return_lse: bool = False,
    wire_dtype: Any = None,
    sinks: Any = None,
    out: Any = None,
    out_lse: Any = None,
    out_scale: Any = None,
    empty_shards: tuple[Any, Any] | None = None,
    nan_empty: bool = False,
    names: dict[str, str] | None = None,
) -> Any:
    """``cp_merge`` and the engine adapters. ``empty_shards``: ``(seq_lens [B],
    query_start_loc [B + 1])``: this rank's rows of requests with no local KV, and rows past
    ``query_start_loc[B]``, count as empty (vLLM's rule, applied as the LSE is packed for the
    all-gather). ``nan_empty``: a NaN LSE counts as empty instead of propagating (vLLM).
    ``names``: how the caller calls the arguments, for error messages."""
    n = _Names(names)
    torch = _torch(v, n("v"))
    pg, N, rank = _group(torch, group, n("group"))
    if getattr(v, "device", None) is not None and v.device.type == "cpu":
        return _host_combine(
            torch, pg, N, rank, n, scatter, return_lse,
            lambda: _validate(torch, v, s, N, scatter, lse_base, wire_dtype, sinks, out, out_lse, out_scale,
                              empty_shards, n),
            out, out_lse, nan_empty,
        )  # fmt: skip
    a = _validate(
        torch, v, s, N, scatter, lse_base, wire_dtype, sinks, out, out_lse, out_scale, empty_shards, n
    )
    if out is None:
        out = torch.empty((a.T, a.Hn, a.D), dtype=getattr(torch, a.out_dtype), device=v.device)
    if out_lse is None and return_lse:
        out_lse = torch.empty((a.T, a.Hn), dtype=torch.float32, device=v.device)
    if a.T * a.H:
        _device_combine(torch, pg, N, rank, scatter, a, v, s, out, out_lse, nan_empty)
    return (out, out_lse) if return_lse else out


# --- validation --------------------------------------------------------------------------------


class _Names:
    def __init__(self, names: dict[str, str] | None) -> None:
        self.names = names or {}

    def __call__(self, arg: str) -> str:
        return self.names.get(arg, arg)


def _torch(v: Any, arg: str) -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(v, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch tensor (the collectives run through torch.distributed), "
                        f"got {type(v).__name__}")  # fmt: skip
    return torch


def _group(torch: Any, group: Any, arg: str) -> tuple[Any, int, int]:
    """The process group, its size and this process's rank in it."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{arg}: torch.distributed is not initialised (call init_process_group first)")
    pg = dist.group.WORLD if group is None else group
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(
            f"{arg}: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    rank = pg.rank()
    if rank < 0:
        raise ValueError(f"{arg}: this process is not a member of the group")
    return pg, pg.size(), rank


def _dtype_name(torch: Any, x: Any, arg: str) -> str:
    if isinstance(x, str):
        name = x.removeprefix("torch.")
    elif isinstance(x, torch.dtype):
        name = str(x).removeprefix("torch.")
    else:
        raise TypeError(f"{arg}: expected a torch dtype or its name, got {type(x).__name__}")
    _dtypes.require(arg, name, _dtypes.V_IN)
    return name


def _validate(
    torch, v, s, N, scatter, lse_base, wire_dtype, sinks, out, out_lse, out_scale, empty_shards, n
) -> _Args:
    """Every check of a call, on the host, before anything is allocated or written."""
    vt = _checks.tensor(_view(torch, v, n("v")), n("v"), 3, _dtypes.V_IN)
    T, H, D = vt.shape
    if vt.numel:  # a zero-size tensor's strides mean nothing
        _checks.unit_last_stride(vt, n("v"))
    st = _checks.tensor(_view(torch, s, n("s")), n("s"), 2, _dtypes.LSE)
    _checks.shape(st, n("s"), (T, H), "T, H")
    if T >= 2**31 or H >= 2**31:
        raise ValueError(f"{n('v')}: T and H must be below 2^31, got shape {(T, H, D)}")
    if scatter not in _SCATTER:
        raise ValueError(f"{n('scatter')}: expected 'heads' or 'none', got {scatter!r}")
    if scatter == "heads" and H % N:
        raise ValueError(
            f"{n('v')}: {H} heads cannot be scattered over {N} ranks (H % N = {H % N}); "
            "use scatter='none' or a head count divisible by the group size"
        )
    Hn = H // N if scatter == "heads" else H
    base = _checks.lse_base(lse_base, n("lse_base"))
    wire = "float32" if wire_dtype is None else _dtype_name(torch, wire_dtype, n("wire_dtype"))
    named = [(n("v"), vt), (n("s"), st)]
    o = ol = None
    if out is not None:
        o = _checks.tensor(_view(torch, out, n("out")), n("out"), 3, _dtypes.V_OUT)
        _checks.shape(o, n("out"), (T, Hn, D), "T, heads of this rank, D")
        if o.numel:
            _checks.unit_last_stride(o, n("out"))
        named.append((n("out"), o))
    if out_lse is not None:
        ol = _checks.tensor(_view(torch, out_lse, n("out_lse")), n("out_lse"), 2, _dtypes.LSE)
        _checks.shape(ol, n("out_lse"), (T, Hn), "T, heads of this rank")
        named.append((n("out_lse"), ol))
    device = _checks.same_device(named)
    out_dtype = o.dtype if o is not None else vt.dtype
    sk = None if sinks is None else _checks.sinks(_view(torch, sinks, n("sinks")), n("sinks"), H, device)
    scale = None if out_scale is None else _view(torch, out_scale, n("out_scale"))
    scale = _checks.out_scale(scale, out_dtype, device, n("out_scale"))
    sl = q = None
    if empty_shards is not None:
        sl_arg, q_arg = n("seq_lens"), n("query_start_loc")
        sl = _checks.index_tensor(_view(torch, empty_shards[0], sl_arg), sl_arg, None, device)
        q = _checks.index_tensor(_view(torch, empty_shards[1], q_arg), q_arg, sl.shape[0] + 1, device)
    ins = [(n("v"), vt), (n("s"), st)]
    ins += [(nm, x) for nm, x in ((n("sinks"), sk), (n("out_scale"), scale)) if x is not None]
    ins += [(nm, x) for nm, x in ((n("seq_lens"), sl), (n("query_start_loc"), q)) if x is not None]
    _checks.outputs([(n("out"), o, ()), (n("out_lse"), ol, ())], ins)
    return _Args(vt, st, sk, scale, sl, q, T, H, D, Hn, wire, out_dtype, base, device)


def _view(torch: Any, x: Any, arg: str) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch tensor, got {type(x).__name__}")
    return view(x, arg)


# --- CUDA: the collectives through torch.distributed, the kernels on the current stream --------


@functools.cache
def _collectives(torch: Any) -> tuple[Any, Any, Any]:
    """all-gather into one tensor, reduce-scatter from one tensor (their names moved in torch
    2.13) and all-reduce, each ``(..., group=)``."""
    dist = torch.distributed
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return ag, rs, dist.all_reduce


def _device_combine(torch, pg, N, rank, scatter, a: _Args, v, s, out, out_lse, nan_empty) -> None:
    dev, T, H, D, Hn = a.device, a.T, a.H, a.D, a.Hn
    stream = _device.torch_stream(dev)
    all_gather, reduce_scatter, all_reduce = _collectives(torch)
    rows = T * H

    # 1. every rank's LSE, [N, T, H] float32: straight from s when it is contiguous and needs no
    #    mask; otherwise packed into this rank's slot of the gather buffer (an in-place gather).
    plain = a.seq_lens is None and tuple(s.stride()) == (H, 1)
    if plain and N == 1:
        lses = s
    else:
        lses = torch.empty(N * rows, dtype=torch.float32, device=v.device)
        src = s.view(-1) if plain else lses[rank * rows : (rank + 1) * rows]
        if not plain:
            _pack_lse(a, src, stream)
        if N > 1:
            all_gather(lses, src, group=pg)
    k2 = _Combine(
        a, N, rank, lses.data_ptr(), rank * Hn if scatter == "heads" else 0, out_lse, nan_empty, stream
    )
    if D == 0:  # the LSE only
        k2(out, 0, T, None)
        return

    # 2. this rank's share in the collective's layout (rank j's heads contiguous), in the wire
    #    dtype; 3. the sum; 4. the conversion to the output, unless the collective wrote it.
    o = view(out, "out")
    direct = o.dtype == a.wire and out.is_contiguous()
    wire_t = getattr(torch, a.wire)
    if scatter == "none":
        buf = out if direct else torch.empty((T, H, D), dtype=wire_t, device=v.device)
    elif direct and N == 1:
        buf = red = out.view(-1)
    else:
        buf = torch.empty((N * T * Hn * D,), dtype=wire_t, device=v.device)
        red = (
            out.view(-1)
            if direct
            else (buf if N == 1 else torch.empty((T * Hn * D,), dtype=wire_t, device=v.device))
        )

    # Large combines that need the conversion run in chunks of tokens: each chunk's collective
    # is issued asynchronously, so the kernels of the next (and the conversion of the previous)
    # chunk run beside it. Where the collective writes the output, one piece is faster.
    chunks = _chunks(T, H * D * _dtypes.itemsize(a.wire), N, direct)
    overlap = len(chunks) > 1
    cap = _device.sm_count(dev) * _OVERLAP_THREADS_PER_SM if overlap else 0
    waiting: list = []  # (work, t0, t1) of collectives issued, oldest first
    for t0, t1 in chunks:
        if scatter == "none":
            wire_c = red_c = buf.view(T, H, D)[t0:t1]
        else:
            wire_c = buf[N * t0 * Hn * D : N * t1 * Hn * D]
            red_c = red[t0 * Hn * D : t1 * Hn * D]
        k2(wire_c, t0, t1, cap)
        work = None
        if N > 1:
            if scatter == "none":
                work = all_reduce(wire_c, group=pg, async_op=overlap)
            else:
                work = reduce_scatter(red_c, wire_c, group=pg, async_op=overlap)
        waiting.append((work, red_c, t0, t1))
        if overlap and len(waiting) > 1:  # convert the previous chunk meanwhile
            w, r, a0, a1 = waiting.pop(0)
            w.wait()
            _finalize(a, r, o, a0, a1, cap, stream)
    for w, r, a0, a1 in waiting:  # chunks only with N > 1 and a conversion (_chunks)
        if overlap:
            w.wait()
        if not direct:
            _finalize(a, r, o, a0, a1, cap, stream)


# Pipelining: a combine whose wire holds at least _OVERLAP_MIN_BYTES per rank and needs the
# conversion runs in up to _OVERLAP_MAX_CHUNKS chunks of about _OVERLAP_CHUNK_BYTES; its kernels
# then take at most _OVERLAP_THREADS_PER_SM threads per SM, so that the collective's blocks find
# room beside them. Measured on two H200s (bench/NOTES.md): with a float32 wire, 128 MB chunks
# take 7-11 % off one piece at 268 MB and 2 GB; smaller chunks cost more than they hide (each
# collective of a chunk runs slower than one of the whole), and with a bf16 wire summed straight
# into the output one piece is the fastest.
_OVERLAP_MIN_BYTES = 256 << 20
_OVERLAP_CHUNK_BYTES = 128 << 20
_OVERLAP_MAX_CHUNKS = 16
_OVERLAP_THREADS_PER_SM = 1024


def _chunks(T: int, wire_bytes_per_token: int, N: int, direct: bool) -> list[tuple[int, int]]:
    """Token ranges ``[t0, t1)`` the combine runs in: one unless the wire is large."""
    total = T * wire_bytes_per_token
    if N == 1 or direct or total < _OVERLAP_MIN_BYTES:
        return [(0, T)]
    count = min(_OVERLAP_MAX_CHUNKS, -(-total // _OVERLAP_CHUNK_BYTES), T)
    step = -(-T // count)
    return [(t, min(T, t + step)) for t in range(0, T, step)]


def _pack_lse(a: _Args, dst: Any, stream: int) -> None:
    T, H, st = a.T, a.H, a.s
    masked = a.seq_lens is not None
    launch = _plans.launcher(_kernels.CP_PACK_LSE, (int(masked),), a.device)
    sl, q = a.seq_lens, a.qsl
    launch(
        -(-T * H // _kernels.CP_PACK_LSE.block), stream,
        st.ptr, st.strides[0], st.strides[1], dst.data_ptr(), T, H,
        sl.ptr if masked else 0, int(masked and sl.dtype == "int64"),
        q.ptr if masked else 0, int(masked and q.dtype == "int64"), sl.shape[0] if masked else 0,
    )  # fmt: skip


class _Combine:
    """The combine kernel of one call, launched per chunk of tokens ``[t0, t1)``."""

    def __init__(self, a: _Args, N, rank, lses_ptr, lse_h0, out_lse, nan_empty, stream) -> None:
        vt = a.v
        self.a, self.N, self.rank, self.lses_ptr, self.lse_h0 = a, N, rank, lses_ptr, lse_h0
        self.ol = None if out_lse is None else view(out_lse, "out_lse")
        self.nan_empty, self.stream = int(nan_empty), stream
        vec = _kernels.vec(vt.dtype)
        if a.D % vec or vt.ptr % 16 or vt.strides[0] % vec or vt.strides[1] % vec:
            vec = 1
        self.vec = vec
        self.v_bytes = vt.strides[0] * _dtypes.itemsize(vt.dtype)  # per token

    def __call__(self, wire: Any, t0: int, t1: int, cap: int | None) -> None:
        a, vt, ol = self.a, self.a.v, self.ol
        wire_ptr = wire.data_ptr()
        vec = (
            self.vec if wire_ptr % (self.vec * _dtypes.itemsize(a.wire)) == 0 else 1
        )  # wire: maybe the output
        rows = (t1 - t0) * a.H
        tile, blocks = _tiles(rows, _kernels.CP_COMBINE.block)
        if cap:
            blocks = max(1, min(blocks, cap // _kernels.CP_COMBINE.block))
        k, inv_k = _checks.LSE_BASES[a.base]
        launch = _plans.launcher(
            _kernels.CP_COMBINE, (_dtypes.ctype(vt.dtype), _dtypes.ctype(a.wire), vec), a.device
        )
        launch(
            blocks, self.stream,
            vt.ptr + t0 * self.v_bytes, vt.strides[0], vt.strides[1],
            self.lses_ptr + t0 * a.H * 4, a.T * a.H, wire_ptr,
            ol.ptr + t0 * ol.strides[0] * 4 if ol else 0, ol.strides[0] if ol else 0, ol.strides[1] if ol else 0,
            a.sinks.ptr if a.sinks else 0,
            self.N, self.rank, t1 - t0, a.H, a.D, a.Hn, self.lse_h0, a.Hn,
            _lanes(a.D, vec), tile, self.nan_empty, k, inv_k,
        )  # fmt: skip


def _finalize(a: _Args, red: Any, o: Tensor, t0: int, t1: int, cap: int | None, stream: int) -> None:
    """The reduced rows ``[t0, t1)`` (``red``: contiguous ``[t1 - t0, Hn, D]``) into ``o``."""
    _, Hn, D = o.shape
    size = _dtypes.itemsize(o.dtype)
    ptr = o.ptr + t0 * o.strides[0] * size
    vec = _kernels.cp_finalize_vec(a.wire, o.dtype)
    if D % vec or ptr % (vec * size) or o.strides[0] % vec or o.strides[1] % vec:
        vec = 1
    lanes = _lanes(D, vec)
    rows = (t1 - t0) * Hn
    per_block = _kernels.CP_FINALIZE.block // lanes  # rows a block converts per step
    blocks = max(1, -(-rows // per_block))
    if cap:
        blocks = min(blocks, max(1, cap // _kernels.CP_FINALIZE.block))
    launch = _plans.launcher(
        _kernels.CP_FINALIZE, (_dtypes.ctype(a.wire), _dtypes.ctype(o.dtype), vec), a.device
    )
    launch(
        blocks, stream, red.data_ptr(), ptr, o.strides[0], o.strides[1], t1 - t0, Hn, D, lanes,
        a.scale.ptr if a.scale else 0,
    )  # fmt: skip


def _tiles(rows: int, block: int) -> tuple[int, int]:
    """Rows per warp tile and the blocks: 32-row tiles once there are rows enough to fill the
    GPU, smaller tiles for small batches (their latency is one tile's, not 32 rows in a row)."""
    tile = 1 << min(5, max(0, (rows // 2048).bit_length() - 1)) if rows >= 2048 else 1
    tiles = -(-rows // tile)
    return tile, -(-tiles // (block // _WARP_THREADS))


def _lanes(D: int, vec: int) -> int:
    """Threads per row: the accesses a row needs, rounded up to a power of two, at most 32."""
    return min(32, 1 << max(0, -(-D // vec) - 1).bit_length())


# --- CPU (gloo): the same steps in float64 -----------------------------------------------------

# fields every rank must agree on, in the order of the exchanged vector
_AGREE = ("T", "H", "D", "v dtype", "wire_dtype", "scatter", "lse_base", "sinks", "mask", "nan rule")


def _host_combine(torch, pg, N, rank, n, scatter, return_lse, validate, out, out_lse, nan_empty) -> Any:
    """Validate, agree with the other ranks (one small all-gather, so that a rejected call or a
    mismatch raises on every rank instead of hanging), then combine in float64."""
    err, a = None, None
    try:
        a = validate()
    except (TypeError, ValueError) as e:
        err = e
    mine = [0] * (1 + len(_AGREE))
    if a is not None:
        codes = (a.T, a.H, a.D, _code(a.v.dtype), _code(a.wire), _SCATTER.index(scatter), int(a.base == "2"),
                 int(a.sinks is not None), int(a.seq_lens is not None), int(nan_empty))  # fmt: skip
        mine = [1, *codes]
    all_gather, reduce_scatter, all_reduce = _collectives(torch)
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
    if a.T * a.H == 0:
        return (out, out_lse) if return_lse else out

    T, H, D, Hn = a.T, a.H, a.D, a.Hn
    own = _host.to_f64(a.s).astype(np.float32)
    if a.seq_lens is not None:
        own[empty_shard_rows(_host.to_f64(a.seq_lens), _host.to_f64(a.qsl), T)] = -np.inf
    gathered = torch.empty(N * T * H, dtype=torch.float32)
    all_gather(gathered, torch.from_numpy(own.reshape(-1)), group=pg)
    lses = gathered.view(N, T, H).double().numpy()
    sinks = None if a.sinks is None else _host.to_f64(a.sinks)
    f, lse = shares(lses, rank, a.base, sinks, nan_empty)
    vv = _host.to_f64(a.v)
    f3 = f[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        part = f3 * np.where(f3 > 0, vv, 0.0)  # an empty share's V never used; a NaN share stays NaN
    if scatter == "none":
        total = torch.from_numpy(np.ascontiguousarray(part))
        if N > 1:
            all_reduce(total, group=pg)
    else:
        wire = torch.from_numpy(np.ascontiguousarray(part.reshape(T, N, Hn, D).transpose(1, 0, 2, 3)))
        total = torch.empty((T, Hn, D), dtype=torch.float64)
        if N > 1:
            reduce_scatter(total.view(-1), wire.view(-1), group=pg)
        else:
            total = wire[0]
    _host.write(view(out, "out"), _host.scaled(total.numpy(), a.scale))
    if out_lse is not None:
        h0 = rank * Hn if scatter == "heads" else 0
        _host.write(view(out_lse, "out_lse"), lse[:, h0 : h0 + Hn])
    return (out, out_lse) if return_lse else out


def _code(dtype: str) -> int:
    return list(_dtypes.ALL).index(dtype)


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
