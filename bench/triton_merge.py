"""A Triton merge of two attention states, written from the formula, as the comparison point
for a Triton-based engine merge: one program per (token, head) row, Triton's default launch
settings.

    m = max(s_a, s_b);  w_x = exp(s_x - m);  V = (w_a V_a + w_b V_b) / (w_a + w_b)
    S = m + log(w_a + w_b)

An LSE of -inf or +inf counts as empty (weight 0, its V not loaded); two empty inputs give
(0, -inf). Importing this module needs ``triton``.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    va_ptr, sa_ptr, vb_ptr, sb_ptr, out_ptr, olse_ptr,
    va_st, va_sh, vb_st, vb_sh, o_st, o_sh,
    sa_st, sa_sh, sb_st, sb_sh, ol_st, ol_sh,
    H, D,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    la = tl.load(sa_ptr + t * sa_st + h * sa_sh)
    lb = tl.load(sb_ptr + t * sb_st + h * sb_sh)
    la = tl.where(la == float("inf"), float("-inf"), la)
    lb = tl.where(lb == float("inf"), float("-inf"), lb)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = wa + wb
    inv = tl.where(total > 0.0, 1.0 / total, 0.0)
    offs = tl.arange(0, BLOCK_D)
    inside = offs < D
    # an input of weight 0 is not loaded: its V may be NaN scratch
    xa = tl.load(va_ptr + t * va_st + h * va_sh + offs, mask=offs < tl.where(wa > 0.0, D, 0), other=0.0)
    xb = tl.load(vb_ptr + t * vb_st + h * vb_sh + offs, mask=offs < tl.where(wb > 0.0, D, 0), other=0.0)
    res = (xa.to(tl.float32) * (wa * inv)) + (xb.to(tl.float32) * (wb * inv))
    tl.store(out_ptr + t * o_st + h * o_sh + offs, res.to(out_ptr.dtype.element_ty), mask=inside)
    lse = tl.where(total > 0.0, m + tl.log(total), float("-inf"))
    tl.store(olse_ptr + t * ol_st + h * ol_sh, lse)


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``V [T, H, D]`` (head_dim contiguous), ``LSE [T, H]`` float32 natural log; ``out`` may have
    another float dtype than the inputs. Writes ``out`` and ``out_lse``."""
    T, H, D = v_a.shape
    if T * H == 0 or D == 0:
        return out, out_lse
    _merge_kernel[(T * H,)](
        v_a, s_a, v_b, s_b, out, out_lse,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), out.stride(0), out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1), out_lse.stride(0), out_lse.stride(1),
        H, D,
        BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip
    return out, out_lse
