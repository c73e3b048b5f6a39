"""SGLang's signatures: ``merge_state_v2`` and ``fixup_zero_kv_rows`` (LSE ``[T, H]``, natural log)."""

from __future__ import annotations

import sys
from typing import Any

from .._tensors import is_torch
from ..empty_rows import fixup_zero_kv_rows as _fixup
from ..merge import merge_two


def merge_state_v2(
    v_a: Any, s_a: Any, v_b: Any, s_b: Any, v_merged: Any = None, s_merged: Any = None
) -> tuple[Any, Any]:
    """Merge two states; returns ``(v_merged, s_merged)`` (allocated when None).

    Args:
        v_a, v_b: ``[T, H, D]`` float16 / bfloat16 / float32.
        s_a, s_b: ``[T, H]`` LSE, natural log (converted to float32 when not, as SGLang does).
        v_merged: ``[T, H, D]`` output (may alias ``v_a``), or None.
        s_merged: ``[T, H]`` float32 output, or None.

    As SGLang: an LSE of +inf counts as -inf. Unlike SGLang, two empty states give
    ``(0, -inf)``, not NaN.
    """
    s_a = (
        s_a.float() if getattr(s_a, "dtype", None) is not None and str(s_a.dtype) != "torch.float32" else s_a
    )
    s_b = (
        s_b.float() if getattr(s_b, "dtype", None) is not None and str(s_b.dtype) != "torch.float32" else s_b
    )
    if v_merged is not None and s_merged is None:
        s_merged = s_a.new_empty(s_a.shape)
    return merge_two(
        v_a, s_a, v_b, s_b, v_merged, s_merged, "e", None, None, None,
        suffix_verbatim=False, row_mask=None, allocate_lse=True,
        names=("v_a", "s_a", "v_b", "s_b", "v_merged", "s_merged"),
    )  # fmt: skip


def _float32(s: Any) -> Any:
    """SGLang casts the LSEs to float32 before its kernel; so do we (torch tensors only)."""
    if is_torch(s) and s.is_floating_point() and s.dtype != sys.modules["torch"].float32:
        return s.float()
    return s


def fixup_zero_kv_rows(out: Any, lse: Any, kv_lens: Any, cum_seq_lens: Any, max_seq_len: int) -> None:
    """In place: rows of requests with ``kv_lens[i] == 0`` get ``(0, -inf)``.

    Args:
        out: ``[T, H, Dv]`` float16 / bfloat16 / float32.
        lse: ``[T, H]`` float32.
        kv_lens: ``[B]`` int32 / int64.
        cum_seq_lens: ``[B + 1]`` int32 / int64 query offsets.
        max_seq_len: accepted and ignored: unlike SGLang's kernel, rows past it are fixed too.
    """
    _fixup(out, lse, kv_lens, cum_seq_lens, max_seq_len)
