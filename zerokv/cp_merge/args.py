"""A ``cp_merge`` call read and checked on the host: every check before anything is allocated,
sent or written, with the caller's names for the arguments. On the GPU it runs on a signature's
first call and where the plan's bound call does not take the call (:mod:`.plan`); on the CPU on
every call."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..core import dtypes as _dtypes
from ..core import spec as _spec
from ..core import validation as _validation
from ..core.tensors import Tensor, torch_view, view
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


def dtype_name(torch: Any, x: Any, arg: str) -> str:
    if isinstance(x, str):
        name = x.removeprefix("torch.")
    elif isinstance(x, torch.dtype):
        name = str(x).removeprefix("torch.")
    else:
        raise TypeError(f"{arg}: expected a torch dtype or its name, got {type(x).__name__}")
    _dtypes.require(arg, name, _dtypes.V_IN)
    return name


def _send_views(torch, v, s, N, send, n) -> tuple:
    """With a send buffer: its views as the state (the caller passes them as v and s), its
    sizes and the memory the call reads beside its arguments."""
    lay = send.layout
    if lay.N != N:
        raise ValueError(f"send: made for a group of {lay.N} ranks, this group has {N}")
    for arg, x, mine in ((n("v"), v, send.v), (n("s"), s, send.lse)):
        if not isinstance(x, torch.Tensor) or torch_view(x)[1:6] != torch_view(mine)[1:6]:
            raise ValueError(f"{arg}: with send=, pass the views cp_send_buffer returned (send.v, send.lse)")
    also = [(n("v"), view(send.v, n("v"))), (n("s"), view(send.lse, n("s")))]
    also.append(("send (its send buffer)", view(send.send, "send")))  # no output may land where peers write
    if send.recv is not send.send:
        also.append(("send (its receive buffer)", view(send.recv, "send")))
    return {"T": lay.T, "H": lay.N * lay.Hn, "D": lay.D}, tuple(also)


_SCALARS = {x.name: x for x in _spec.CP_MERGE.scalars}


def validate(
    torch, v, s, N, scatter, exchange, lse_base, wire_dtype, sinks, out, out_lse, out_scale, empty_shards, send, n
) -> Args:  # fmt: skip
    """Every check of a call, on the host, before anything is allocated or written: the
    collective's rules here, the local part's from its spec (``spec.CP_MERGE``)."""
    for arg, value in (("exchange", exchange), ("scatter", scatter)):
        _validation.scalar(_SCALARS[arg], value, n(arg), {})
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
        if empty_shards is not None:
            raise ValueError(f"{n('seq_lens')}: the empty-shard mask is applied by the pack; not with send=")
    shards = (None, None) if empty_shards is None else (empty_shards[0], empty_shards[1])
    objs = (v, s, out, out_lse, sinks, out_scale, *shards)
    args = _spec.CP_MERGE.all_args()
    for i, (a, x) in enumerate(zip(args, objs, strict=True)):  # the collectives take torch tensors
        if (x is not None or i < 2 or (i >= 6 and empty_shards is not None)) and not isinstance(
            x, torch.Tensor
        ):
            raise TypeError(f"{n(a.name)}: expected a torch tensor, got {type(x).__name__}")
    sizes, also = None, ()
    if send is not None:
        sizes, also = _send_views(torch, v, s, N, send, n)
        objs = (None, None, *objs[2:])
    shown = {**n.names, "empty_shards[0]": n("seq_lens"), "empty_shards[1]": n("query_start_loc")}
    scalars = {
        "lse_base": lse_base,
        "exchange": exchange,
        "scatter": scatter,
        "ranks": N if scatter == "heads" else 1,
    }
    c = _validation.validate(_spec.CP_MERGE, objs, scalars, shown, sizes, also)
    T, H, D = c.sym["T"], c.sym["H"], c.sym["D"]
    if scatter == "heads" and H % N:
        raise ValueError(
            f"{n('v')}: {H} heads cannot be scattered over {N} ranks (H % N = {H % N}); "
            "use scatter='none' or a head count divisible by the group size"
        )
    t = c.tensors
    vt, st = (t["v"], t["s"]) if send is None else (also[0][1], also[1][1])
    if send is not None:
        wire = send.layout.wire
        if wire_dtype is not None and dtype_name(torch, wire_dtype, n("wire_dtype")) != wire:
            raise ValueError(f"{n('wire_dtype')}: the send buffer carries {wire}, got {wire_dtype}")
    elif wire_dtype is None:  # the all-to-all sends V as it is; the sums run in float32
        wire = vt.dtype if exchange == "a2a" else "float32"
    else:
        wire = dtype_name(torch, wire_dtype, n("wire_dtype"))
    o = t.get("out")
    out_dtype = o.dtype if o is not None else (vt.dtype if send is None else wire)
    return Args(
        vt, st, t.get("sinks"), t.get("out_scale"), t.get("seq_lens"), t.get("query_start_loc"), T, H, D,
        H // c.scalars["ranks"], wire, out_dtype, c.scalars["lse_base"], c.device, scatter, exchange, send,
    )  # fmt: skip
