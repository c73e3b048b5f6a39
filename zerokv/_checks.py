"""Host-side input validation shared by every op: nothing here touches device memory.

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape,
layout, device, value) naming the argument and the offending value.
"""

from __future__ import annotations

from typing import Any

from . import _dtypes
from ._tensors import Tensor, view


def tensor(x: Any, arg: str, ndim: int, dtypes: tuple[str, ...]) -> Tensor:
    if x is None:
        raise TypeError(f"{arg}: expected a tensor, got None")
    t = view(x, arg)
    if len(t.shape) != ndim:
        raise ValueError(f"{arg}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    _dtypes.require(arg, t.dtype, dtypes)
    return t


def shape(t: Tensor, arg: str, expected: tuple[int, ...], names: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{arg}: expected shape {tuple(expected)} ({names}), got {tuple(t.shape)}")


def unit_last_stride(t: Tensor, arg: str) -> None:
    """V tensors need contiguous head_dim; token and head strides are free."""
    if t.shape[-1] > 1 and t.strides[-1] != 1:
        raise ValueError(
            f"{arg}: the last (head_dim) dimension must have stride 1, got strides {tuple(t.strides)}"
        )


def same_device(named: list[tuple[str, Tensor]]) -> int:
    """All tensors on one device (or all on the host); returns it."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {_where(t.device)} but {first_name} is on {_where(first.device)}; "
                "all tensors of a call must be on the same device"
            )
    return first.device


def _where(device: int) -> str:
    return "the CPU" if device < 0 else f"cuda:{device}"


def index_tensor(x: Any, arg: str, length: int | None, device: int) -> Tensor:
    """A 1-D int32/int64 offsets or lengths tensor of the given length."""
    t = tensor(x, arg, 1, _dtypes.INDEX_NAMES)
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{arg}: expected {length} entries, got shape {tuple(t.shape)}")
    if t.numel > 1 and t.strides[0] != 1:
        raise ValueError(f"{arg}: must be contiguous, got stride {t.strides[0]}")
    if t.device != device:
        raise ValueError(f"{arg} is on {_where(t.device)} but the tensors are on {_where(device)}")
    return t


def lse_base(value: Any) -> str:
    """'e' (natural log) or '2' (base-2 LSE, as FlashInfer / trtllm-gen produce)."""
    if value in ("e", "E"):
        return "e"
    if value in (2, "2", 2.0):
        return "2"
    raise ValueError(f"lse_base: expected 'e' or 2, got {value!r}")


def same_memory_same_layout(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    """In-place is supported when the alias is exact; any other overlap would race."""
    if a.ptr == b.ptr and a.numel and (a.strides != b.strides or a.dtype != b.dtype):
        raise ValueError(
            f"{a_name} and {b_name} share memory with different layouts "
            f"(strides {a.strides} vs {b.strides}, dtypes {a.dtype} vs {b.dtype}); "
            "in-place use requires the same layout"
        )


def out_scale(x: Any, out_dtype: str, device: int) -> Tensor | None:
    """The fp8 output scale: one float32 element on the states' device, given exactly when the
    output is float8_e4m3fn."""
    if out_dtype in _dtypes.FP8 and x is None:
        raise ValueError(f"out_scale: required for a {out_dtype} output")
    if x is None:
        return None
    if out_dtype not in _dtypes.FP8:
        raise ValueError(f"out_scale: only meaningful with a float8_e4m3fn output, got {out_dtype}")
    t = view(x, "out_scale")
    _dtypes.require("out_scale", t.dtype, _dtypes.LSE)
    if t.numel != 1:
        raise ValueError(f"out_scale: expected one element, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"out_scale is on {_where(t.device)} but the states are on {_where(device)}")
    return t
