"""FlashInfer's signatures: ``merge_state``, ``merge_state_in_place``, ``merge_states``.

LSE ``[T, H]`` in **base 2**, as FlashInfer's attention kernels write it. As FlashInfer's Python
wrappers do (``flashinfer/cascade.py``), an LSE of another floating dtype (bfloat16, float16,
float64) is converted to float32 first (a copy), and ``merge_states`` of ``N = 0`` states gives
``V = 0``, ``S = -inf``. docs/adapters.md lists every difference from FlashInfer.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import merge as _merge
from ..core import merge_plans as _merge_plans
from ..core.tensors import TORCH_FLOAT32, torch_float32, view

_IN_PLACE_NAMES = {
    "v_a": "v",
    "s_a": "s",
    "v_b": "v_other",
    "s_b": "s_other",
    "out": "v",
    "out_lse": "s",
    "row_mask": "mask",
}
_CONVERTED = ("float16", "bfloat16", "float64")


def _float32_lse(s: Any, arg: str) -> Any:
    """``s`` itself when it is float32; a float32 copy of a float16/bfloat16/float64 one (what
    FlashInfer's ``s.to(torch.float32)`` does); anything else as it is (the merge rejects it)."""
    dtype = view(s, arg).dtype  # TypeError naming the argument for what is not a tensor
    if dtype not in _CONVERTED:
        return s
    if hasattr(s, "float") and hasattr(s, "data_ptr"):  # torch
        return s.float()
    return s.astype("float32")  # numpy (bfloat16 through ml_dtypes), CuPy, JAX


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> tuple[Any, Any]:
    """``(V, S)`` merged from ``v_a [T, H, D]``, ``s_a [T, H]`` (base 2) and likewise b.

    ``S`` is float32 whatever the dtype of ``s_a`` (a bfloat16/float16 LSE is converted first).
    """
    s_a, s_b = _float32_lse(s_a, "s_a"), _float32_lse(s_b, "s_b")
    return _merge.merge_two(v_a, s_a, v_b, s_b, lse_base=2)


def merge_state_in_place(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None) -> None:
    """In place: ``(v, s)`` becomes the merge of itself with ``(v_other, s_other)`` (base 2).

    ``mask``: optional bool ``[T]``; rows where it is False are left untouched. A rejected call
    writes nothing. As in FlashInfer, an ``s`` that is not float32 is read through a float32
    copy and so keeps its old values (only ``v`` is updated).
    """
    f32 = TORCH_FLOAT32 or torch_float32()
    if (
        f32
        and type(s) is f32[0]
        and s.dtype is f32[1]
        and type(s_other) is f32[0]
        and s_other.dtype is f32[1]
    ):
        s32 = s  # the common call: float32 torch LSEs, decided without a view
    else:
        s32, s_other = _float32_lse(s, "s"), _float32_lse(s_other, "s_other")
    out_lse = s if s32 is s else None
    _merge_plans.two(
        v, s32, v_other, s_other, v, out_lse, 2, None, None, None, None, mask, False, False, _IN_PLACE_NAMES,
    )  # fmt: skip


def merge_states(v: Any, s: Any) -> tuple[Any, Any]:
    """``(V [T, H, D], S [T, H])`` merged from ``v [T, N, H, D]`` and ``s [T, N, H]`` (base 2).

    Any producer with ``swapaxes`` (torch, numpy, CuPy, JAX) is taken as it is (zero-copy).
    ``N = 0``: ``V = 0`` (``v``'s dtype) and ``S = -inf``, as FlashInfer writes.
    """
    v_shape = tuple(view(v, "v").shape)  # TypeError naming the argument for what is not a tensor
    s_shape = tuple(view(s, "s").shape)
    if len(v_shape) != 4:
        raise ValueError(f"v: expected [T, N, H, D] (4 dimensions), got shape {v_shape}")
    if len(s_shape) != 3:
        raise ValueError(f"s: expected [T, N, H] (3 dimensions), got shape {s_shape}")
    if s_shape != v_shape[:3]:
        raise ValueError(f"s: expected shape {v_shape[:3]} (T, N, H), got {s_shape}")
    for arg, x in (("v", v), ("s", s)):
        if not hasattr(x, "swapaxes"):
            raise TypeError(f"{arg}: a {type(x).__name__} has no swapaxes; pass a torch, numpy or CuPy array")
    s = _float32_lse(s, "s")
    if v_shape[1] == 0:
        return _no_states(v, (v_shape[0], v_shape[2], v_shape[3]))
    return _merge.merge_states(v.swapaxes(0, 1), s.swapaxes(0, 1), lse_base=2)


def _no_states(v: Any, shape: tuple[int, int, int]) -> tuple[Any, Any]:
    """FlashInfer's result for N = 0: zeros in ``v``'s dtype and device, LSE -inf (float32)."""
    if hasattr(v, "new_zeros"):  # torch
        import torch

        return v.new_zeros(shape), v.new_full(shape[:2], float("-inf"), dtype=torch.float32)
    xp = sys.modules[type(v).__module__.split(".")[0]]  # numpy, CuPy: the array's own module
    return xp.zeros(shape, dtype=v.dtype), xp.full(shape[:2], float("-inf"), dtype="float32")
