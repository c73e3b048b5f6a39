"""Reading a call's arguments once into a named record of facts, derived from its op's spec: a
signature's first call, and the calls its bound call (:mod:`zerokv.core.bound`) does not take.

The record holds every tensor's pointer and strides under the names its spec gives them among
the kernels' parameters (0 for an absent one), the symbols' sizes, and the call's signature
part: each argument's dtype and device (None when absent), the vector alignment of the
arguments that take part in it, and whether every tensor is torch's. torch tensors are read
directly (``data_ptr``/``shape``/``stride``: no ``__dlpack__``, no stream handshake); every
other producer through :func:`zerokv.core.tensors.view`. Nothing here validates: a reader that
meets anything unexpected returns None and the op's full validation names it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from . import layout as _layout
from .generic_tensors import _family, generic
from .spec import OpSpec

_ITEMSIZE = {}  # dtype (torch object or name) -> bytes, filled as dtypes are met
_UNREADABLE = (AttributeError, TypeError, ValueError, RuntimeError)  # RuntimeError: a sparse tensor


def _itemsize(dtype: Any) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        from .checks import itemsize

        size = _ITEMSIZE[dtype] = dtype.itemsize if hasattr(dtype, "itemsize") else itemsize(str(dtype))
    return size


@cache
def record(spec: OpSpec) -> type:
    """The record class of ``spec``'s calls: the kernels' parameter names of its arguments and
    options, its symbols, and what the op derives (``spec.derived``)."""
    names = ["objs", "sig", "torch", "device"]
    for a in spec.all_args():
        names += a.params
        names += (s.removesuffix("+1") for s in a.shape if s.removesuffix("+1").isidentifier())
    names += (p for o in spec.options for p in o.params)
    names += (p for p, _ in spec.sym_params)
    names += spec.derived
    return type(f"{spec.name}_facts", (), {"__slots__": tuple(dict.fromkeys(names))})


def read(spec: OpSpec, objs: tuple, lse_ht: bool = False) -> Any:
    """The facts of a call of ``spec`` (``objs`` in ``spec.all_args()`` order); None when an
    argument cannot be read. ``lse_ht``: the LSEs are ``[H, T]`` tensors, read as their
    ``[T, H]`` transposes (no view made)."""
    try:
        return _read(spec, objs, objs, True, lse_ht)  # torch tensors: any other object has no data_ptr
    except _UNREADABLE:
        try:
            gen = tuple(generic(x) for x in objs)
            return _read(spec, objs, gen, _family(gen), lse_ht)
        except _UNREADABLE:
            return None


def _read(spec: OpSpec, objs: tuple, xs: tuple, torch: bool | None, ht: bool) -> Any:
    """``xs``: the tensors (``objs`` or their generic facts); ``torch``: the producer part."""
    f = record(spec)()
    f.objs, f.torch = objs, torch is True
    sig: list = []
    ok, width, device = True, 0, None
    args = spec.all_args()
    for i, (a, x) in enumerate(zip(args, xs + (None,) * (len(args) - len(xs)), strict=True)):
        if x is None:
            if i < len(spec.args) and not a.optional:
                raise TypeError(a.name)  # the full validation names it
            sig.append(None)
            for p in a.params:
                setattr(f, p, 0)
            continue
        dtype, dev, ptr = x.dtype, x.get_device(), x.data_ptr()
        sig += (dtype, dev)
        device = dev if device is None else device
        shape, st = x.shape, x.stride()
        if a.lse and ht:
            shape, st = shape[::-1], st[::-1]
        setattr(f, a.params[0], ptr)
        for p, s in zip(a.params[1:], st, strict=False):
            setattr(f, p, s)
        for s, n in zip(a.shape, shape, strict=False):
            if s.isidentifier() and not hasattr(f, s):
                setattr(f, s, n)
            elif s.endswith("+1") and not hasattr(f, s[:-2]):
                setattr(f, s[:-2], n - 1)
        if a.vector:  # the pointer, outer strides and inner size on the signature's vector width
            size = _ITEMSIZE.get(dtype) or _itemsize(dtype)
            width = width or _layout.vec(size)
            outer = 0
            for s in st[:-1]:
                outer |= s
            ok = ok and _layout.aligned(ptr, size, width, outer | shape[-1])
    for p, s in spec.sym_params:
        setattr(f, p, getattr(f, s, 0))
    f.device = device
    f.sig = (*sig, ok, torch)
    return f
