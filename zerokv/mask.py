"""Empty-context mask: rows of requests whose context span is empty get (0, -inf), in place."""

from __future__ import annotations

from typing import Any

from . import empty_rows

empty_rows.register("mask", "mask_empty_context_kernel")


def mask_empty_context(out: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any) -> None:
    """In place: rows of requests with ``cu_seqlens_kv[i + 1] == cu_seqlens_kv[i]`` get
    ``V = 0`` and ``LSE = -inf``, V and LSE in one launch; other rows are untouched.

    Args:
        out: ``[T, H, D]`` float16 / bfloat16 / float32, head_dim contiguous (mutated).
        lse: ``[T, H]`` float32, any strides (an ``[H, T]`` buffer as ``lse.T``) (mutated).
        cu_seqlens_q: ``[B + 1]`` int32 / int64 query row offsets.
        cu_seqlens_kv: ``[B + 1]`` int32 / int64 context offsets of this chunk.

    No host sync; runs on the current stream of the tensors' device.
    """
    empty_rows.run(
        "mask", "mask_empty_context_kernel", out, lse, cu_seqlens_q, cu_seqlens_kv,
        ("out", "lse", "cu_seqlens_q", "cu_seqlens_kv"), lens_are_offsets=True,
    )  # fmt: skip
