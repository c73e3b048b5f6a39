"""Zero-KV fixup: rows of requests that had no KV get the empty state (0, -inf), in place."""

from __future__ import annotations

from typing import Any

from . import empty_rows

empty_rows.register("fixup", "fixup_zero_kv_rows_kernel")


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

    One launch of a persistent grid whose work scales with the number of empty rows; no host
    sync; runs on the current stream of the tensors' device.
    """
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int)):
        raise TypeError(f"max_seqlen_q: expected an int or None, got {type(max_seqlen_q).__name__}")
    empty_rows.run(
        "fixup", "fixup_zero_kv_rows_kernel", out, lse, cu_seqlens_q, kv_lens,
        ("out", "lse", "cu_seqlens_q", "kv_lens"), lens_are_offsets=False,
    )  # fmt: skip
