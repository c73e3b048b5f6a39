"""The baselines that are library calls, and the conventions every baseline merge keeps.

* torch eager: the ops as a careful user writes them (empty state by ``torch.where``, math in
  float32, no host sync). Baselines, not references: ``zerokv.reference`` is the specification.
* FlashInfer's ``merge_state`` (base-2 LSE) when it is importable.

The merges built for the bench live beside this file: ``baselines_triton`` (Triton merges in
the design of vLLM's) and ``baselines_cuda`` (a CUDA merge in the design of vLLM's). Every merge
of the three takes ``(v_a, s_a, v_b, s_b, out, out_lse)`` with ``[T, H]``-shaped LSE views,
writes ``out``/``out_lse`` and returns them. The math of the merges is zerokv's: ``m`` = the
larger LSE, ``+inf`` counted as ``-inf`` (empty), an input of weight 0 selected away (never
multiplied), two empty inputs give ``(0, -inf)``, NaN propagates.
"""

from __future__ import annotations

from typing import Any

import torch

INF = float("inf")

# --- torch eager --------------------------------------------------------------------------------


def eager_merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``V [T, H, D]``, ``LSE [T, H]`` natural log."""
    s_a = torch.where(s_a == INF, -INF, s_a)  # FA2 writes +inf for empty rows
    s_b = torch.where(s_b == INF, -INF, s_b)
    m = torch.maximum(s_a, s_b)
    m = torch.where(m == -INF, 0.0, m)  # both empty: keep (-inf) - m finite
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    total = w_a + w_b
    inv = torch.where(total == 0, 0.0, 1.0 / total)  # a NaN total stays NaN
    w_a, w_b, inv = w_a.unsqueeze(-1), w_b.unsqueeze(-1), inv.unsqueeze(-1)
    out.copy_(
        torch.where(w_a == 0, 0.0, v_a.float() * (w_a * inv))
        + torch.where(w_b == 0, 0.0, v_b.float() * (w_b * inv))
    )
    out_lse.copy_(torch.where(total == 0, -INF, m + torch.log(total)))
    return out, out_lse


def eager_merge_states(v: Any, s: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``v [N, T, H, D]``, ``s [N, T, H]``; writes ``out [T, H, D]`` and ``out_lse [T, H]``."""
    s = torch.where(s == INF, -INF, s)
    m = s.amax(dim=0)
    m = torch.where(m == -INF, 0.0, m)
    w = torch.exp(s - m)
    total = w.sum(dim=0)
    inv = torch.where(total == 0, 0.0, 1.0 / total)
    w = w.unsqueeze(-1)
    out.copy_(torch.where(w == 0, 0.0, v.float() * (w * inv.unsqueeze(-1))).sum(dim=0))
    out_lse.copy_(torch.where(total == 0, -INF, m + torch.log(total)))
    return out, out_lse


def _rows_of(empty_requests: Any, cu_seqlens_q: Any, T: int) -> Any:
    """``[T]`` bool from per-request flags; ``output_size`` given, so no device sync."""
    return torch.repeat_interleave(empty_requests, cu_seqlens_q[1:] - cu_seqlens_q[:-1], output_size=T)


def eager_fixup_zero_kv_rows(out: Any, lse: Any, kv_lens: Any, cu_seqlens_q: Any) -> tuple[Any, Any]:
    """Rows of requests with ``kv_lens == 0`` get ``(0, -inf)``: a boolean index with a scalar
    is a ``masked_fill_`` (no sync), which reads and writes the whole tensor."""
    rows = _rows_of(kv_lens == 0, cu_seqlens_q, out.shape[0])
    out[rows] = 0.0
    lse[rows] = -INF
    return out, lse


def eager_mask_empty_context(out: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any) -> tuple[Any, Any]:
    """The LSE of rows with an empty context span set to -inf, then the output zeroed by a
    ``masked_fill_`` over the whole tensor, driven by the LSE."""
    rows = _rows_of(cu_seqlens_kv[1:] == cu_seqlens_kv[:-1], cu_seqlens_q, out.shape[0])
    lse.masked_fill_(rows.unsqueeze(1), -INF)
    out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
    return out, lse


# --- FlashInfer -----------------------------------------------------------------------------------


def flashinfer_merge_state() -> Any:
    """FlashInfer's ``merge_state`` (base-2 LSE, allocates its outputs) in the common signature,
    or None when FlashInfer is not importable."""
    try:
        import flashinfer
    except Exception:
        return None

    def merge(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
        return flashinfer.merge_state(v_a, s_a, v_b, s_b)

    return merge
