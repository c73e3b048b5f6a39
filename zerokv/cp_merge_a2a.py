"""``cp_merge(exchange="a2a")`` on the GPU, and the send buffer an attention kernel can write into.

One chunk per peer: chunk ``j`` carries heads ``[j Hn, (j + 1) Hn)`` of every token, V as
``[T, Hn, D]`` in the wire dtype followed by the float32 LSE ``[T, Hn]`` (its bits travel as
``32 / bits`` wire elements per row, so V and LSE go in one collective), each block on 16 bytes so
that V rows keep 16-byte accesses (a row of ``D + 32 / bits`` elements would not). One kernel packs
this rank's state into that layout (vLLM's empty-shard mask fused in), one ``all_to_all_single``
delivers to every rank the N partials of its own heads, and ``merge_states``' kernel merges them
with exact LSE weights in float32 (``sinks``, ``lse_base``, fp8 / 16-bit / float32 outputs).
With a :class:`CpSendBuffer` the caller's attention writes the partial in place: no pack.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .core import device as _device
from .core import dtypes as _dtypes
from .core import kernels as _kernels
from .core.tensors import torch_view
from .cp_merge_args import Args
from .cp_merge_launch import launch

_ALIGN = 16


class Layout(NamedTuple):
    """The send buffer of ``N`` peers for ``T`` tokens, ``Hn`` heads per peer, head_dim ``D``."""

    N: int
    T: int
    Hn: int
    D: int
    wire: str
    lse_off: int  # bytes from a chunk's start to its LSE block
    chunk: int  # bytes per peer

    @property
    def nbytes(self) -> int:
        return self.N * self.chunk


def layout(N: int, T: int, Hn: int, D: int, wire: str) -> Layout:
    v_bytes = -(-T * Hn * D * _dtypes.itemsize(wire) // _ALIGN) * _ALIGN
    lse_bytes = -(-T * Hn * 4 // _ALIGN) * _ALIGN
    return Layout(N, T, Hn, D, wire, v_bytes, v_bytes + lse_bytes)


def views(torch: Any, buf: Any, lay: Layout) -> tuple[Any, Any]:
    """``buf`` (uint8, ``lay.nbytes``) as V ``[N, T, Hn, D]`` and LSE ``[N, T, Hn]``, zero-copy."""
    N, T, Hn, D = lay.N, lay.T, lay.Hn, lay.D
    isz = _dtypes.itemsize(lay.wire)
    v = buf.view(getattr(torch, lay.wire)).as_strided((N, T, Hn, D), (lay.chunk // isz, Hn * D, D, 1))
    lse = buf.view(torch.float32).as_strided((N, T, Hn), (lay.chunk // 4, Hn, 1), lay.lse_off // 4)
    return v, lse


class CpSendBuffer:
    """A send buffer for ``cp_merge(..., exchange="a2a", send=...)``, made by
    :func:`zerokv.cp_send_buffer`: ``v`` ``[N, T, H/N, D]`` and ``lse`` ``[N, T, H/N]`` (float32)
    are views of it, peer ``j``'s heads at ``[j]``; ``recv`` is the receive buffer (the same
    memory as ``send`` in a group of one). Reused across calls (CUDA-graph safe). ``facts``:
    the views' records and the buffers' byte ranges, read once for the calls' cheap check."""

    __slots__ = ("layout", "send", "recv", "v", "lse", "facts")

    def __init__(self, torch: Any, lay: Layout, device: Any) -> None:
        self.layout = lay
        self.send = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.send) if lay.N > 1 else self.send
        self.v, self.lse = views(torch, self.send, lay)
        bufs = (self.send,) if self.recv is self.send else (self.send, self.recv)
        spans = tuple((b.data_ptr(), b.data_ptr() + lay.nbytes) for b in bufs if lay.nbytes)
        self.facts = (torch_view(self.v), torch_view(self.lse), spans)

    def __repr__(self) -> str:
        lay = self.layout
        return f"CpSendBuffer(N={lay.N}, T={lay.T}, heads per rank={lay.Hn}, D={lay.D}, {lay.wire})"


def run(torch, pg, N, rank, collectives, a: Args, out, out_lse, sinks, out_scale, nan_empty) -> None:
    """Pack (unless ``a.send``), exchange, merge into ``out`` / ``out_lse`` (may be None)."""
    from .merge import merge_states

    if a.send is not None:
        lay, send, recv = a.send.layout, a.send.send, a.send.recv
    else:
        lay = layout(N, a.T, a.Hn, a.D, a.wire)
        send = torch.empty(lay.nbytes, dtype=torch.uint8, device=out.device)
        recv = torch.empty_like(send) if N > 1 else send
        _pack(a, lay, send.data_ptr(), nan_empty, _device.torch_stream(a.device))
    if N > 1:
        collectives[3](recv, send, group=pg)
    v_in, s_in = views(torch, recv, lay)
    own = None if sinks is None else sinks[rank * a.Hn : (rank + 1) * a.Hn]
    merge_states(v_in, s_in, out=out, out_lse=out_lse, lse_base="e" if a.base == "e" else 2,
                 out_scale=out_scale, sinks=own)  # fmt: skip


def _pack(a: Args, lay: Layout, send_ptr: int, nan_empty: bool, stream: int) -> None:
    vt, st, D = a.v, a.s, a.D
    vec = _kernels.vec(vt.dtype)
    if D % vec or vt.ptr % _ALIGN or vt.strides[0] % vec or vt.strides[1] % vec:
        vec = 1
    lanes_log2 = max(0, -(-D // vec) - 1).bit_length() if D else 0
    lanes_log2 = min(5, lanes_log2)
    masked = a.seq_lens is not None
    block = _kernels.CP_A2A_PACK.block
    threads = a.T * a.H << lanes_log2
    sl, q = a.seq_lens, a.qsl
    targs = (_dtypes.ctype(vt.dtype), _dtypes.ctype(a.wire), vec, int(masked))
    launch(
        _kernels.CP_A2A_PACK, targs, a.device, -(-threads // block), stream,
        v=vt.ptr, v_st=vt.strides[0], v_sh=vt.strides[1], s=st.ptr, s_st=st.strides[0], s_sh=st.strides[1],
        send=send_ptr, chunk=lay.chunk, lse_off=lay.lse_off, T=a.T, H=a.H, Hn=a.Hn, D=D, lanes_log2=lanes_log2,
        nan_empty=int(nan_empty), seq_lens=sl.ptr if masked else 0, sl_is64=int(masked and sl.dtype == "int64"),
        qsl=q.ptr if masked else 0, q_is64=int(masked and q.dtype == "int64"), batch=sl.shape[0] if masked else 0,
    )  # fmt: skip
