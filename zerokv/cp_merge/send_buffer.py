"""The send buffer of ``cp_merge(exchange="a2a")``: one chunk per peer, V then the float32 LSE,
each block on 16 bytes; :class:`CpSendBuffer` lets an attention kernel write into it."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..core import dtypes as _dtypes
from ..core.layout import VECTOR_BYTES
from ..core.tensors import torch_view


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
    v_bytes = -(-T * Hn * D * _dtypes.itemsize(wire) // VECTOR_BYTES) * VECTOR_BYTES
    lse_bytes = -(-T * Hn * 4 // VECTOR_BYTES) * VECTOR_BYTES
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
    the views' records and the buffers' byte ranges, read once for the calls' plan."""

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
