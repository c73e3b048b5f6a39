"""Host-memory helpers: the CPU path (through the float64 reference) and output allocation."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._tensors import Tensor


def to_f64(t: Tensor) -> np.ndarray:
    """A float64 (or int64 for indices) numpy copy of a host tensor."""
    x = t.obj
    if t.is_torch:
        torch = sys.modules["torch"]
        wide = torch.float64 if x.is_floating_point() else torch.int64
        return x.detach().to(wide).numpy()
    a = x if isinstance(x, np.ndarray) else np.from_dlpack(x)
    return a.astype(np.float64 if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else np.int64)


def write(t: Tensor, value: np.ndarray, rows: np.ndarray | None = None) -> None:
    """Store ``value`` into host tensor ``t`` (casting), only at ``rows`` when given."""
    x = t.obj
    if t.is_torch:
        torch = sys.modules["torch"]
        src = torch.from_numpy(np.ascontiguousarray(value))
        if rows is None:
            x.copy_(src)
        else:
            idx = torch.from_numpy(np.flatnonzero(rows))
            x[idx] = src[idx].to(x.dtype)
        return
    a = x if isinstance(x, np.ndarray) else np.from_dlpack(x)
    if rows is None:
        a[...] = value.astype(a.dtype)
    else:
        a[rows] = value[rows].astype(a.dtype)


def new(like: Tensor, shape: tuple[int, ...], dtype: str) -> Any:
    """An uninitialised tensor of the same producer family and device as ``like``."""
    if like.is_torch:
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.obj.device)
    if like.device < 0:
        return np.empty(shape, dtype=_numpy_dtype(dtype))
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.empty(shape, dtype=_numpy_dtype(dtype))


def _numpy_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if name == "float8_e4m3fn":
        import ml_dtypes

        return ml_dtypes.float8_e4m3fn
    return np.dtype(name)
