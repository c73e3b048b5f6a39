"""FlashInfer's signatures: ``merge_state``, ``merge_state_in_place``, ``merge_states``.

LSE ``[T, H]`` in **base 2**, as FlashInfer's attention kernels write it.
"""

from __future__ import annotations

from typing import Any

from ..merge import merge_states as _merge_states
from ..merge import merge_two


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> tuple[Any, Any]:
    """``(V, S)`` merged from ``v_a [T, H, D]``, ``s_a [T, H]`` (float32, base 2) and likewise b."""
    return merge_two(
        v_a, s_a, v_b, s_b, None, None, 2, None, None, None,
        suffix_verbatim=False, row_mask=None, allocate_lse=True,
    )  # fmt: skip


def merge_state_in_place(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None) -> None:
    """In place: ``(v, s)`` becomes the merge of itself with ``(v_other, s_other)`` (base 2).

    ``mask``: optional bool ``[T]``; rows where it is False are left untouched.
    """
    merge_two(
        v, s, v_other, s_other, v, s, 2, None, None, None,
        suffix_verbatim=False, row_mask=mask, allocate_lse=False,
        names=("v", "s", "v_other", "s_other", "v", "s"),
    )  # fmt: skip


def merge_states(v: Any, s: Any) -> tuple[Any, Any]:
    """``(V [T, H, D], S [T, H])`` merged from ``v [T, N, H, D]`` and ``s [T, N, H]`` (base 2)."""
    if getattr(v, "ndim", None) != 4 or getattr(s, "ndim", None) != 3:
        raise ValueError(
            f"v, s: expected [T, N, H, D] and [T, N, H], got shapes "
            f"{tuple(getattr(v, 'shape', ()))} and {tuple(getattr(s, 'shape', ()))}"
        )
    return _merge_states(v.transpose(0, 1), s.transpose(0, 1), lse_base=2)
