"""Tensors of any producer in torch's spelling, for the Python executor's reads of a bound call.

A torch tensor is read as it is; any other DLPack producer once through
:func:`zerokv.core.tensors.view` into a small record with the same methods the reads call.
"""

from __future__ import annotations

import sys
from typing import Any

from .tensors import _NoTorch, is_torch, torch_tensor_type, view


class _Generic:
    """One tensor of any producer, read through ``view``: what the readers take from it."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "obj", "is_torch")

    def __init__(self, x: Any) -> None:
        t = view(x, "tensor")
        self.ptr, self.shape, self.strides, self.dtype, self.device, self.obj, self.is_torch = (
            t.ptr, tuple(t.shape), tuple(t.strides), t.dtype, t.device, x, t.is_torch,
        )  # fmt: skip

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple:
        return self.strides

    def get_device(self) -> int:
        return self.device


def generic(x: Any) -> Any:
    """``x`` itself for a torch tensor (or None), else its facts in torch's spelling."""
    if x is None or type(x) is torch_tensor_type():
        return x
    return _Generic(x)


def also_read(tt: type) -> type:
    """The type whose subclasses a bound call of tensor type ``tt`` reads as it reads ``tt``:
    for torch's, ``torch.nn.Parameter`` (a plain tensor's memory and attributes: a module's
    weights, an attention sink, an engine's own parameter classes); for any other, a type no
    object has. By type, not ``isinstance``: a tensor subclass merely marked as a parameter is
    not read so."""
    p = _PARAMETER or _parameter()  # cp_merge asks on every call: found once
    return p[1] if p and tt is p[0] else _NoTorch


_PARAMETER: list = []  # [torch.Tensor, torch.nn.Parameter] once torch is imported


def _parameter() -> list:
    torch = sys.modules.get("torch")
    if torch is not None:
        _PARAMETER[:] = [torch.Tensor, torch.nn.Parameter]
    return _PARAMETER


def writable_cheap(x: Any) -> bool:
    """An output (the caller's object) that the full check (``checks.writable``) would let
    through, decided from the object alone: a torch tensor that needs no grad and is no
    inference tensor outside inference mode; a CUDA array of another producer that is not a
    JAX array. False: the full check decides (a torch subclass, say)."""
    if type(x) is torch_tensor_type():  # inference tensors: the engines' outputs under inference_mode()
        return not x.requires_grad and (
            not x.is_inference() or sys.modules["torch"].is_inference_mode_enabled()
        )
    return not is_torch(x) and type(x).__module__.split(".", 1)[0] not in ("jax", "jaxlib")
