"""A ``cp_merge`` call read and checked on the host: every check before anything is allocated,
sent or written, with the caller's names for the arguments. On the GPU it runs on a signature's
first call and where the plan's cheap check cannot decide (:mod:`.plan`); on the CPU on
every call."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..core import checks as _checks
from ..core import dtypes as _dtypes
from ..core.layout import INT32
from ..core.tensors import Tensor, view
from .send_buffer import CpSendBuffer

SCATTERS = ("heads", "none")
EXCHANGES = ("allgather", "a2a")


class Names:
    """How the caller calls the arguments (the engine adapters), for error messages."""

    def __init__(self, names: dict[str, str] | None) -> None:
        self.names = names or {}

    def __call__(self, arg: str) -> str:
        return self.names.get(arg, arg)


class Args(NamedTuple):
    """A validated call. ``v``/``s``: this rank's state (``[T, H, D]`` / ``[T, H]``), or the
    send buffer's views (``[N, T, H/N, D]`` / ``[N, T, H/N]``) when ``send`` is given."""

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
    scatter: str
    exchange: str
    send: Any  # a CpSendBuffer, or None


def view_of(torch: Any, x: Any, arg: str) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch tensor, got {type(x).__name__}")
    return view(x, arg)


def dtype_name(torch: Any, x: Any, arg: str) -> str:
    if isinstance(x, str):
        name = x.removeprefix("torch.")
    elif isinstance(x, torch.dtype):
        name = str(x).removeprefix("torch.")
    else:
        raise TypeError(f"{arg}: expected a torch dtype or its name, got {type(x).__name__}")
    _dtypes.require(arg, name, _dtypes.V_IN)
    return name


def _state(torch, v, s, N, send, n) -> tuple[Tensor, Tensor, int, int, int]:
    """This rank's state, or the send buffer's views: (v, s, T, H, D)."""
    if send is None:
        vt = _checks.tensor(view_of(torch, v, n("v")), n("v"), 3, _dtypes.V_IN)
        T, H, D = vt.shape
        if vt.numel:  # a zero-size tensor's strides mean nothing
            _checks.unit_last_stride(vt, n("v"))
        st = _checks.tensor(view_of(torch, s, n("s")), n("s"), 2, _dtypes.LSE)
        _checks.shape(st, n("s"), (T, H), "T, H")
        return vt, st, T, H, D
    lay = send.layout
    if lay.N != N:
        raise ValueError(f"send: made for a group of {lay.N} ranks, this group has {N}")
    for arg, x, mine in ((n("v"), v, send.v), (n("s"), s, send.lse)):
        if not isinstance(x, torch.Tensor) or not _same_view(x, mine):
            raise ValueError(f"{arg}: with send=, pass the views cp_send_buffer returned (send.v, send.lse)")
    return view(send.v, n("v")), view(send.lse, n("s")), lay.T, lay.N * lay.Hn, lay.D


def _same_view(x: Any, y: Any) -> bool:
    return (
        x.data_ptr() == y.data_ptr()
        and x.shape == y.shape
        and x.stride() == y.stride()
        and x.dtype == y.dtype
        and x.device == y.device
    )


def validate(
    torch,
    v,
    s,
    N,
    scatter,
    exchange,
    lse_base,
    wire_dtype,
    sinks,
    out,
    out_lse,
    out_scale,
    empty_shards,
    send,
    n,
) -> Args:
    """Every check of a call, on the host, before anything is allocated or written."""
    if exchange not in EXCHANGES:
        raise ValueError(f"{n('exchange')}: expected 'allgather' or 'a2a', got {exchange!r}")
    if scatter not in SCATTERS:
        raise ValueError(f"{n('scatter')}: expected 'heads' or 'none', got {scatter!r}")
    if exchange == "a2a" and scatter != "heads":
        raise ValueError(
            f"{n('exchange')}: 'a2a' sends each rank its own heads and needs scatter='heads', got "
            f"scatter={scatter!r} (use exchange='allgather' for an all-reduce)"
        )
    if send is not None:
        if not isinstance(send, CpSendBuffer):
            raise TypeError(f"send: expected what cp_send_buffer returned, got {type(send).__name__}")
        if exchange != "a2a":
            raise ValueError(f"send: a send buffer is for exchange='a2a', got exchange={exchange!r}")
    vt, st, T, H, D = _state(torch, v, s, N, send, n)
    if T >= INT32 or H >= INT32:
        raise ValueError(f"{n('v')}: T and H must be below 2^31, got shape {(T, H, D)}")
    if scatter == "heads" and H % N:
        raise ValueError(
            f"{n('v')}: {H} heads cannot be scattered over {N} ranks (H % N = {H % N}); "
            "use scatter='none' or a head count divisible by the group size"
        )
    Hn = H // N if scatter == "heads" else H
    base = _checks.lse_base(lse_base, n("lse_base"))
    if send is not None:
        wire = send.layout.wire
        if wire_dtype is not None and dtype_name(torch, wire_dtype, n("wire_dtype")) != wire:
            raise ValueError(f"{n('wire_dtype')}: the send buffer carries {wire}, got {wire_dtype}")
    elif wire_dtype is None:  # the all-to-all sends V as it is; the sums run in float32
        wire = vt.dtype if exchange == "a2a" else "float32"
    else:
        wire = dtype_name(torch, wire_dtype, n("wire_dtype"))
    named = [(n("v"), vt), (n("s"), st)]
    o = ol = None
    if out is not None:
        o = _checks.tensor(view_of(torch, out, n("out")), n("out"), 3, _dtypes.V_OUT)
        _checks.shape(o, n("out"), (T, Hn, D), "T, heads of this rank, D")
        if o.numel:
            _checks.unit_last_stride(o, n("out"))
        named.append((n("out"), o))
    if out_lse is not None:
        ol = _checks.tensor(view_of(torch, out_lse, n("out_lse")), n("out_lse"), 2, _dtypes.LSE)
        _checks.shape(ol, n("out_lse"), (T, Hn), "T, heads of this rank")
        named.append((n("out_lse"), ol))
    device = _checks.same_device(named)
    out_dtype = o.dtype if o is not None else (vt.dtype if send is None else wire)
    sk = None if sinks is None else _checks.sinks(view_of(torch, sinks, n("sinks")), n("sinks"), H, device)
    scale = None if out_scale is None else view_of(torch, out_scale, n("out_scale"))
    scale = _checks.out_scale(scale, out_dtype, device, n("out_scale"))
    sl = q = None
    if empty_shards is not None:
        if send is not None:
            raise ValueError(f"{n('seq_lens')}: the empty-shard mask is applied by the pack; not with send=")
        sl_arg, q_arg = n("seq_lens"), n("query_start_loc")
        sl = _checks.index_tensor(view_of(torch, empty_shards[0], sl_arg), sl_arg, None, device)
        q = _checks.index_tensor(view_of(torch, empty_shards[1], q_arg), q_arg, sl.shape[0] + 1, device)
    ins = [(n("v"), vt), (n("s"), st)]
    ins += [(nm, x) for nm, x in ((n("sinks"), sk), (n("out_scale"), scale)) if x is not None]
    ins += [(nm, x) for nm, x in ((n("seq_lens"), sl), (n("query_start_loc"), q)) if x is not None]
    if send is not None:  # the outputs may not land in the buffer the peers write
        ins.append(("send (its send buffer)", view(send.send, "send")))
        if send.recv is not send.send:
            ins.append(("send (its receive buffer)", view(send.recv, "send")))
    _checks.outputs([(n("out"), o, ()), (n("out_lse"), ol, ())], ins)
    return Args(vt, st, sk, scale, sl, q, T, H, D, Hn, wire, out_dtype, base, device, scatter, exchange, send)
