"""Writing the empty state (V = 0, LSE = -inf) into the rows of requests that are empty, in place.

Two rules, one kernel (``kernels_cu/empty_rows.cu``, the rule a template parameter):
:func:`fixup_zero_kv_rows` (``kv_lens[i] == 0``) and :func:`mask_empty_context` (the context span
``[cu_kv[i], cu_kv[i + 1])`` is empty).
"""

from __future__ import annotations

from typing import Any

from .core import empty_rows_plan as _plan
from .core import entries as _entries  # noqa: F401 - the compiled entries, when chosen
from .core import kernels as _kernels


def fixup_zero_kv_rows(
    out: Any, lse: Any, kv_lens: Any, cu_seqlens_q: Any, max_seqlen_q: int | None = None
) -> None:
    """In place: every row of every request with ``kv_lens[i] == 0`` gets ``V = 0`` and
    ``LSE = -inf``; every other row is left bitwise untouched.

    Args:
        out: ``[T, H, D]`` float16 / bfloat16 / float32, head_dim contiguous (mutated).
        lse: ``[T, H]`` float32, any strides (mutated).
        kv_lens: ``[B]`` int32 / int64, KV length of each request in this chunk.
        cu_seqlens_q: ``[B + 1]`` int32 / int64, query row offsets (same dtype or not).
        max_seqlen_q: accepted for signature compatibility and ignored: it never causes rows
            to be skipped.

    Offsets are trusted for meaning, never for memory: each request's rows are clipped to
    ``[0, T)``, a span with ``end <= start`` covers no row. One launch of a persistent grid
    whose work scales with the number of empty rows; no host sync; runs on the current stream
    of the tensors' device.
    """
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int)):
        raise TypeError(f"max_seqlen_q: expected an int or None, got {type(max_seqlen_q).__name__}")
    _plan.run(_kernels.RULE_KV_LENS_ZERO, (out, lse, cu_seqlens_q, kv_lens), None)


def mask_empty_context(out: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any) -> None:
    """In place: rows of requests whose context span is empty (``cu_seqlens_kv[i + 1] <=
    cu_seqlens_kv[i]``) get ``V = 0`` and ``LSE = -inf``, V and LSE in one launch; other rows
    are untouched.

    Args:
        out: ``[T, H, D]`` float16 / bfloat16 / float32, head_dim contiguous (mutated).
        lse: ``[T, H]`` float32, any strides (an ``[H, T]`` buffer as ``lse.T``) (mutated).
        cu_seqlens_q: ``[B + 1]`` int32 / int64 query row offsets (clipped to ``[0, T)``).
        cu_seqlens_kv: ``[B + 1]`` int32 / int64 context offsets of this chunk.

    No host sync; runs on the current stream of the tensors' device.
    """
    _plan.run(_kernels.RULE_CONTEXT_SPAN_EMPTY, (out, lse, cu_seqlens_q, cu_seqlens_kv), None)
