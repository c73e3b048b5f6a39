"""Host-side input validation shared by every op: nothing here touches device memory.

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape,
layout, device, value, or memory shared where it must not be) naming the argument and the
offending value. Overlap is decided from pointers, shapes and strides alone.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from . import dtypes as _dtypes
from .layout import extent
from .tensors import Tensor, view

_TooHard = getattr(np, "exceptions", np).TooHardError
_OVERLAP_WORK = 4096  # candidate solutions numpy may try before calling an overlap "too hard"


def tensor(x: Any, arg: str, ndim: int, dtypes: tuple[str, ...]) -> Tensor:
    """``x`` (a :class:`Tensor` record or any tensor) with ``ndim`` dimensions and a dtype among
    ``dtypes``."""
    if x is None:
        raise TypeError(f"{arg}: expected a tensor, got None")
    t = x if isinstance(x, Tensor) else view(x, arg)
    if len(t.shape) != ndim:
        raise ValueError(f"{arg}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    _dtypes.require(arg, t.dtype, dtypes)
    return t


def same_device(named: list[tuple[str, Tensor]]) -> int:
    """All tensors on one device (or all on the host); returns it."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {where(t.device)} but {first_name} is on {where(first.device)}; "
                "all tensors of a call must be on the same device"
            )
    return first.device


def one_library_on_gpu(named: list[tuple[str, Tensor | None]]) -> None:
    """On a GPU every tensor of a call comes from one library: a call launches on the current
    stream of its tensors' library (torch's or CuPy's), so torch tensors beside CuPy arrays
    would be read on a stream their producer does not order. TypeError naming two of them. (On
    the CPU any mix works: zerokv allocates outputs like the call's first tensor.)"""
    present = [(arg, t) for arg, t in named if t is not None]
    if not any(t.device >= 0 for _, t in present):
        return
    torch_arg = next((arg for arg, t in present if t.is_torch), None)
    other = next(((arg, t) for arg, t in present if not t.is_torch), None)
    if torch_arg and other:
        kind = type(other[1].obj).__module__.split(".")[0]
        raise TypeError(
            f"{torch_arg} is a torch tensor but {other[0]} is a {kind} array; on a GPU pass every tensor "
            "of a call from one library (torch.as_tensor / cupy.asarray convert zero-copy)"
        )


def where(device: int) -> str:
    return "the CPU" if device < 0 else f"cuda:{device}"


def contiguous_1d(t: Tensor, arg: str) -> None:
    if t.shape[0] > 1 and t.strides[0] != 1:
        raise ValueError(f"{arg}: must be contiguous, got stride {t.strides[0]}")


_LOG2E = 1.4426950408889634
# lse_base's answer -> (k, 1 / k): the kernels take base^x as exp2(x * k)
LSE_BASES = {"e": (_LOG2E, 1.0 / _LOG2E), "2": (1.0, 1.0)}


# --- memory overlap ---------------------------------------------------------------------------

# element sizes of every dtype a Tensor record can carry (the ops' table plus what a caller
# may hand in by mistake); an unknown name counts as 8 bytes, the widest, so that no overlap
# is missed.
_ITEMSIZE = _dtypes.ITEMSIZE | {"float64": 8}


def itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        try:
            size = np.dtype(dtype.removeprefix("numpy.")).itemsize
        except TypeError:
            size = 8
    return size


def overlap(a: Tensor, b: Tensor) -> str:
    """How two tensors share memory: ``"none"``, ``"alias"`` (the same view: pointer, shape,
    strides and dtype) or ``"partial"`` (any other sharing of a byte). Disjoint byte ranges
    are decided by arithmetic; intersecting ranges (interleaved halves of one buffer, say)
    exactly, by numpy's bounded solver on arrays placed at those addresses (no memory is
    read); an overlap too hard to decide counts as ``"partial"``."""
    if a.device != b.device or not a.numel or not b.numel:
        return "none"
    if a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape and a.dtype == b.dtype:
        return "alias"
    size_a, size_b = itemsize(a.dtype), itemsize(b.dtype)
    lo_a, hi_a = extent(a.ptr, a.shape, a.strides, size_a)
    lo_b, hi_b = extent(b.ptr, b.shape, b.strides, size_b)
    if hi_a <= lo_b or hi_b <= lo_a:
        return "none"
    try:
        shared = np.shares_memory(
            np.asarray(_At(a, size_a)), np.asarray(_At(b, size_b)), max_work=_OVERLAP_WORK
        )
    except _TooHard:
        shared = True
    return "partial" if shared else "none"


class _At:
    """An object exposing the array interface of a tensor at its own address: numpy builds an
    array over it without reading (or owning) a byte."""

    __slots__ = ("__array_interface__",)

    def __init__(self, t: Tensor, size: int) -> None:
        self.__array_interface__ = {
            "data": (t.ptr, False),
            "shape": tuple(t.shape),
            "strides": tuple(s * size for s in t.strides),
            "typestr": f"|V{size}",
            "version": 3,
        }


def check_outputs(
    outs: Mapping[str, Tensor | None],
    ins: Mapping[str, Tensor | None],
    *,
    may_alias: Collection[tuple[str, str]] = (),
    names: Mapping[str, str] | None = None,
) -> None:
    """Refuse outputs that share memory with inputs or with each other.

    Args:
        outs: the tensors a call writes, by argument name (``None`` entries: not given).
        ins: the tensors a call reads, by argument name (``None`` entries: not given).
        may_alias: ``(out_name, in_name)`` pairs where the output may be *exactly* the input
            (same pointer, shape, strides, dtype): in-place use, safe because each element is
            read before it is written by the same thread.
        names: argument name -> the name the caller knows it by, for the messages.

    Raises ``ValueError`` naming both arguments for any partial overlap of an output with an
    input, an exact alias not in ``may_alias``, and any sharing between two outputs. Pure
    arithmetic on pointers, shapes and strides (each tensor's byte range once, then pairs of
    ranges); only ranges that intersect go to the exact test. Nothing is read.
    """
    names = names or {}
    o_spans = _spans(outs)
    i_spans = _spans(ins)
    for n, (k_out, o, lo, hi) in enumerate(o_spans):
        for k_in, t, lo_t, hi_t in i_spans:
            if hi <= lo_t or hi_t <= lo or o.device != t.device:
                continue
            kind = overlap(o, t)
            if kind == "none" or (kind == "alias" and (k_out, k_in) in may_alias):
                continue
            a, b = names.get(k_out, k_out), names.get(k_in, k_in)
            if kind == "alias":
                raise ValueError(f"{a} is the same memory as the input {b}; this call cannot write in place")
            raise ValueError(
                f"{a} overlaps the input {b} without being the same view of it "
                f"({_layout(o)} vs {_layout(t)}); in-place use needs the identical tensor"
            )
        for k_other, other, lo_t, hi_t in o_spans[n + 1 :]:
            if hi <= lo_t or hi_t <= lo or o.device != other.device:
                continue
            if overlap(o, other) != "none":
                a, b = names.get(k_out, k_out), names.get(k_other, k_other)
                raise ValueError(f"{a} and {b} share memory; two outputs must not overlap")


def _spans(tensors: Mapping[str, Tensor | None]) -> list[tuple[str, Tensor, int, int]]:
    """(name, tensor, lo, hi) of every given tensor that covers at least one byte."""
    spans = []
    for k, t in tensors.items():
        if t is None or 0 in t.shape:
            continue
        lo, hi = extent(t.ptr, t.shape, t.strides, _ITEMSIZE.get(t.dtype) or itemsize(t.dtype))
        spans.append((k, t, lo, hi))
    return spans


def _layout(t: Tensor) -> str:
    return f"pointer {t.ptr:#x}, shape {tuple(t.shape)}, strides {tuple(t.strides)}, {t.dtype}"


# --- outputs that cannot be written -------------------------------------------------------------


def writable(t: Tensor, arg: str) -> None:
    """Refuse, before anything is written, an output the call could not (or must not) write:
    a read-only numpy array or immutable JAX array, a torch tensor that requires grad (the
    kernels write without recording a gradient), an inference tensor outside inference mode,
    and a tensor whose elements share addresses (a stride-0 dimension, as ``expand`` makes)."""
    x = t.obj
    if t.is_torch:
        if x.requires_grad:
            raise ValueError(
                f"{arg}: requires grad; zerokv writes its outputs without recording a gradient "
                "(pass a tensor that does not require grad, e.g. under torch.no_grad())"
            )
        if x.is_inference() and not sys.modules["torch"].is_inference_mode_enabled():
            raise ValueError(
                f"{arg}: is an inference tensor, which cannot be written outside torch.inference_mode()"
            )
    elif isinstance(x, np.ndarray):
        if not x.flags.writeable:
            raise ValueError(f"{arg}: the numpy array is read-only")
    elif type(x).__module__.split(".", 1)[0] in ("jax", "jaxlib"):
        raise TypeError(f"{arg}: JAX arrays are immutable and cannot be an output")
    _no_shared_elements(t, arg)


def _no_shared_elements(t: Tensor, arg: str) -> None:
    """Each element of an output at its own address: no stride 0 over a dimension longer than
    one, and (conservatively) no dimension stepping inside the span of the finer ones. A
    zero-size output has no element (numpy 2 gives it strides of 0): nothing to check."""
    if 0 in t.shape:
        return
    for d, (n, s) in enumerate(zip(t.shape, t.strides, strict=True)):
        if n > 1 and s == 0:
            raise ValueError(
                f"{arg}: dimension {d} has stride 0 over {n} elements (an expanded view); "
                "an output needs an address per element"
            )
    dims = sorted((abs(s), n) for n, s in zip(t.shape, t.strides, strict=True) if n > 1)
    span = 0  # reach of the finer dimensions, in elements
    for s, n in dims:
        if s <= span:
            raise ValueError(
                f"{arg}: strides {tuple(t.strides)} for shape {tuple(t.shape)} make elements share "
                "addresses; an output needs an address per element"
            )
        span += (n - 1) * s
