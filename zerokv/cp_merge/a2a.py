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

from ..core import device as _device
from ..core import dtypes as _dtypes
from ..core import kernels as _kernels
from ..core.layout import VECTOR_BYTES
from .args import Args
from .launch import launch
from .send_buffer import CpSendBuffer, Layout, layout, views  # noqa: F401 - the a2a path's layout


def run(torch, pg, N, rank, collectives, a: Args, out, out_lse, sinks, out_scale, nan_empty) -> None:
    """Pack (unless ``a.send``), exchange, merge into ``out`` / ``out_lse`` (may be None)."""
    from ..merge import merge_states

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
    if D % vec or vt.ptr % VECTOR_BYTES or vt.strides[0] % vec or vt.strides[1] % vec:
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
