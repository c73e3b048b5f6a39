"""SGLang's signatures: ``merge_state_v2`` and ``fixup_zero_kv_rows`` (LSE ``[T, H]``, natural log)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..core import empty_rows_plan as _empty_rows_plan
from ..core import kernels as _kernels
from ..core import merge_plans as _merge_plans
from ..core.tensors import TORCH_FLOAT32, torch_float32, view

_MERGE_NAMES = {"out": "v_merged", "out_lse": "s_merged"}
_FIXUP_NAMES = ("out", "lse", "cum_seq_lens", "kv_lens")  # (out, lse, cu_q, lens)
_CASTABLE = ("float16", "bfloat16", "float64", "float8_e4m3fn")  # float LSEs SGLang converts


def merge_state_v2(
    v_a: Any, s_a: Any, v_b: Any, s_b: Any, v_merged: Any = None, s_merged: Any = None
) -> tuple[Any, Any]:
    """Merge two states; returns ``(v_merged, s_merged)`` (each allocated when None).

    Args:
        v_a, v_b: ``[T, H, D]`` float16 / bfloat16 / float32.
        s_a, s_b: ``[T, H]`` LSE, natural log: float32, or another floating dtype converted to
            float32 as SGLang does (a copy); an integer or bool LSE is a ``TypeError``.
        v_merged: ``[T, H, D]`` output (may be ``v_a`` or ``v_b`` itself), or None.
        s_merged: ``[T, H]`` float32 output (may be ``s_a`` or ``s_b`` itself), or None.

    As SGLang: an LSE of +inf counts as -inf. Unlike SGLang, two empty states give
    ``(0, -inf)``, not NaN. A rejected call writes nothing.
    """
    f32 = TORCH_FLOAT32 or torch_float32()
    if not (
        f32 and type(s_a) is f32[0] and s_a.dtype is f32[1] and type(s_b) is f32[0] and s_b.dtype is f32[1]
    ):
        s_a, s_b = _float32(s_a, "s_a"), _float32(s_b, "s_b")  # converted, or refused by name
    return _merge_plans.two(
        v_a, s_a, v_b, s_b, v_merged, s_merged, "e", None, None, None, None, None, False, True, _MERGE_NAMES,
    )  # fmt: skip


def _float32(s: Any, arg: str) -> Any:
    """SGLang converts a floating LSE to float32 before its kernel; so do we. Anything else is
    refused here rather than converted (an int or bool LSE is a bug upstream)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(s, torch.Tensor):  # is_torch, written out (every call)
        if s.dtype is torch.float32:
            return s
        if s.is_floating_point():
            return s.float()
        raise TypeError(f"{arg}: an LSE must be floating point (float32 preferred), got dtype {s.dtype}")
    if s is None:
        raise TypeError(f"{arg}: expected a tensor, got None")
    dtype = view(s, arg).dtype  # TypeError naming arg for what is not a tensor
    if dtype == "float32":
        return s
    if dtype not in _CASTABLE:
        raise TypeError(f"{arg}: an LSE must be floating point (float32 preferred), got dtype {dtype}")
    if not hasattr(s, "astype"):
        raise TypeError(f"{arg}: a {dtype} LSE of type {type(s).__name__} cannot be converted; pass float32")
    return s.astype(np.float32)


def fixup_zero_kv_rows(out: Any, lse: Any, kv_lens: Any, cum_seq_lens: Any, max_seq_len: int) -> None:
    """In place: rows of requests with ``kv_lens[i] == 0`` get ``(0, -inf)``.

    Args:
        out: ``[T, H, Dv]`` float16 / bfloat16 / float32.
        lse: ``[T, H]`` float32.
        kv_lens: ``[B]`` int32 / int64.
        cum_seq_lens: ``[B + 1]`` int32 / int64 query offsets (clipped to ``[0, T)``).
        max_seq_len: an int, accepted and ignored: unlike SGLang's kernel, rows past it are
            fixed too.

    A rejected call writes nothing.
    """
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)):
        raise TypeError(f"max_seq_len: expected an int, got {type(max_seq_len).__name__}")
    _empty_rows_plan.run(_kernels.RULE_KV_LENS_ZERO, (out, lse, cum_seq_lens, kv_lens), _FIXUP_NAMES)
