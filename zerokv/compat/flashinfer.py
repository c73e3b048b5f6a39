"""FlashInfer's signatures: ``merge_state``, ``merge_state_in_place``, ``merge_states``.

LSE ``[T, H]`` in **base 2**, as FlashInfer's attention kernels write it.
"""

from __future__ import annotations

from typing import Any

from .. import merge as _merge
from ..core.tensors import view

_IN_PLACE_NAMES = {"v_a": "v", "s_a": "s", "v_b": "v_other", "s_b": "s_other", "out": "v", "out_lse": "s"}


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> tuple[Any, Any]:
    """``(V, S)`` merged from ``v_a [T, H, D]``, ``s_a [T, H]`` (float32, base 2) and likewise b."""
    return _merge.merge_two(v_a, s_a, v_b, s_b, lse_base=2)


def merge_state_in_place(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None) -> None:
    """In place: ``(v, s)`` becomes the merge of itself with ``(v_other, s_other)`` (base 2).

    ``mask``: optional bool ``[T]``; rows where it is False are left untouched. A rejected call
    writes nothing.
    """
    _merge.merge_two(
        v, s, v_other, s_other, v, s, lse_base=2, row_mask=mask, allocate_lse=False, names=_IN_PLACE_NAMES
    )


def merge_states(v: Any, s: Any) -> tuple[Any, Any]:
    """``(V [T, H, D], S [T, H])`` merged from ``v [T, N, H, D]`` and ``s [T, N, H]`` (base 2).

    Any producer with ``swapaxes`` (torch, numpy, CuPy, JAX) is taken as it is (zero-copy).
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
    return _merge.merge_states(v.swapaxes(0, 1), s.swapaxes(0, 1), lse_base=2)
