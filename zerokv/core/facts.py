"""A validated call's facts as its kernels name them, derived from its op's spec: what a
signature's first call builds its plan from, and what a call its bound call
(:mod:`zerokv.core.bound`) does not take launches with.

The record holds every tensor's pointer and strides under the names its spec gives them among
the kernels' parameters (0 for an absent one), the symbols' sizes, and the call's signature:
each argument's dtype, device and type (None when absent), the vector alignment of the
arguments that take part in it, and the producer (True: every tensor torch's own type or a
``torch.nn.Parameter`` (or of a subclass); False: none torch's; None: torch beside another producer or another
torch subclass). Nothing is read here that the full validation
(:mod:`zerokv.core.validation`) has not read and checked.
"""

from __future__ import annotations

from typing import Any

from . import dtypes as _dtypes
from . import layout as _layout
from .generic_tensors import also_read
from .spec import OpSpec
from .tensors import torch_tensor_type


def record(spec: OpSpec) -> type:
    """The record class of ``spec``'s calls: the kernels' parameter names of its arguments and
    options, its symbols, and what the op derives (``spec.derived``)."""
    return spec.once("_facts_record", _record)


def _record(spec: OpSpec) -> type:
    names = ["objs", "sig", "torch", "device"]
    for a in spec.all_args():
        names += a.params
        names += (s.removesuffix("+1") for s in a.shape if s.removesuffix("+1").isidentifier())
    names += (p for o in spec.options for p in o.params)
    names += (p for p, _ in spec.sym_params)
    names += spec.derived
    names = tuple(dict.fromkeys(names))
    return type(f"{spec.name}_facts", (), {"__slots__": names, "SLOTS": frozenset(names)})


def of(spec: OpSpec, checked: Any, objs: tuple) -> Any:
    """The facts of a call of ``spec`` that the full validation accepted (``checked``, its
    :class:`~zerokv.core.validation.Checked`); ``objs``: the caller's objects, in
    ``spec.all_args()`` order (what its bound call is built from)."""
    f = record(spec)()
    slots = f.SLOTS
    f.objs, f.device = objs, checked.device
    sig: list = []
    ok, width, any_torch, all_exact = True, 0, False, True
    tt = torch_tensor_type()
    param = also_read(tt)  # its subclasses: read as torch's own type by the bound calls
    for a in spec.all_args():
        t = checked.tensors.get(a.name)
        if t is None:
            sig.append(None)
            for p in a.params:
                setattr(f, p, 0)
            continue
        sig += (t.dtype, t.device, type(t.obj))
        any_torch = any_torch or t.is_torch
        all_exact = all_exact and (type(t.obj) is tt or issubclass(type(t.obj), param))
        setattr(f, a.params[0], t.ptr)
        for p, s in zip(a.params[1:], t.strides, strict=False):
            setattr(f, p, s)
        if a.vector:  # the pointer, outer strides and inner size on the signature's vector width
            size = _dtypes.itemsize(t.dtype)
            width = width or _layout.vec(size)
            outer = 0
            for s in t.strides[:-1]:
                outer |= s
            ok = ok and _layout.aligned(t.ptr, size, width, outer | t.shape[-1])
    for s, n in checked.sym.items():
        if s in slots:
            setattr(f, s, n)
    for p, s in spec.sym_params:
        setattr(f, p, checked.sym.get(s, 0))
    torch = True if all_exact else None if any_torch else False
    f.torch = torch is True
    f.sig = (*sig, ok, torch)
    return f
