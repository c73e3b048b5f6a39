"""torch-eager equivalents of the zerokv ops, written as a careful user would: the empty
state handled with ``torch.where`` / ``nan_to_num``, math in float32, no host sync.

They are the baselines of the benchmarks, not references: ``zerokv.reference`` is the
specification. (The merges still multiply a V of weight 0, so NaN scratch there would spread,
as in the engines' own merges; the benchmark data holds none.)
"""

from __future__ import annotations

from typing import Any

import torch

INF = float("inf")


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``V [T, H, D]``, ``LSE [T, H]`` natural log; writes ``out`` and ``out_lse``."""
    s_a = torch.where(s_a == INF, -INF, s_a)  # FA2 writes +inf for empty rows
    s_b = torch.where(s_b == INF, -INF, s_b)
    m = torch.maximum(s_a, s_b)
    m = torch.where(m == -INF, 0.0, m)  # both empty: keep (-inf) - m finite
    w_a = torch.exp(s_a - m)
    w_b = torch.exp(s_b - m)
    total = w_a + w_b
    c_a = torch.nan_to_num(w_a / total, nan=0.0)  # 0 / 0 when both are empty
    c_b = torch.nan_to_num(w_b / total, nan=0.0)
    out.copy_(v_a.float() * c_a.unsqueeze(-1) + v_b.float() * c_b.unsqueeze(-1))
    out_lse.copy_(torch.where(total > 0, m + torch.log(total), -INF))
    return out, out_lse


def merge_states(v: Any, s: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``v [N, T, H, D]``, ``s [N, T, H]``; writes ``out [T, H, D]`` and ``out_lse [T, H]``."""
    s = torch.where(s == INF, -INF, s)
    m = s.amax(dim=0)
    m = torch.where(m == -INF, 0.0, m)
    w = torch.exp(s - m)
    total = w.sum(dim=0)
    c = torch.nan_to_num(w / total, nan=0.0)
    out.copy_((v.float() * c.unsqueeze(-1)).sum(dim=0))
    out_lse.copy_(torch.where(total > 0, m + torch.log(total), -INF))
    return out, out_lse


def _rows_of(empty_requests: Any, cu_seqlens_q: Any, T: int) -> Any:
    """``[T]`` bool from per-request flags; ``output_size`` given, so no device sync."""
    return torch.repeat_interleave(empty_requests, cu_seqlens_q[1:] - cu_seqlens_q[:-1], output_size=T)


def fixup_zero_kv_rows(out: Any, lse: Any, kv_lens: Any, cu_seqlens_q: Any) -> tuple[Any, Any]:
    """Rows of requests with ``kv_lens == 0`` get ``(0, -inf)``. A boolean index with a scalar
    value is a ``masked_fill_`` (no sync), which reads and writes the whole tensor."""
    rows = _rows_of(kv_lens == 0, cu_seqlens_q, out.shape[0])
    out[rows] = 0.0
    lse[rows] = -INF
    return out, lse


def mask_empty_context(out: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any) -> tuple[Any, Any]:
    """vLLM style: the LSE of rows with an empty context span set to -inf, then the output
    zeroed by a ``masked_fill_`` over the whole tensor, driven by the LSE."""
    rows = _rows_of(cu_seqlens_kv[1:] == cu_seqlens_kv[:-1], cu_seqlens_q, out.shape[0])
    lse.masked_fill_(rows.unsqueeze(1), -INF)
    out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
    return out, lse
