"""``cp_merge`` on the ops' one path: a call's tensors read once into facts, a plan per
signature with its bound call (``spec.CP_MERGE``'s records, as the merges'; it launches
nothing), and the ``Args`` record that ``allgather`` / ``a2a`` read, built from the facts.

The first call of a signature is fully validated (``args.validate``) and the plan is built from
its ``Args`` and tensors; a later call that the bound call does not take (or, with a send
buffer, whose v and s are not its views or whose outputs lie in its memory: the collective's
own rules) is validated again, which raises with the caller's argument names or lets the call
through by the exact rules. Host tensors never come here (``cpu_path`` validates every call).
"""

from __future__ import annotations

from typing import Any

from ..core import binding as _binding
from ..core import bound as _bound
from ..core import dtypes as _dtypes
from ..core import executor as _executor
from ..core import layout as _layout
from ..core import plans as _plans
from ..core import spec as _spec
from ..core.generic_tensors import also_read
from ..core.layout import INT32
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
    """The facts of a call whose tensors are all plain torch tensors or module parameters (read
    directly: no DLPack); None otherwise (another subclass, another producer, a sparse tensor:
    the full validation decides)."""
    tt = torch_tensor_type()
    pt = also_read(tt)
    if (type(v) is not tt and not issubclass(type(v), pt)) or (
        type(s) is not tt and not issubclass(type(s), pt)
    ):
        return None
    try:  # v, s, out, out_lse, then the rarer options
        f = Facts()
        f.v, f.s = tv, ts = torch_view(v), torch_view(s)
        sig = [tv.dtype, tv.device, ts.dtype, ts.device]
        f.out, f.ol = _record(out, tt, pt, sig), _record(out_lse, tt, pt, sig)
        if sinks is None and out_scale is None and shards is None:
            f.sinks = f.scale = f.sl = f.q = None
        else:
            sl, q = (None, None) if shards is None else (shards[0], shards[1])
            f.sinks, f.scale, f.sl, f.q = (_record(x, tt, pt, sig) for x in (sinks, out_scale, sl, q))
    except _UNREADABLE:
        return None
    f.device = tv.device
    f.sig = tuple(sig)
    return f


def _record(x, tt: type, pt: type, sig: list) -> Tensor | None:
    """The record of an optional tensor (None when not given), its dtype and device (or None)
    into ``sig``; TypeError when it is not a plain torch tensor or a parameter (``pt``: the
    full validation decides)."""
    if x is None:
        sig.append(None)
        return None
    if type(x) is not tt and not issubclass(type(x), pt):
        raise TypeError("not a plain torch tensor")
    t = torch_view(x)
    sig += (t.dtype, t.device)
    return t


def find(f: Facts, N, rank, scatter, exchange, lse_base, wire_dtype, send, nan_empty, return_lse,
         objs: tuple) -> tuple:  # fmt: skip
    """``(key, Args)``: the call's signature and, where its plan exists and its bound call takes
    the call (``objs``: :func:`spec_objects`), its Args; ``(key, None)``: the full validation
    decides (then :func:`learn`)."""
    key = ("cp_merge call", N, rank, scatter, exchange, type(lse_base), lse_base, type(wire_dtype), wire_dtype,
           send is None, nan_empty, return_lse, f.sig)  # fmt: skip
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable argument (lse_base=np.array(2)): validated on every call
        return None, None
    return key, None if plan is None else plan.args(f, send, N, objs)


def spec_objects(v, s, out, out_lse, sinks, out_scale, shards, send) -> tuple:
    """The call's tensors in ``spec.CP_MERGE``'s argument order; with a send buffer v and s are
    its views, not arguments of the spec (the plan's sizes come from the buffer's layout)."""
    sl, q = (None, None) if shards is None else (shards[0], shards[1])
    if send is not None:
        v = s = None
    return v, s, out, out_lse, sinks, out_scale, sl, q


def learn(key: Any, a: Args, objs: tuple, N: int) -> None:
    """Remember the plan of a signature from a call the full validation accepted."""
    if key is not None:
        _plans.lookup(key, lambda: Plan(a, objs, N))


class Plan:
    """What holds for every call of one signature: its bound call (the spec's checks of the
    local part, run by the ops' executor; it launches nothing) and the validated constants of
    its ``Args``."""

    __slots__ = ("wire", "out_dtype", "base", "device", "scatter", "exchange", "heads", "o_size", "bound",
                 "torch", "tensor_type", "vec", "in_size", "stream")  # fmt: skip

    def __init__(self, a: Args, objs: tuple, N: int) -> None:
        self.wire, self.out_dtype, self.base, self.device = a.wire, a.out_dtype, a.base, a.device
        self.scatter, self.exchange, self.heads = a.scatter, a.exchange, a.scatter == "heads"
        self.o_size = _dtypes.itemsize(a.out_dtype)
        # what binding.Table reads of a plan: no argument of the spec is vector-aligned, so the
        # alignment register stays 0 (vec != 1)
        self.torch, self.vec, self.in_size, self.stream = True, 0, _dtypes.itemsize(a.v.dtype), None
        self.bound = _bind(self, a, objs, N)

    def args(self, f: Facts, send: Any, N: int, objs: tuple) -> Args | None:
        """The call's Args when the bound call takes it (and, with a send buffer, v and s are its
        views and no output lies in its memory); None: the full validation decides."""
        sizes = ()
        if send is not None:
            if type(send) is not CpSendBuffer:
                return None
            lay = send.layout
            sv, ss, spans = send.facts
            if lay.N != N or not (_same(f.v, sv) and _same(f.s, ss) and _apart_from(f, spans, self.o_size)):
                return None
            sizes = (lay.T, lay.N * lay.Hn, lay.D)
        if not _executor.run(self.bound, objs, sizes):
            return None
        if send is None:  # v's rank and sizes as the bound call took them
            tv, ts, (T, H, D) = f.v, f.s, f.v.shape
        else:
            tv, ts, (T, H, D) = sv, ss, sizes
        if self.heads and H % N:  # the collective's own rule (no output given says it)
            return None
        Hn = H // N if self.heads else H
        return _new(Args, (tv, ts, f.sinks, f.scale, f.sl, f.q, T, H, D, Hn, self.wire, self.out_dtype, self.base,
                           self.device, self.scatter, self.exchange, send))  # fmt: skip


def _bind(plan: Plan, a: Args, objs: tuple, N: int) -> _bound.BoundCall:
    """The bound call of a signature: the spec's records of its tensors (with a send buffer, the
    sizes of its layout as the call's scalars ``(T, H, D)``), T and H in 32 bits; done, with
    nothing to launch."""
    _binding.family(plan, objs)  # torch's tensor type: read() took plain torch tensors only
    B = _bound
    t = _binding.Table()
    if a.send is not None:  # v and s are the buffer's views: its sizes, scalars of each call
        hi = t.arith(B.A_ADD, B.R_ZERO, k=INT32 - 1)
        for i, sym in enumerate(("T", "H", "D")):
            t.sym[sym] = t.reg()
            t.add(B.OP_SCALAR, i, t.sym[sym], B.R_ZERO, hi)
    t.args(_spec.CP_MERGE, objs, plan, scalars={"ranks": N if plan.heads else 1})
    T, H = t.sym["T"], t.sym["H"]  # v's (required without a send buffer) or the buffer's
    t.add(B.OP_RANGE, T, 0, INT32)
    t.add(B.OP_RANGE, H, 0, INT32)
    t.add(B.OP_DONE_IF_ZERO, B.R_ZERO)  # every call it takes ends here: the key is never reached
    t.add(B.OP_KEY, T, 0)
    return t.bound("cp_merge", plan, len(objs), None)


def _same(x: Tensor, y: Tensor) -> bool:
    """``x`` is the view ``y``: pointer, shape, strides, dtype and device (the record's fields 1-5)."""
    return x[1:6] == y[1:6]


def _apart_from(f: Facts, spans: tuple, o_size: int) -> bool:
    """No output shares a byte with ``spans`` (a send buffer's memory, where peers write)."""
    for rec, size in ((f.out, o_size), (f.ol, 4)):
        if rec is not None:
            lo, hi = _layout.extent(rec.ptr, rec.shape, rec.strides, size)
            if not _layout.apart_all(lo, hi, spans):
                return False
    return True
