"""Context-parallel combine of partial attention states over ``torch.distributed``.

Each rank of a context-parallel group holds the partial output and LSE of every row over its
own slice of the KV. ``cp_merge`` combines them in one of two ways:

* ``exchange="allgather"``: all-gather the LSEs, rescale this rank's output by its share of the
  global normaliser straight into the layout the collective needs (one kernel), sum over the ranks
  with a reduce-scatter over heads or an all-reduce (:mod:`zerokv.cp_merge.allgather`);
* ``exchange="a2a"``: send each rank its heads of this rank's output with the LSE beside it in one
  all-to-all, then merge the N partials of this rank's heads in one kernel
  (:mod:`zerokv.cp_merge.a2a`; :func:`cp_send_buffer` lets the attention write into the send layout).

CPU tensors (gloo) take the same steps in float64 on the host (:mod:`zerokv.cp_merge.cpu_path`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from . import a2a, allgather, cpu_path
from . import plan as _plan
from .a2a import CpSendBuffer
from .args import Names, dtype_name, validate


def cp_merge(
    v: Any,
    s: Any,
    group: Any = None,
    *,
    scatter: str = "heads",
    exchange: str = "allgather",
    lse_base: str | int = "e",
    return_lse: bool = False,
    wire_dtype: Any = None,
    sinks: Any = None,
    out: Any = None,
    out_lse: Any = None,
    out_scale: Any = None,
    send: CpSendBuffer | None = None,
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
            ``[T, H/N, D]`` (``H % N == 0`` required); ``"none"``: every rank receives all
            heads, ``[T, H, D]`` (an all-reduce; ``exchange="allgather"`` only). Any N.
        exchange: ``"allgather"``: an all-gather of the LSE, one rescaling kernel, a
            reduce-scatter (or all-reduce) of the shares; ``"a2a"``: one all-to-all of V with its
            LSE packed beside it, then one kernel merging the N partials of this rank's heads.
        lse_base: ``"e"`` (natural log) or ``2`` (FlashInfer / trtllm-gen).
        return_lse: also return the global LSE of this rank's output heads (``[T, H/N]``, or
            ``[T, H]`` for ``"none"``), written into ``out_lse`` when given.
        wire_dtype: what the collective carries. ``"allgather"``: the dtype the sum runs in,
            float32 by default (one rounding, at the end) or float16 / bfloat16 (half the
            traffic; each share rounded before the sum). ``"a2a"``: the dtype V travels in, the
            input dtype by default (no rounding: the merge runs in float32 after the exchange).
        sinks: float32 ``[H]`` attention-sink logits, in the LSE's base, counted once in the
            final normaliser: ``S' = logaddexp(S, sink_h)``, ``out *= base^(S - S')``.
        out: the output, ``[T, H/N, D]`` (or ``[T, H, D]``), float16 / bfloat16 / float32 or
            float8_e4m3fn with ``out_scale``; head_dim contiguous. ``None``: allocated in
            ``v``'s dtype.
        out_lse: float32 ``[T, H/N]`` (or ``[T, H]``), any strides: the global LSE is written
            there (whether or not ``return_lse``).
        out_scale: float32 tensor of one element: fp8 output ``clamp(merged / scale)``.
        send: with ``exchange="a2a"``, a buffer from :func:`cp_send_buffer` whose views the
            attention wrote this rank's state into; pass those views as ``v`` and ``s``
            (``[N, T, H/N, D]`` and ``[N, T, H/N]``): the pack is skipped.

    Empty rule, per rank and row: an LSE of -inf or +inf is empty: weight 0, and that rank's V
    never reaches the output (it may hold NaN/Inf scratch). Every rank empty: ``(0, -inf)``.
    NaN in any rank's LSE (or in a sink) makes the row NaN.

    CUDA, ``"allgather"``: an all-gather of the LSE, one kernel, the reduce-scatter /
    all-reduce, and one conversion kernel when the output dtype or layout differs from the
    wire's; a wire of 256 MiB or more per rank that needs the conversion is sent in chunks of
    tokens, each chunk's collective beside the kernels of the next. ``"a2a"``: the pack kernel
    (none with ``send``), one ``all_to_all_single``, the merge kernel. On the current stream of
    ``v``'s device, no host sync, so a call can be captured in a CUDA graph (buffers are
    allocated with torch on that stream; none with ``send`` and ``out``). Ranks that disagree on
    shapes are not detected (that would take a host sync).
    CPU tensors: the same steps in float64 through gloo (``wire_dtype`` ignored); shapes that
    differ between ranks, or a rank that rejects its arguments, raise ``ValueError`` on every
    rank instead of hanging. Mutates ``out`` and ``out_lse`` only.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``.

    Example::

        out = zerokv.cp_merge(partial_out, partial_lse, dcp_group)  # [T, H / N, D]
        out = zerokv.cp_merge(partial_out, partial_lse, dcp_group, exchange="a2a")
    """
    return combine(
        v, s, group, scatter=scatter, exchange=exchange, lse_base=lse_base, return_lse=return_lse,
        wire_dtype=wire_dtype, sinks=sinks, out=out, out_lse=out_lse, out_scale=out_scale, send=send,
    )  # fmt: skip


def cp_send_buffer(
    T: int, H: int, D: int, dtype: Any, group: Any = None, *, device: Any = None
) -> tuple[Any, Any, CpSendBuffer]:
    """A send buffer for ``cp_merge(..., exchange="a2a", send=...)``, so that the attention
    kernel writes its partial state straight into the layout the all-to-all sends.

    Args:
        T, H, D: tokens, heads (all of them, divisible by the group size) and head_dim.
        dtype: float16 / bfloat16 / float32: the dtype V is written (and sent) in.
        group: the process group of the later calls (``None``: the default group).
        device: where to allocate (default: the current CUDA device; ``"cpu"`` for gloo).

    Returns:
        ``(v, lse, send)``: ``v`` ``[N, T, H/N, D]`` and ``lse`` float32 ``[N, T, H/N]`` are
        views of the buffer (peer ``j``'s heads ``[j H/N, (j+1) H/N)`` at ``[j]``; head_dim
        contiguous); write this rank's partial output and LSE there, then call
        ``cp_merge(v, lse, group, exchange="a2a", send=send)``. Allocated once; reuse it for
        every call of this shape (CUDA-graph safe: the call allocates nothing more).

    Example::

        v, lse, send = zerokv.cp_send_buffer(T, H, D, torch.bfloat16, dcp_group)
        for j in range(N):  # or one attention launch that writes through these strides
            attention(q[:, j * Hn:(j + 1) * Hn], ..., out=v[j], lse=lse[j])
        out = zerokv.cp_merge(v, lse, dcp_group, exchange="a2a", send=send)
    """
    torch = sys.modules.get("torch")
    if torch is None:
        raise TypeError("cp_send_buffer: needs torch (the collectives run through torch.distributed)")
    _, N, _ = _group(torch, group, "group")
    for name, x in (("T", T), ("H", H), ("D", D)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {x!r}")
    if H % N:
        raise ValueError(f"H: {H} heads cannot be split over {N} ranks (H % N = {H % N})")
    wire = dtype_name(torch, dtype, "dtype")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    buf = CpSendBuffer(torch, a2a.layout(N, T, H // N, D, wire), dev)
    return buf.v, buf.lse, buf


def combine(
    v: Any,
    s: Any,
    group: Any,
    *,
    scatter: str = "heads",
    exchange: str = "allgather",
    lse_base: Any = "e",
    return_lse: bool = False,
    wire_dtype: Any = None,
    sinks: Any = None,
    out: Any = None,
    out_lse: Any = None,
    out_scale: Any = None,
    send: Any = None,
    empty_shards: tuple[Any, Any] | None = None,
    nan_empty: bool = False,
    names: dict[str, str] | None = None,
) -> Any:
    """``cp_merge`` and the engine adapters. ``empty_shards``: ``(seq_lens [B],
    query_start_loc [B + 1])``: this rank's rows of requests with no local KV, and rows past
    ``query_start_loc[B]``, count as empty (vLLM's rule, applied as the LSE is packed).
    ``nan_empty``: a NaN LSE counts as empty instead of propagating (vLLM).
    ``names``: how the caller calls the arguments, for error messages."""
    n = Names(names)
    torch = _torch(v, n("v"))
    pg, N, rank = _group(torch, group, n("group"))
    collectives = _collectives(torch)

    def checked() -> Any:
        return validate(torch, v, s, N, scatter, exchange, lse_base, wire_dtype, sinks, out, out_lse,
                        out_scale, empty_shards, send, n)  # fmt: skip

    f = _plan.read(v, s, sinks, out, out_lse, out_scale, empty_shards)
    if f is None or f.device < 0:  # host tensors, or arguments only the full validation reads
        if v.device.type == "cpu":
            return cpu_path.run(
                torch, pg, N, rank, collectives, n, return_lse, checked, out, out_lse, nan_empty
            )
        a = checked()
    else:  # the signature's plan and its bound call; the full validation when they do not take it
        objs = _plan.spec_objects(v, s, out, out_lse, sinks, out_scale, empty_shards, send)
        key, a = _plan.find(
            f, N, rank, scatter, exchange, lse_base, wire_dtype, send, nan_empty, return_lse, objs
        )
        if a is None:
            a = checked()
            _plan.learn(key, a, objs, N)
    if out is None:
        out = torch.empty((a.T, a.Hn, a.D), dtype=getattr(torch, a.out_dtype), device=v.device)
    if out_lse is None and return_lse:
        out_lse = torch.empty((a.T, a.Hn), dtype=torch.float32, device=v.device)
    if a.T * a.H:
        if a.exchange == "a2a":
            a2a.run(torch, pg, N, rank, collectives, a, out, out_lse, sinks, out_scale, nan_empty)
        else:
            allgather.run(torch, pg, N, rank, collectives, a, v, s, out, out_lse, nan_empty)
    return (out, out_lse) if return_lse else out


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


@functools.cache
def _collectives(torch: Any) -> tuple[Any, Any, Any, Any]:
    """all-gather into one tensor, reduce-scatter from one tensor (their names moved in torch
    2.13), all-reduce and all-to-all of equal chunks, each ``(..., group=)``."""
    dist = torch.distributed
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return ag, rs, dist.all_reduce, dist.all_to_all_single
