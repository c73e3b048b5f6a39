"""Outputs an op allocates: uninitialised, like the call's first tensor (producer family,
device), on the host or the GPU."""

from __future__ import annotations

import sys
from typing import Any

from . import dtypes as _dtypes


def new(like: Any, is_torch: bool, device: int, shape: tuple[int, ...], dtype: str) -> Any:
    """An uninitialised tensor of ``like``'s family (torch when ``is_torch``, else numpy on
    the host, CuPy on a GPU) on ``device`` (-1: the host)."""
    if is_torch:
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype), device="cpu" if device < 0 else device)
    if device < 0:
        import numpy as np

        return np.empty(shape, dtype=_numpy_dtype(dtype))
    import cupy

    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=_numpy_dtype(dtype))


def _numpy_dtype(name: str) -> Any:
    if _dtypes.TABLE[name].numpy == "ml_dtypes":  # no numpy type of its own
        import ml_dtypes

        return getattr(ml_dtypes, name)
    import numpy as np

    return np.dtype(name)
