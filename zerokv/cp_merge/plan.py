"""``cp_merge`` on the ops' one path: a call's tensors read once into facts, a plan per
signature, the plan's cheap check of what may change between calls, and the ``Args`` record
that ``allgather`` / ``a2a`` read, built from the facts.

The first call of a signature is fully validated (``args.validate``) and the plan is
built from its ``Args``; a later call whose cheap check fails or cannot decide is validated
again, which raises with the caller's argument names or lets the call through by the exact
rules. Host tensors never come here (``cpu_path`` validates every call).
"""

from __future__ import annotations

from typing import Any

from ..core import dtypes as _dtypes
from ..core import plans as _plans
from ..core.generic_tensors import writable_cheap
from ..core.layout import INT32, distinct
from ..core.tensors import Tensor, torch_tensor_type, torch_view
from .a2a import CpSendBuffer
from .args import Args

_new = tuple.__new__  # a NamedTuple without its Python-level __new__ (the hot path)
_UNREADABLE = (AttributeError, TypeError, ValueError, IndexError, RuntimeError)  # RuntimeError: sparse


class Facts:
    """A call's tensors as :class:`Tensor` records (None where not given; ``sl``, ``q``: the
    empty-shard pair) and its signature part: each given tensor's dtype and device."""

    __slots__ = ("v", "s", "sinks", "scale", "sl", "q", "out", "ol", "device", "sig")


def read(v, s, sinks, out, out_lse, out_scale, shards) -> Facts | None:
    """The facts of a call whose tensors are all plain torch tensors (read directly: no DLPack);
    None otherwise (a subclass, another producer, a sparse tensor: the full validation decides)."""
    tt = torch_tensor_type()
    if type(v) is not tt or type(s) is not tt:
        return None
    try:  # v, s, out, out_lse, then the rarer options
        f = Facts()
        f.v, f.s = tv, ts = torch_view(v), torch_view(s)
        sig = [tv.dtype, tv.device, ts.dtype, ts.device]
        f.out, f.ol = _record(out, tt, sig), _record(out_lse, tt, sig)
        if sinks is None and out_scale is None and shards is None:
            f.sinks = f.scale = f.sl = f.q = None
        else:
            sl, q = (None, None) if shards is None else (shards[0], shards[1])
            f.sinks, f.scale, f.sl, f.q = (_record(x, tt, sig) for x in (sinks, out_scale, sl, q))
    except _UNREADABLE:
        return None
    f.device = tv.device
    f.sig = tuple(sig)
    return f


def _record(x, tt: type, sig: list) -> Tensor | None:
    """The record of an optional tensor (None when not given), its dtype and device (or None)
    into ``sig``; TypeError when it is not a plain torch tensor (the full validation decides)."""
    if x is None:
        sig.append(None)
        return None
    if type(x) is not tt:
        raise TypeError("not a plain torch tensor")
    t = torch_view(x)
    sig += (t.dtype, t.device)
    return t


def find(f: Facts, N, rank, scatter, exchange, lse_base, wire_dtype, send, nan_empty, return_lse) -> tuple:
    """``(key, Args)``: the call's signature and, where its plan exists and the cheap check
    passes, its Args; ``(key, None)``: the full validation decides (then :func:`learn`)."""
    key = ("cp_merge call", N, rank, scatter, exchange, type(lse_base), lse_base, type(wire_dtype), wire_dtype,
           send is None, nan_empty, return_lse, f.sig)  # fmt: skip
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable argument (lse_base=np.array(2)): validated on every call
        return None, None
    return key, None if plan is None else plan.args(f, send, N)


def learn(key: Any, a: Args) -> None:
    """Remember the plan of a signature from a call the full validation accepted."""
    if key is not None:
        _plans.lookup(key, lambda: Plan(a))


class Plan:
    """What holds for every call of one signature: the validated constants of its ``Args`` and
    the element sizes its byte ranges need."""

    __slots__ = ("wire", "out_dtype", "base", "device", "scatter", "exchange", "heads", "v_size", "o_size",
                 "sl_size", "q_size")  # fmt: skip

    def __init__(self, a: Args) -> None:
        self.wire, self.out_dtype, self.base, self.device = a.wire, a.out_dtype, a.base, a.device
        self.scatter, self.exchange, self.heads = a.scatter, a.exchange, a.scatter == "heads"
        self.v_size, self.o_size = _dtypes.itemsize(a.v.dtype), _dtypes.itemsize(a.out_dtype)
        self.sl_size = 0 if a.seq_lens is None else _dtypes.itemsize(a.seq_lens.dtype)
        self.q_size = 0 if a.qsl is None else _dtypes.itemsize(a.qsl.dtype)

    def args(self, f: Facts, send: Any, N: int) -> Args | None:
        """The call's Args when the cheap check passes (validate's rules that may change between
        calls of the signature: shapes, unit head_dim strides, writable outputs apart from the
        inputs and from each other); None: the full validation decides."""
        tv, ts = f.v, f.s
        if send is None:
            _, pv, shape, vst, _, _, _ = tv
            if len(shape) != 3:
                return None
            T, H, D = shape
            if (D > 1 and vst[2] != 1) or ts.shape != (T, H):
                return None
            spans = []  # the inputs' byte ranges: layout.end written out (torch strides are >= 0)
            if T * H:
                ps, (s0, s1) = ts.ptr, ts.strides
                spans.append((ps, ps + ((T - 1) * s0 + (H - 1) * s1 + 1) * 4))
                if D:
                    spans.append((pv, pv + ((T - 1) * vst[0] + (H - 1) * vst[1] + D) * self.v_size))
        else:
            if type(send) is not CpSendBuffer:
                return None
            lay = send.layout
            sv, ss, send_spans = send.facts
            if lay.N != N or not (_same(tv, sv) and _same(ts, ss)):  # its wire: v's dtype, in the key
                return None
            tv, ts, T, H, D = sv, ss, lay.T, lay.N * lay.Hn, lay.D
            spans = list(send_spans)  # the send and receive buffers hold v and s
        if T >= INT32 or H >= INT32:
            return None
        if self.heads:
            if H % N:
                return None
            Hn = H // N
        else:
            Hn = H
        if (f.sinks or f.scale or f.sl) and not _options(f, H, spans, self.sl_size, self.q_size):
            return None
        if not _outputs(f, T, Hn, D, spans, self.o_size):
            return None
        return _new(Args, (tv, ts, f.sinks, f.scale, f.sl, f.q, T, H, D, Hn, self.wire, self.out_dtype, self.base,
                           self.device, self.scatter, self.exchange, send))  # fmt: skip


def _same(x: Tensor, y: Tensor) -> bool:
    """``x`` is the view ``y``: pointer, shape, strides, dtype and device (the record's fields 1-5)."""
    return x[1:6] == y[1:6]


def _options(f: Facts, H: int, spans: list, sl_size: int, q_size: int) -> bool:
    """sinks ``[H]`` contiguous, out_scale of one element, seq_lens ``[B]`` and query_start_loc
    ``[B + 1]`` contiguous; their byte ranges join ``spans``."""
    sk = f.sinks
    if sk is not None:
        if sk.shape != (H,) or (H > 1 and sk.strides[0] != 1):
            return False
        if H:
            spans.append((sk.ptr, sk.ptr + 4 * H))
    sc = f.scale
    if sc is not None:
        n = 1
        for d in sc.shape:
            n *= d
        if n != 1:
            return False
        spans.append((sc.ptr, sc.ptr + 4))
    sl, q = f.sl, f.q
    if sl is not None:
        if len(sl.shape) != 1 or len(q.shape) != 1:
            return False
        B = sl.shape[0]
        if q.shape[0] != B + 1 or (B > 1 and sl.strides[0] != 1) or (B > 0 and q.strides[0] != 1):
            return False
        if B:
            spans.append((sl.ptr, sl.ptr + B * sl_size))
        spans.append((q.ptr, q.ptr + (B + 1) * q_size))
    return True


def _outputs(f: Facts, T: int, Hn: int, D: int, spans: list, o_size: int) -> bool:
    """out ``[T, Hn, D]`` (unit head_dim stride) and out_lse ``[T, Hn]``: writable, each element
    at its own address, sharing no byte with an input or with each other."""
    o, ol = f.out, f.ol
    po = eo = 0
    if o is not None:
        x, po, shape, strides, _, _, _ = o
        if (x.requires_grad or x.is_inference()) and not writable_cheap(x):
            return False
        if shape != (T, Hn, D):
            return False
        st0, st1, st2 = strides
        if D > 1 and st2 != 1:
            return False
        if T * Hn * D:  # distinct's row-major case and layout.end, written out first
            if not ((Hn <= 1 or st1 >= D) and (T <= 1 or st0 >= (Hn - 1) * st1 + D)) and not distinct(
                T, st0, Hn, st1, D
            ):
                return False
            eo = po + ((T - 1) * st0 + (Hn - 1) * st1 + D) * o_size
            for lo, hi in spans:
                if lo < eo and po < hi:
                    return False
    if ol is not None:
        x, pl, shape, strides, _, _, _ = ol
        if (x.requires_grad or x.is_inference()) and not writable_cheap(x):
            return False
        if shape != (T, Hn):
            return False
        if T * Hn:
            st0, st1 = strides
            if not ((Hn <= 1 or st1 >= 1) and (T <= 1 or st0 >= (Hn - 1) * st1 + 1)) and not distinct(
                T, st0, Hn, st1, 1
            ):
                return False
            el = pl + ((T - 1) * st0 + (Hn - 1) * st1 + 1) * 4
            if pl < eo and po < el:
                return False
            for lo, hi in spans:
                if lo < el and pl < hi:
                    return False
    return True
