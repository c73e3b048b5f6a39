"""``cp_merge(exchange="allgather")`` on the GPU: an all-gather of the LSE, one kernel that
rescales this rank's V by its share of the global normaliser straight into the layout of the
collective, a reduce-scatter over heads (or an all-reduce), and one conversion kernel unless the
collective wrote the output itself. Large wires run in chunks of tokens, each chunk's collective
beside the next chunk's kernels."""

from __future__ import annotations

from typing import Any

from ..core import checks as _checks
from ..core import device as _device
from ..core import dtypes as _dtypes
from ..core import kernels as _kernels
from ..core.layout import VECTOR_BYTES
from ..core.tensors import Tensor, torch_view
from .args import Args
from .launch import launch

_WARP_THREADS = 32


def run(torch, pg, N, rank, collectives, a: Args, v, s, out, out_lse, nan_empty) -> None:
    """The combine on the GPU; ``collectives``: ``(all_gather, reduce_scatter, all_reduce, _)``."""
    dev, T, H, D, Hn, scatter = a.device, a.T, a.H, a.D, a.Hn, a.scatter
    stream = _device.torch_stream(dev)
    all_gather, reduce_scatter, all_reduce, _ = collectives
    rows = T * H

    # 1. every rank's LSE, [N, T, H] float32: straight from s when it is contiguous and needs no
    #    mask; otherwise packed into this rank's slot of the gather buffer (an in-place gather).
    plain = a.seq_lens is None and a.s.strides == (H, 1)
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
    o = torch_view(out)  # validated, or allocated by the call
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
# room beside them. With a float32 wire, 128 MB chunks are faster than one piece; smaller chunks
# cost more than they hide (each collective of a chunk runs slower than one of the whole), and
# with a bf16 wire summed straight into the output one piece is the fastest.
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


def _pack_lse(a: Args, dst: Any, stream: int) -> None:
    T, H, st = a.T, a.H, a.s
    masked = a.seq_lens is not None
    sl, q = a.seq_lens, a.qsl
    launch(
        _kernels.CP_PACK_LSE, (int(masked),), a.device, -(-T * H // _kernels.CP_PACK_LSE.block), stream,
        s=st.ptr, s_st=st.strides[0], s_sh=st.strides[1], dst=dst.data_ptr(), T=T, H=H,
        seq_lens=sl.ptr if masked else 0, sl_is64=int(masked and sl.dtype == "int64"),
        qsl=q.ptr if masked else 0, q_is64=int(masked and q.dtype == "int64"), batch=sl.shape[0] if masked else 0,
    )  # fmt: skip


class _Combine:
    """The combine kernel of one call, launched per chunk of tokens ``[t0, t1)``."""

    def __init__(self, a: Args, N, rank, lses_ptr, lse_h0, out_lse, nan_empty, stream) -> None:
        vt = a.v
        self.a, self.N, self.rank, self.lses_ptr, self.lse_h0 = a, N, rank, lses_ptr, lse_h0
        self.ol = None if out_lse is None else torch_view(out_lse)
        self.nan_empty, self.stream = int(nan_empty), stream
        vec = _kernels.vec(vt.dtype)
        if a.D % vec or vt.ptr % VECTOR_BYTES or vt.strides[0] % vec or vt.strides[1] % vec:
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
        launch(
            _kernels.CP_COMBINE, (_dtypes.ctype(vt.dtype), _dtypes.ctype(a.wire), vec), a.device, blocks, self.stream,
            v=vt.ptr + t0 * self.v_bytes, v_st=vt.strides[0], v_sh=vt.strides[1],
            lses=self.lses_ptr + t0 * a.H * 4, l_sn=a.T * a.H, wire=wire_ptr,
            olse=ol.ptr + t0 * ol.strides[0] * 4 if ol else 0, ol_st=ol.strides[0] if ol else 0,
            ol_sh=ol.strides[1] if ol else 0, sinks=a.sinks.ptr if a.sinks else 0,
            N=self.N, rank=self.rank, T=t1 - t0, H=a.H, D=a.D, Hn=a.Hn, lse_h0=self.lse_h0, lse_hn=a.Hn,
            lanes=_lanes(a.D, vec), tile_rows=tile, nan_empty=self.nan_empty, k=k, inv_k=inv_k,
        )  # fmt: skip


def _finalize(a: Args, red: Any, o: Tensor, t0: int, t1: int, cap: int | None, stream: int) -> None:
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
    launch(
        _kernels.CP_FINALIZE, (_dtypes.ctype(a.wire), _dtypes.ctype(o.dtype), vec), a.device, blocks, stream,
        src=red.data_ptr(), out=ptr, o_st=o.strides[0], o_sh=o.strides[1], T=t1 - t0, Hn=Hn, D=D, lanes=lanes,
        out_scale=a.scale.ptr if a.scale else 0,
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
