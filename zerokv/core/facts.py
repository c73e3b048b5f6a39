"""The facts of one call: each tensor's pointer, shape, strides, dtype and device, read once.

torch tensors are read directly (no ``__dlpack__``: no per-call stream handshake); any other
producer through :func:`zerokv.core.tensors.view`. Nothing here validates with messages: an
argument that is not a tensor, or tensors on several devices, only mark the call so that the
op's full validation (which names the argument) runs and raises.
"""

from __future__ import annotations

from typing import Any

from . import cpu_path as _host
from . import runtime as _runtime
from .checks import extent
from .tensors import Tensor, torch_dtype_names, torch_tensor_type, view  # noqa: F401

_BAD = (0, (), ())  # facts of an argument that is not a tensor


def read(x: Any) -> tuple:
    """``(ptr, shape, strides)`` of a tensor (strides in elements)."""
    if type(x) is torch_tensor_type():
        return x.data_ptr(), x.shape, x.stride()
    t = view(x, "tensor")
    return t.ptr, t.shape, t.strides


class Call:
    """One call's tensors as facts. ``objs``: the caller's objects (``None`` allowed);
    ``scalars``: the call's other signature parts (base, flags). ``device``: the first
    tensor's device (-1: host memory)."""

    __slots__ = (
        "op",
        "objs",
        "facts",
        "dtypes",
        "device",
        "is_torch",
        "mixed",
        "scalars",
        "aligned",
        "widest",
    )

    def __init__(self, op: str, objs: tuple, scalars: tuple) -> None:
        self.op = op
        self.objs = objs
        self.scalars = scalars
        try:  # torch tensors (and None): read directly
            names = torch_dtype_names()
            self.facts = [None if x is None else (x.data_ptr(), x.shape, x.stride()) for x in objs]
            self.dtypes = [None if x is None else names[x.dtype] for x in objs]
            devices = {x.get_device() for x in objs if x is not None}
            self.is_torch = True
        except (AttributeError, KeyError, TypeError):  # any other producer, or not a tensor
            devices = self._read_any(objs)
        self.widest = None  # set by disjoint_outputs
        self.mixed = len(devices) > 1
        self.device = min(devices) if devices else -1

    def _read_any(self, objs: tuple) -> set:
        facts: list = []
        dtypes: list = []
        devices = set()
        is_torch = True
        for x in objs:
            if x is None:
                facts.append(None)
                dtypes.append(None)
                continue
            try:
                t = view(x, "tensor")
            except TypeError:
                facts.append(_BAD)
                dtypes.append("not a tensor")
                is_torch = False
                continue
            is_torch = is_torch and t.is_torch
            facts.append((t.ptr, t.shape, t.strides))
            dtypes.append(t.dtype)
            devices.add(t.device)
        self.facts, self.dtypes, self.is_torch = facts, dtypes, is_torch
        return devices

    def key(self, aligned: bool) -> tuple:
        """The call's signature: op, scalars, dtypes, device, producer family, layout facts."""
        self.aligned = aligned
        return (self.op, self.scalars, *self.dtypes, self.device, self.is_torch, self.mixed, aligned)

    def views(self, names: tuple[str, ...], shown: tuple[str, ...] | None = None) -> dict[str, Tensor | None]:
        """Full records of every argument by name (the validation path); ``view`` raises a
        ``TypeError`` naming the argument (as ``shown``, the caller's names) for anything that
        is not a tensor. Arguments past the call's objects are None."""
        shown = shown or names
        objs = self.objs + (None,) * (len(names) - len(self.objs))
        return {n: (None if x is None else view(x, s)) for n, s, x in zip(names, shown, objs, strict=True)}

    def stream(self) -> int:
        """The producer's current stream on the call's device."""
        if self.is_torch:
            return _runtime.torch_stream(self.device)
        return _runtime.cupy_stream(self.device)

    def new(self, shape: tuple[int, ...], dtype: str) -> Any:
        """An uninitialised output like the first tensor (same producer family and device)."""
        first = next(x for x in self.objs if x is not None)
        like = Tensor(first, 0, (), (), dtype, self.device, self.is_torch)
        return _host.new(like, shape, dtype)

    def writable(self, outputs: tuple[int, ...]) -> bool:
        """Whether the outputs at these positions may be written without the full check: torch
        tensors that neither require grad nor are inference tensors; other producers always take
        the full check (``zerokv.core.checks.writable``)."""
        for i in outputs:
            x = self.objs[i] if i < len(self.objs) else None
            if x is None:
                continue
            if not self.is_torch or x.requires_grad or x.is_inference():
                return False
        return True

    def disjoint_outputs(self, itemsizes: list, outs: tuple) -> bool:
        """True when every output shares no byte with any other tensor of the call, except an
        exact alias (same pointer, shape, strides, dtype) of an input it may alias. False sends
        the call to the full check, which decides exactly (and raises when they overlap)."""
        facts, dtypes = self.facts, self.dtypes
        spans = {}
        widest = 0
        for i, f in enumerate(facts):
            if f is not None:
                size = itemsizes[i] or 1
                spans[i] = s = extent(f[0], f[1], f[2], size)
                widest = max(widest, (s[1] - s[0]) // size)
        self.widest = widest  # elements spanned by the widest tensor: bounds any element offset in it
        for o, may_alias in outs:
            so = spans.get(o)
            if so is None:
                continue
            lo, hi = so
            fo = facts[o]
            for i, s in spans.items():
                if i == o or s[1] <= lo or hi <= s[0]:
                    continue
                if i in may_alias and facts[i] == fo and dtypes[i] == dtypes[o]:
                    continue
                return False
        return True
