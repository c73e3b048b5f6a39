"""Every op, every adapter and every torch.ops entry on the GPU, with valid inputs and with lying
offsets, in small shapes: run under ``compute-sanitizer --tool memcheck`` by test_sanitizer.py.

Layouts cover the vector path (head_dim 64, aligned), the scalar path (head_dim 7), unaligned
views (``t[1:]``) and padded strides. Run with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every
tensor is its own allocation and an access past it is seen. Exits 3 if a call raised.
"""

from __future__ import annotations

import sys
import traceback

import torch
from batches import LYING_CASES, make_batch
from states import NAN, make_states

import zerokv
from zerokv import merge
from zerokv.compat import flashinfer, sglang, vllm

DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
calls = 0
raised: list[str] = []


def run(name: str, fn) -> None:
    """One call; an exception is recorded (and the run goes on, so memcheck sees the rest)."""
    global calls
    calls += 1
    try:
        fn()
    except Exception as e:
        raised.append(f"{name}: {type(e).__name__}: {e}")
        traceback.print_exc()


def lay(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x [T, H, D]`` in a layout: its own allocation, an unaligned view, or padded strides."""
    if kind == "unaligned":
        return torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape).copy_(x)
    if kind == "padded":
        T, H, D = x.shape
        return torch.empty(T, H + 1, D + 8, dtype=x.dtype, device=x.device)[:, :H, :D].copy_(x)
    return x.clone()


def ht(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` living in an ``[H, T]`` buffer, seen as ``[T, H]``."""
    return x.T.contiguous().T


def poison(shape, dtype=torch.float32, kind="contiguous") -> torch.Tensor:
    """A NaN-filled output (a V shape in the given layout)."""
    x = torch.full(shape, NAN, dtype=dtype, device=DEV)
    return lay(x, kind) if len(shape) == 3 else x


def context_offsets(kv: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=kv.dtype), kv.cumsum(0).to(kv.dtype)])


def valid_inputs() -> None:
    for dtype in DTYPES:
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        for D in (7, 64):
            for kind in ("contiguous", "unaligned", "padded"):
                tag = f"{dtype}-D{D}-{kind}"
                cu, kv = make_batch(9, 12, "random", seed=D)
                T, H = int(cu[-1]), 4
                cu, kv, cu_kv = cu.to(DEV), kv.to(DEV), context_offsets(kv).to(DEV)
                v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, DEV, seed=D + T)
                va, vb = lay(v_a, kind), lay(v_b, kind)
                sa = ht(s_a)
                out, lse = poison((T, H, D), dtype, kind), ht(poison((T, H)))
                run(f"merge_state alloc {tag}", lambda: zerokv.merge_state(va, sa, vb, s_b))
                run(
                    f"merge_state out {tag}",
                    lambda: zerokv.merge_state(va, sa, vb, s_b, out=out, out_lse=lse),
                )
                run(f"merge_state no lse {tag}", lambda: zerokv.merge_state(va, sa, vb, s_b, out=out))
                run(
                    f"merge_state prefix_rows {tag}",
                    lambda: zerokv.merge_state(va, sa, vb, s_b, out=out, out_lse=lse, prefix_rows=T // 3),
                )
                run(
                    f"merge_state a_empty {tag}",
                    lambda: zerokv.merge_state(va, sa, vb, s_b, out=out, out_lse=lse, a_empty=(cu, kv)),
                )
                run(f"merge_state base 2 {tag}", lambda: zerokv.merge_state(va, sa, vb, s_b, lse_base=2))
                run(
                    f"merge_state out dtype {tag}",
                    lambda: zerokv.merge_state(va, sa, vb, s_b, out=poison((T, H, D), other, kind)),
                )
                ia, isa = va.clone(), sa.clone()
                run(
                    f"merge_state in place {tag}",
                    lambda: zerokv.merge_state(ia, isa, vb, s_b, out=ia, out_lse=isa),
                )
                v, s = torch.stack([v_a, v_b, v_a]), torch.stack([s_a, s_b, s_b])
                run(f"merge_states NTHD {tag}", lambda: zerokv.merge_states(v, s, out=out, out_lse=lse))
                vt = v.transpose(0, 1).contiguous().transpose(0, 1)
                st = s.transpose(0, 1).contiguous().transpose(0, 1)
                run(f"merge_states TNHD {tag}", lambda: zerokv.merge_states(vt, st))
                run(f"fixup {tag}", lambda: zerokv.fixup_zero_kv_rows(out, lse, kv, cu))
                run(f"mask {tag}", lambda: zerokv.mask_empty_context(out, lse, cu, cu_kv))
                compat(tag, va, sa, vb, s_b, out, lse, cu, kv, cu_kv)
        fp8(dtype)


def fp8(dtype) -> None:
    for D in (7, 64):
        v_a, s_a, v_b, s_b = make_states(50, 4, D, dtype, DEV, seed=D, edges=False)
        scale = torch.tensor([0.05], device=DEV)
        out = torch.empty(50, 4, D, dtype=torch.float8_e4m3fn, device=DEV)
        run(
            f"merge_state fp8 {dtype}-D{D}",
            lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_scale=scale),
        )
        run(
            f"vllm fp8 {dtype}-D{D}",
            lambda: vllm.merge_attn_states(out, v_a, s_a.T, v_b, s_b.T, None, 20, scale),
        )


def compat(tag, va, sa, vb, sb, out, lse, cu, kv, cu_kv) -> None:
    T = va.shape[0]
    lse_ht = lse.T  # an [H, T] view of the same buffer
    run(f"vllm merge {tag}", lambda: vllm.merge_attn_states(out, va, sa.T, vb, sb.T, lse_ht))
    run(f"vllm merge cutoff {tag}", lambda: vllm.merge_attn_states(out, va, sa.T, vb, sb.T, lse_ht, T // 2))
    run(f"vllm mask {tag}", lambda: vllm.mask_empty_context(lse_ht, out, cu, cu_kv))
    if out.is_contiguous():
        flat = out.view(T, -1)
        run(f"vllm mask flat {tag}", lambda: vllm.mask_empty_context(lse_ht, flat, cu, cu_kv))
    run(f"sglang merge {tag}", lambda: sglang.merge_state_v2(va, sa, vb, sb))
    run(f"sglang merge out {tag}", lambda: sglang.merge_state_v2(va, sa, vb, sb, out, lse))
    run(f"sglang fixup {tag}", lambda: sglang.fixup_zero_kv_rows(out, lse, kv, cu, 1))
    run(f"flashinfer merge {tag}", lambda: flashinfer.merge_state(va, sa, vb, sb))
    mask = torch.arange(T, device=DEV) % 3 == 0
    iv, isa = va.clone(), sa.clone()
    run(f"flashinfer in place {tag}", lambda: flashinfer.merge_state_in_place(iv, isa, vb, sb, mask=mask))
    v, s = torch.stack([va, vb], dim=1), torch.stack([sa, sb], dim=1)
    run(f"flashinfer merge_states {tag}", lambda: flashinfer.merge_states(v, s))
    ops = torch.ops.zerokv
    run(f"ops.merge_state {tag}", lambda: ops.merge_state(va, sa, vb, sb, "e", None, cu, kv))
    run(f"ops.merge_state_out {tag}", lambda: ops.merge_state_out(va, sa, vb, sb, out, lse))
    run(f"ops.merge_states {tag}", lambda: ops.merge_states(torch.stack([va, vb]), torch.stack([sa, sb])))
    run(f"ops.fixup {tag}", lambda: ops.fixup_zero_kv_rows(out, lse, kv, cu))
    run(f"ops.mask {tag}", lambda: ops.mask_empty_context(out, lse, cu, cu_kv))


def flat_forms() -> None:
    """The flat kernel's forms by size, each in a shape whose last block is partial: the smallest
    calls in blocks of heads of one token (3 x 7 rows of 16 or 8 packs: fewer heads than a block
    holds; 2 x 37 rows of 32 or 16 packs: a last block of 5 or 1 heads), calls of 2^19 threads and more
    in blocks of 512 with the output LSE gathered (2100 x 127 rows of 8 packs: 4167.2 blocks;
    4099 x 15 rows of 9 packs, cut by the blocks' edges), their rows in tiles of 8 tokens for an
    LSE laid [H, T] (out_lse, or s_a without one; 8201 x 129: one token past the last tile;
    7 x 1000: no whole tile)."""
    for T, H, D in (
        (3, 7, 64),
        (2, 37, 128),
        (2100, 127, 64),
        (4099, 15, 72),
        (8201, 129, 128),
        (7, 1000, 1024),
    ):
        for dtype in (torch.float16, torch.bfloat16):
            tag = f"{T}x{H}x{D} {dtype}"
            v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, DEV, seed=T)
            out = poison((T, H, D), dtype)
            # out_lse with heads, tokens, or neither unit-stride, or none
            for lse in (poison((T, H)), ht(poison((T, H))), poison((T, H, 2))[..., 1], None):
                strides = None if lse is None else lse.stride()
                run(
                    f"merge_state flat {tag} out_lse strides {strides}",
                    lambda: zerokv.merge_state(v_a, ht(s_a), v_b, s_b, out=out, out_lse=lse),
                )
            lse = poison((T, H))
            v, s = torch.stack([v_a, v_b]), torch.stack([s_a, s_b])
            run(f"merge_states flat {tag}", lambda: zerokv.merge_states(v, s, out=out, out_lse=lse))


def option_forms() -> None:
    """Each option alone on the flat family's size classes (heads, small, gathered, tiled), with
    valid offsets and with lying ones (decreasing, negative, past T, past 2^31 for int64)."""
    for T, H, D in ((3, 7, 64), (2, 37, 128), (300, 8, 128), (4200, 8, 128), (5, 3, 40)):
        dtype = torch.bfloat16
        tag = f"{T}x{H}x{D}"
        v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, DEV, seed=T + 1)
        for lse_kind, lse in (("TH", poison((T, H))), ("HT", ht(poison((T, H))))):
            out = poison((T, H, D), dtype)
            t = f"{tag} {lse_kind}"
            offsets = {
                "valid": ([0, T // 3, T // 3, T], [4, 0, 5]),
                "lying": ([0, T + 50, -7, 2**31 - 1, T // 2], [0, 3, 0, 0]),
                "lying64": ([0, 2**40, -(2**40), 5, T], [0, 0, 9, 0]),
            }
            g = torch.Generator().manual_seed(T)
            for B in (40, 1100):  # the warp search's tree, then its window or each lane alone
                cu_r = torch.randint(-T, 2 * T + 1, (B + 1,), generator=g).tolist()
                offsets[f"scrambled{B}"] = (cu_r, torch.randint(0, 2, (B,), generator=g).tolist())
            for kind, (cu_l, kv_l) in offsets.items():
                idx = torch.int64 if kind == "lying64" else torch.int32
                cu, kv = torch.tensor(cu_l, dtype=idx, device=DEV), torch.tensor(kv_l, dtype=idx, device=DEV)
                run(
                    f"option a_empty {kind} {t}",
                    lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, a_empty=(cu, kv)),
                )
            sinks = torch.randn(H, device=DEV)
            run(
                f"option sinks {t}",
                lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, sinks=sinks),
            )
            mask = torch.arange(T, device=DEV) % 3 != 1
            run(f"option row_mask {t}", lambda: merge.merge_two(v_a, s_a, v_b, s_b, out, lse, row_mask=mask))
            run(
                f"option verbatim {t}",
                lambda: merge.merge_two(
                    v_a, s_a, v_b, s_b, out, lse, prefix_rows=T // 2, suffix_verbatim=True
                ),
            )
            o8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=DEV)
            scale = torch.tensor([0.05], device=DEV)
            run(
                f"option out_scale {t}",
                lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=o8, out_lse=lse, out_scale=scale),
            )
            for g in (16, 64):
                if D % g:
                    continue
                for bs_kind, bs in (
                    ("rows", torch.empty(T, H * D // g, device=DEV)),
                    ("cols", torch.empty(H * D // g, T, device=DEV).T),
                ):
                    run(
                        f"option group fp8 g{g} {bs_kind} {t}",
                        lambda: zerokv.merge_state(
                            v_a,
                            s_a,
                            v_b,
                            s_b,
                            out=o8,
                            out_lse=lse,
                            out_block_scale=bs,
                            quant_group=g,
                            scale_format="ue8m0",
                        ),
                    )


def a_empty_runs() -> None:
    """a_empty on the gathered form in runs of spans (a grid past the runs' threshold on this GPU,
    head_dim 16: few bytes a row), valid and lying offsets, both LSE layouts, prefix_rows."""
    from zerokv.core import forms

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    H, D = 128, 16  # two packs of bf16 a row
    T = forms.THRESHOLDS["a_empty_runs_spans_per_sm"] * sms * 512 // (H * 2) + 5
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, DEV, seed=3)
    g = torch.Generator().manual_seed(T)
    offsets = {
        "valid": (torch.linspace(0, T, 41).round().tolist(), [0, 3] * 20, torch.int32),
        "lying": ([0, T + 50, -7, 2**31 - 1, T // 2], [0, 3, 0, 0], torch.int32),
        "lying64": ([0, 2**40, -(2**40), 5, T], [0, 0, 9, 0], torch.int64),
        "scrambled": (torch.randint(-T, 2 * T + 1, (1101,), generator=g).tolist(), [0, 1] * 550, torch.int32),
        # past the window, the offsets copied into shared memory (merge_flat_rows.cuh's search_tokens_staged)
        "staged": (torch.linspace(0, T, 251).round().tolist(), [0, 3] * 125, torch.int32),
        "staged scrambled": (
            torch.randint(-T, 2 * T + 1, (251,), generator=g).tolist(),
            [0, 1] * 125,
            torch.int32,
        ),
        "staged lying64": ([0, 2**40, -(2**40), *range(5, 5 + 97), T], [0, 0] + [9, 0] * 49, torch.int64),
    }
    for lse_kind, lse in (("TH", poison((T, H))), ("HT", ht(poison((T, H))))):
        out = poison((T, H, D), torch.bfloat16)
        for kind, (cu_l, kv_l, idx) in offsets.items():
            cu, kv = torch.tensor(cu_l, dtype=idx, device=DEV), torch.tensor(kv_l, dtype=idx, device=DEV)
            run(
                f"runs a_empty {kind} {lse_kind}",
                lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, a_empty=(cu, kv)),
            )
    run(
        "runs a_empty prefix_rows",
        lambda: zerokv.merge_state(
            v_a, s_a, v_b, s_b, out=out, out_lse=lse, a_empty=(cu, kv), prefix_rows=T // 3
        ),
    )
    # rows of one pack (H = 1, D = 8): a long block's shared search holds 2048 tokens, its most
    T1 = forms.THRESHOLDS["a_empty_runs_spans_per_sm"] * sms * 512 + 1003
    v_a, s_a, v_b, s_b = make_states(T1, 1, 8, torch.bfloat16, DEV, seed=4)
    out1 = poison((T1, 1, 8), torch.bfloat16)
    for kind, cu_l, kv_l in (
        ("valid", torch.linspace(0, T1, 401).round().tolist(), [0, 3] * 200),
        ("scrambled", torch.randint(-T1, 2 * T1 + 1, (31,), generator=g).tolist(), [0, 1] * 15),
    ):
        cu, kv = (
            torch.tensor(cu_l, dtype=torch.int32, device=DEV),
            torch.tensor(kv_l, dtype=torch.int32, device=DEV),
        )
        for lse_kind, lse1 in (("TH", poison((T1, 1))), ("HT", ht(poison((T1, 1))))):
            run(
                f"runs a_empty one row a thread {kind} {lse_kind}",
                lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out1, out_lse=lse1, a_empty=(cu, kv)),
            )


def lying_offsets() -> None:
    for case in LYING_CASES:
        for index_dtype in case.index_dtypes:
            cu, kv, cu_kv = case.tensors(index_dtype, DEV)
            for D in (7, 64):
                tag = f"{case.id}-{index_dtype}-D{D}"
                T, H = case.T, case.H
                v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, DEV, seed=T + D)
                out, lse = poison((T, H, D), torch.bfloat16), ht(poison((T, H)))
                run(f"fixup {tag}", lambda: zerokv.fixup_zero_kv_rows(out, lse, kv, cu))
                run(f"mask {tag}", lambda: zerokv.mask_empty_context(out, lse, cu, cu_kv))
                run(
                    f"merge_state a_empty {tag}",
                    lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, a_empty=(cu, kv)),
                )
                run(
                    f"merge_state a_empty prefix_rows {tag}",
                    lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, a_empty=(cu, kv), prefix_rows=T // 2),
                )
                run(f"sglang fixup {tag}", lambda: sglang.fixup_zero_kv_rows(out, lse, kv, cu, 1))
                run(f"vllm mask {tag}", lambda: vllm.mask_empty_context(lse.T, out, cu, cu_kv))
                ops = torch.ops.zerokv
                run(f"ops.fixup {tag}", lambda: ops.fixup_zero_kv_rows(out, lse, kv, cu))
                run(f"ops.mask {tag}", lambda: ops.mask_empty_context(out, lse, cu, cu_kv))
                run(
                    f"ops.merge_state_out a_empty {tag}",
                    lambda: ops.merge_state_out(v_a, s_a, v_b, s_b, out, lse, "e", None, cu, kv),
                )


def main() -> int:
    valid_inputs()
    flat_forms()
    option_forms()
    a_empty_runs()
    lying_offsets()
    torch.cuda.synchronize()
    print(f"sanitize_ops: {calls} calls, {len(raised)} raised")
    for line in raised:
        print(f"  raised: {line}")
    return 3 if raised else 0


if __name__ == "__main__":
    sys.exit(main())
