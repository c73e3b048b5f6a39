"""Triton merges in the design of vLLM's, as baselines: the two-way merge (one program per
(token, head), the LSE and V loads issued together), the per-group fp8 merge, and the LSE mask of
vLLM's path for empty-context requests (``vllm_seed_pipeline``, which ends in the CUDA merge of
``baselines_cuda``). Without Triton, ``triton`` is None and these columns are left out; the
conventions every baseline merge keeps are in ``baselines``.
"""

from __future__ import annotations

import os
from typing import Any

from .baselines_cuda import vllm_design_merge

try:
    import triton
    import triton.language as tl
except ImportError:  # the Triton column is left out
    triton = None

if triton is not None:

    @triton.jit
    def _triton_merge_kernel(
        va, sa, vb, sb, out, olse,
        va_st, va_sh, vb_st, vb_sh, o_st, o_sh,
        sa_st, sa_sh, sb_st, sb_sh, ol_st, ol_sh,
        D, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        inside = offs < D
        # The loads do not depend on each other: all four go out together.
        la = tl.load(sa + t * sa_st + h * sa_sh)
        lb = tl.load(sb + t * sb_st + h * sb_sh)
        xa = tl.load(va + t * va_st + h * va_sh + offs, mask=inside, other=0.0).to(tl.float32)
        xb = tl.load(vb + t * vb_st + h * vb_sh + offs, mask=inside, other=0.0).to(tl.float32)
        la = tl.where(la == float("inf"), float("-inf"), la)
        lb = tl.where(lb == float("inf"), float("-inf"), lb)
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        total = wa + wb
        inv = tl.where(total == 0.0, 0.0, 1.0 / total)
        res = tl.where(wa == 0.0, 0.0, xa * (wa * inv)) + tl.where(wb == 0.0, 0.0, xb * (wb * inv))
        tl.store(out + t * o_st + h * o_sh + offs, res.to(out.dtype.element_ty), mask=inside)
        tl.store(olse + t * ol_st + h * ol_sh, tl.where(total == 0.0, float("-inf"), m + tl.log(total)))


if triton is not None:

    @triton.jit
    def _triton_group_fp8_kernel(
        va, sa, vb, sb, out, olse, obs,
        va_st, va_sh, vb_st, vb_sh, o_st, o_sh,
        sa_st, sa_sh, sb_st, sb_sh, ol_st, ol_sh, bs_st, bs_sg,
        D: tl.constexpr, G: tl.constexpr, UE8M0: tl.constexpr,
    ):  # fmt: skip
        # vLLM's per-group fp8 merge design: one program per (token, head), the row in registers,
        # a group's absmax by a reduction over a [D / G, G] view, the scales through their strides
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, D)
        la = tl.load(sa + t * sa_st + h * sa_sh)
        lb = tl.load(sb + t * sb_st + h * sb_sh)
        xa = tl.load(va + t * va_st + h * va_sh + offs).to(tl.float32)
        xb = tl.load(vb + t * vb_st + h * vb_sh + offs).to(tl.float32)
        la = tl.where(la == float("inf"), float("-inf"), la)
        lb = tl.where(lb == float("inf"), float("-inf"), lb)
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        total = wa + wb
        inv = tl.where(total == 0.0, 0.0, 1.0 / total)
        res = tl.where(wa == 0.0, 0.0, xa * (wa * inv)) + tl.where(wb == 0.0, 0.0, xb * (wb * inv))
        g = tl.reshape(res, (D // G, G))
        amax = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-10)
        scale = amax / 448.0
        if UE8M0:
            scale = tl.exp2(tl.ceil(tl.log2(scale)))
        q = tl.clamp(g / scale[:, None], -448.0, 448.0)
        tl.store(out + t * o_st + h * o_sh + tl.reshape(offs, (D // G, G)), q.to(out.dtype.element_ty))
        gi = tl.arange(0, D // G)
        tl.store(obs + t * bs_st + (h * (D // G) + gi) * bs_sg, scale)
        tl.store(olse + t * ol_st + h * ol_sh, tl.where(total == 0.0, float("-inf"), m + tl.log(total)))


def triton_group_fp8_merge(
    v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any, block_scale: Any, group: int, ue8m0: bool
) -> tuple[Any, Any]:
    """Per-group fp8 merge of vLLM's design: ``out`` fp8 e4m3 ``[T, H, D]`` (D a power of two),
    ``block_scale`` float32 ``[T, H * D / group]`` any strides."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, H, D = v_a.shape
    if T * H == 0:
        return out, out_lse
    _triton_group_fp8_kernel[(T, H)](
        v_a, s_a, v_b, s_b, out, out_lse, block_scale,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), out.stride(0), out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1), out_lse.stride(0), out_lse.stride(1),
        block_scale.stride(0), block_scale.stride(1), D=D, G=group, UE8M0=ue8m0,
    )  # fmt: skip
    return out, out_lse


if triton is not None:

    @triton.jit
    def _triton_mask_lse_kernel(
        lse, row_mask, qsl, ctx, T, H, B, lse_sh, lse_st, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr
    ):
        # vLLM's mask_empty_context design: a block of tokens finds each token's request by a
        # vector compare over query_start_loc, sets the LSE of rows with an empty context to -inf
        # and leaves the output to a masked_fill_ (here through the row mask it writes)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        b = tl.arange(0, BLOCK_B)
        starts = tl.load(qsl + 1 + b, mask=b < B, other=2**30)
        req = tl.sum((starts[None, :] <= t[:, None]).to(tl.int32), axis=1)
        c0 = tl.load(ctx + req, mask=t < T, other=0)
        c1 = tl.load(ctx + req + 1, mask=t < T, other=1)
        empty = (c1 <= c0) & (t < T)
        tl.store(row_mask + t, empty, mask=t < T)
        for h in range(H):
            tl.store(lse + h * lse_sh + t * lse_st, float("-inf"), mask=empty)


def vllm_seed_pipeline(
    v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any, qsl: Any, ctx: Any, row_mask: Any
) -> tuple[Any, Any]:
    """vLLM's path for a chunk with empty-context requests: the LSE mask (Triton), the output's
    masked_fill_ over the whole tensor, then the vLLM-design CUDA merge (LSE laid [H, T])."""
    T, H, _ = v_a.shape
    B = qsl.shape[0] - 1
    _triton_mask_lse_kernel[(triton.cdiv(T, 64),)](
        s_a, row_mask, qsl, ctx, T, H, B, s_a.stride(1), s_a.stride(0),
        BLOCK_T=64, BLOCK_B=max(32, triton.next_power_of_2(B)),
    )  # fmt: skip
    v_a.masked_fill_(row_mask[:, None, None], 0.0)
    return vllm_design_merge(v_a, s_a, v_b, s_b, out, out_lse)


def triton_runs(dry: bool) -> bool:
    """Triton is installed and, for the dry run on the CPU, runs in its interpreter."""
    return triton is not None and (not dry or os.environ.get("TRITON_INTERPRET") == "1")


def triton_merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any) -> tuple[Any, Any]:
    """``V [T, H, D]`` (unit stride on D), ``LSE [T, H]`` any strides, natural log."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, H, D = v_a.shape
    if T * H == 0 or D == 0:
        return out, out_lse
    _triton_merge_kernel[(T, H)](
        v_a, s_a, v_b, s_b, out, out_lse,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), out.stride(0), out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1), out_lse.stride(0), out_lse.stride(1),
        D, BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip
    return out, out_lse
