"""What each op launches (no GPU needed): the kernel form, its grid and its arguments by name.

CPU tensors are routed down the GPU path (their facts read as if on device 0) with the
launchers replaced by recorders, so the public calls, the adapters and ``torch.ops.zerokv``
run their one path up to the packed argument buffer: the form a layout gets, the arguments
by the kernel's parameter names, what a later call of a signature rejects.
"""

from __future__ import annotations

import pytest
import torch
from states import layout_states as _states

import zerokv
from zerokv.compat import sglang, vllm
from zerokv.core import kernels as _kernels

BF16 = ("zk_bfloat16", "zk_bfloat16")


def _two(log, T, H, D, dtype=torch.bfloat16, out_dtype=None, out_lse_ht=False, lse_ht=False):
    """``(kernel, instantiation, grid)`` of merge_state with outputs given (out_lse [T, H], or
    an [H, T] buffer as ``.T``)."""
    v_a, s_a, v_b, s_b = _states(T, H, D, dtype, lse_ht)
    out = torch.empty(T, H, D, dtype=out_dtype or dtype)
    out_lse = torch.empty(H, T).T if out_lse_ht else torch.empty(T, H)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    return log[-1][:3]


def _both_plans(log, T, H, D, dtype=torch.bfloat16, out_dtype=None, out_lse_ht=False):
    """What merge_state and a two-state merge_states launch for the same aligned call."""
    v_a, s_a, v_b, s_b = _states(T, H, D, dtype, True)
    out = torch.empty(T, H, D, dtype=out_dtype or dtype)
    out_lse = torch.empty(H, T).T if out_lse_ht else torch.empty(T, H)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    two = log[-1][:3]
    zerokv.merge_states(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), out=out, out_lse=out_lse)
    return two, log[-1][:3]


def _unaligned_two(log, T, H, D):
    """``(kernel, instantiation, grid)`` of a bf16 merge_state whose v_a starts one element
    into its buffer (no vector packs)."""
    v_a, s_a, v_b, s_b = _states(T, H, D, torch.bfloat16, True)
    odd = torch.empty(T * H * D + 1, dtype=torch.bfloat16)[1:].view(T, H, D)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    zerokv.merge_state(odd, s_a, v_b, s_b, out=out, out_lse=torch.empty(T, H))
    return log[-1][:3]


@pytest.mark.parametrize("shape", [(1, 16, 512), (7, 8, 64), (64, 32, 128), (300, 4, 72), (2048, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("lse_ht, pad_h, inplace", [(False, 0, False), (True, 3, False), (True, 0, True)])
def test_merge_state_packs_each_argument_under_its_parameter_name(
    recorded, shape, dtype, lse_ht, pad_h, inplace
):
    """Whatever form a layout takes, its parameters hold the call's pointers, strides and
    sizes by name, on the first call of the signature and on later ones (a new T)."""
    for T in (shape[0], shape[0] + 1):
        H, D = shape[1:]
        v_a, s_a, v_b, s_b = _states(T, H, D, dtype, lse_ht, pad_h)
        out, out_lse = (v_a, s_a) if inplace else (torch.empty(T, H, D, dtype=dtype), torch.empty(T, H))
        for prefix in (None, T // 2):
            zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse, prefix_rows=prefix)
            name, _, _, a = recorded[-1]
            want = {
                "va": v_a.data_ptr(), "vb": v_b.data_ptr(), "sa": s_a.data_ptr(), "sb": s_b.data_ptr(),
                "out": out.data_ptr(), "olse": out_lse.data_ptr(), "prefix_rows": T if prefix is None else prefix,
                "va_st": v_a.stride(0), "va_sh": v_a.stride(1), "vb_st": v_b.stride(0), "vb_sh": v_b.stride(1),
                "sa_st": s_a.stride(0), "sa_sh": s_a.stride(1), "ol_st": out_lse.stride(0), "ol_sh": out_lse.stride(1),
                "out_st": out.stride(0), "out_sh": out.stride(1), "H": H, "suffix_verbatim": 0,
            }  # fmt: skip
            assert {k: a[k] for k in want} == want, name
            assert a["k"] == pytest.approx(1.4426950408889634)
            if name == "merge_state_kernel":
                assert (a["T"], a["D"], a["a_cu"], a["row_mask"], a["sinks"], a["out_scale"]) == (
                    T,
                    D,
                    0,
                    0,
                    0,
                    0,
                )


def test_options_pack_their_pointers_by_name(recorded):
    """a_empty, row_mask, sinks and out_scale reach merge_state_kernel as their pointers (and
    the batch and index width of a_empty), on the first and a later call."""
    T, H, D = 40, 4, 64
    for T in (40, 41):
        v_a, s_a, v_b, s_b = _states(T, H, D)
        cu, lens = torch.tensor([0, 5, 17, T], dtype=torch.int64), torch.tensor([0, 3, 0], dtype=torch.int64)
        sinks = torch.randn(H)
        zerokv.merge_state(v_a, s_a, v_b, s_b, a_empty=(cu, lens), sinks=sinks)
        name, targs, _, a = recorded[-1]
        assert name == "merge_state_kernel" and targs[4:] == (1, "long long")
        assert (a["a_cu"], a["a_lens"], a["a_batch"], a["a_is64"]) == (cu.data_ptr(), lens.data_ptr(), 3, 1)
        assert a["sinks"] == sinks.data_ptr() and a["out_scale"] == a["row_mask"] == 0
    mask = torch.ones(T, dtype=torch.bool)
    zerokv.merge.merge_two(v_a, s_a, v_b, s_b, torch.empty_like(v_a), row_mask=mask)
    assert recorded[-1][3]["row_mask"] == mask.data_ptr()
    scale = torch.tensor([0.5])
    out8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out8, out_scale=scale)
    assert recorded[-1][1][1] == "zk_fp8_e4m3" and recorded[-1][3]["out_scale"] == scale.data_ptr()


def test_a_later_call_that_breaks_a_rule_is_rejected_by_name_and_launches_nothing(recorded):
    """The cheap check of a signature's later calls sends what it cannot pass to the full
    validation, whose message names the caller's argument; nothing is launched."""
    T, H, D = 16, 4, 64
    v_a, s_a, v_b, s_b = _states(T, H, D)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=torch.empty(T, H))
    recorded.clear()
    buf = torch.randn(T * H + 1)
    shifted_b, shifted_lse = buf[:-1].view(T, H), buf[1:].view(T, H)  # one element apart
    for s_b_, bad, match in [
        (s_b, torch.empty(T, H + 1), "out_lse: expected shape"),
        (s_b, torch.empty(T, H).requires_grad_(), "out_lse: requires grad"),
        (s_b, torch.empty(1, H).expand(T, H), "out_lse: dimension 0 has stride 0"),
        (shifted_b, shifted_lse, "out_lse overlaps the input s_b"),
    ]:
        with pytest.raises(ValueError, match=match):
            zerokv.merge_state(v_a, s_a, v_b, s_b_, out=out, out_lse=bad)
    with pytest.raises(ValueError, match="output_lse"):  # vLLM's names, the same plan's signature
        vllm.merge_attn_states(out, v_a, s_a.T, v_b, s_b.T, torch.empty(H + 1, T))
    with pytest.raises(ValueError, match="prefill_tokens_with_context"):
        vllm.merge_attn_states(out, v_a, s_a.T, v_b, s_b.T, None, prefill_tokens_with_context=T + 1)
    v = torch.stack([v_a, v_b])
    zerokv.merge_states(v, torch.stack([s_a, s_b]), out=out)
    recorded.clear()
    with pytest.raises(ValueError, match="out overlaps the input v|out is the same memory"):
        zerokv.merge_states(v, torch.stack([s_a, s_b]), out=v[1])
    assert recorded == []


def test_outputs_the_op_allocates(recorded):
    """Outputs left to the op: contiguous, of the call's dtypes, launched into; a given
    out_lse is written as given."""
    T, H, D = 37, 4, 64
    v = torch.randn(3, T, H, D).to(torch.bfloat16)
    s = torch.randn(3, T, H)
    for lse in (None, torch.empty(T, H)):
        out, out_lse = zerokv.merge_states(v, s, out_lse=lse)
        assert out.shape == (T, H, D) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert out_lse.shape == (T, H) and out_lse.dtype == torch.float32 and (lse is None or out_lse is lse)
        assert recorded[-1][3]["out"] == out.data_ptr() and recorded[-1][3]["olse"] == out_lse.data_ptr()
    out, out_lse = sglang.merge_state_v2(*_states(T, H, D))
    assert recorded[-1][3]["out"] == out.data_ptr() and recorded[-1][3]["olse"] == out_lse.data_ptr()
    out, out_lse = torch.ops.zerokv.merge_state(*_states(T, H, D))
    assert recorded[-1][3]["out"] == out.data_ptr() and out_lse.shape == (T, H)


@pytest.mark.parametrize("rule", [_kernels.RULE_KV_LENS_ZERO, _kernels.RULE_CONTEXT_SPAN_EMPTY])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape, pad_h", [((40, 4, 64), 0), ((40, 4, 64), 2), ((9, 3, 7), 0)])
def test_empty_rows_pack_each_argument_under_its_parameter_name(recorded, rule, index, shape, pad_h):
    T, H, D = shape
    out = torch.randn(T, H + pad_h, D, dtype=torch.bfloat16)[:, :H]
    lse = torch.randn(H, T).T
    cu = torch.tensor([0, 5, 5, 17, T], dtype=index)
    if rule == _kernels.RULE_KV_LENS_ZERO:
        lens = torch.tensor([0, 3, 0, 2], dtype=index)
        zerokv.fixup_zero_kv_rows(out, lse, lens, cu)
    else:
        lens = torch.tensor([0, 4, 4, 9, 9], dtype=index)
        zerokv.mask_empty_context(out, lse, cu, lens)
    name, targs, grid, a = recorded[-1]
    assert name == "empty_rows_kernel" and targs[2:] == (rule, int(index is torch.int64))
    assert targs[1] == (8 if D % 8 == 0 else 1)
    want = {
        "out": out.data_ptr(), "out_st": out.stride(0), "out_sh": out.stride(1), "lse": lse.data_ptr(),
        "lse_st": 1, "lse_sh": T, "cu_q": cu.data_ptr(), "q_is64": int(index is torch.int64),
        "lens": lens.data_ptr(), "batch": 4, "T": T, "H": H, "D": D, "flat": int(pad_h == 0),
    }  # fmt: skip
    assert a == want
    assert grid == min(132, -(-T * H * max(1, D // targs[1]) // 256))


def test_merge_state_common_call_takes_the_flat_kernel_unless_it_cannot(recorded):
    """The flat kernel (32-bit parameters) for the common call; the row-group kernel for an LSE
    written in place, or a stride past 32 bits on a size-1 dimension."""
    T, H, D = 64, 8, 128
    v_a, s_a, v_b, s_b = _states(T, H, D, torch.bfloat16, True)
    flat = (*BF16, 8)
    small = (*flat, 1)  # 64 blocks: a small grid
    for out, out_lse, targs in [  # the flat kernel's template arguments have four entries
        (torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(T, H), small),
        (v_a, torch.empty(T, H), small),  # V in place: one thread reads and writes each pack
        (torch.empty(T, H, D, dtype=torch.bfloat16), s_a, (*flat, 1, 0, "int")),  # LSE in place
    ]:
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
        assert recorded[-1][1] == targs
    # T = 1: the token stride is never used and may be anything, here past 32 bits
    base = torch.randn(H * D, dtype=torch.bfloat16)
    v1 = base.as_strided((1, H, D), (2**40, D, 1))
    zerokv.merge_state(v1, torch.randn(1, H), torch.randn(1, H, D, dtype=torch.bfloat16), torch.randn(1, H),
                       out=torch.empty(1, H, D, dtype=torch.bfloat16))  # fmt: skip
    assert recorded[-1][:2] == ("merge_state_kernel", (*flat, 1, 0, "int"))


def test_tensors_past_two_gigabytes_keep_32_bit_math_below_2_31_elements(recorded):
    """bf16 V of 2^30 + 8192 elements (2^31 + 16384 bytes): every element offset fits 32 bits,
    so a 32-bit flat kernel runs (the form that gathers the output LSE), for merge_state and a
    two-state merge_states. The tensors are never written, so their pages are never touched."""
    T, H, D = 2**20 + 8, 8, 128
    v_a, v_b, out = (torch.empty(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    s_a, s_b, out_lse = torch.empty(T, H), torch.empty(T, H), torch.empty(T, H)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    assert recorded[-1][:2] == ("merge_state_flat_gathered_kernel", (*BF16, 8, 0))
    del v_a, v_b
    v, s = torch.empty(2, T // 2, H, D, dtype=torch.bfloat16), torch.empty(2, T // 2, H)
    zerokv.merge_states(v, s, out=out[: T // 2], out_lse=out_lse[: T // 2])
    assert recorded[-1][:2] == ("merge_state_flat_gathered_kernel", (*BF16, 8, 0))


def test_tensors_past_2_31_elements_take_the_64_bit_flat_kernel(recorded):
    """A V whose token stride spans 2^31 elements: the flat kernel's 64-bit form in blocks of
    512 (its strides are 64-bit parameters), for merge_state and a two-state merge_states, its
    rows in the natural order for an out_lse laid [H, T] too (also at 2^22 threads); an
    unaligned call of that size takes the row-group kernel's 64-bit form. One 4.3 GB buffer,
    never written, so its pages are never touched."""
    T, H, D = 2, 8, 128
    base = torch.empty(2**31 + 2**20, dtype=torch.bfloat16)
    wide = base.as_strided((T, H, D), (2**31, D, 1))
    v_b, s_a, s_b = torch.randn(T, H, D, dtype=torch.bfloat16), torch.randn(T, H), torch.randn(T, H)
    zerokv.merge_state(
        wide, s_a, v_b, s_b, out=torch.empty(T, H, D, dtype=torch.bfloat16), out_lse=torch.empty(H, T).T
    )
    name, targs, grid, args = recorded[-1]
    assert (name, targs, grid) == ("merge_state_flat64_gathered_kernel", (*BF16, 8), 1)
    assert args["va_st"] == 2**31  # a 64-bit parameter

    v = base.as_strided((2, T, H, D), (2**31, H * D, D, 1))
    zerokv.merge_states(
        v, torch.randn(2, T, H), out=torch.empty(T, H, D, dtype=torch.bfloat16), out_lse=torch.empty(T, H)
    )
    assert recorded[-1][:3] == ("merge_state_flat64_gathered_kernel", (*BF16, 8), 1)

    # many heads of short rows, 2^22 threads: a token stride of 2^18 + 40 elements spans
    # 2^31 + 2^16 in 2^13 tokens
    Tw, Hw = 2**13, 32
    wide = base.as_strided((Tw, Hw, D), (2**18 + 40, D, 1))
    v_b, s_a, s_b = torch.empty(Tw, Hw, D, dtype=torch.bfloat16), torch.randn(Tw, Hw), torch.randn(Tw, Hw)
    for out_lse in (torch.empty(Hw, Tw).T, torch.empty(Tw, Hw)):
        zerokv.merge_state(
            wide, s_a, v_b, s_b, out=torch.empty(Tw, Hw, D, dtype=torch.bfloat16), out_lse=out_lse
        )
        assert recorded[-1][:3] == ("merge_state_flat64_gathered_kernel", (*BF16, 8), 2**13)
    v_b, s_a, s_b = torch.randn(T, H, D, dtype=torch.bfloat16), torch.randn(T, H), torch.randn(T, H)

    # unaligned (V starts one element into the buffer): no vector path, the row-group kernel
    odd = base[1:].as_strided((T, H, D), (2**31, D, 1))
    zerokv.merge_state(
        odd, s_a, v_b, s_b, out=torch.empty(T, H, D, dtype=torch.bfloat16), out_lse=torch.empty(T, H)
    )
    assert recorded[-1][:2] == ("merge_state_kernel", (*BF16, 1, 1, 0, "long long"))


def test_the_flat_kernel_takes_its_small_form_for_grids_of_one_wave(recorded):
    """SMALL = 1 up to 16 x 132 blocks of 128 threads (packs of 8 bf16: one wave on 132 SMs),
    SMALL = 0 past it, for both merges."""
    H, D = 8, 128  # 16 packs per row, 8 rows per block: T blocks
    for T, small in [(129, 1), (528, 1), (2112, 1), (2113, 0), (4095, 0)]:
        expected = ("merge_state_flat_kernel", (*BF16, 8, small), T)
        assert _both_plans(recorded, T, H, D) == (expected, expected)


def test_the_smallest_calls_take_blocks_of_heads_of_one_token(recorded):
    """Up to 2048 packs of 16 bytes, aligned calls whose rows are a power of two of at most 128
    packs take merge_state_heads_kernel: grid (head groups, T) of 128-thread blocks (T = 1: a
    one-dimensional grid); bf16 inputs in packs of 8 bytes (16 when a row would pass 128 of
    them), fp16 and float in 16 bytes; any output type; both merges. Rows of 18 or 12 packs,
    rows of 256 packs, 2049 packs and unaligned calls take the flat kernel's SMALL form."""
    heads, flat = "merge_state_heads_kernel", "merge_state_flat_kernel"
    for dtype, out_dtype, T, H, D, expected in [
        (torch.bfloat16, torch.bfloat16, 1, 8, 64, (heads, (*BF16, 4), 1)),
        (torch.bfloat16, torch.bfloat16, 1, 37, 128, (heads, (*BF16, 4), 10)),
        (torch.bfloat16, torch.bfloat16, 1, 16, 1024, (heads, (*BF16, 8), 16)),
        (torch.float16, torch.float16, 8, 8, 64, (heads, ("zk_half", "zk_half", 8), (1, 8))),
        (torch.float16, torch.float32, 1, 128, 128, (heads, ("zk_half", "float", 8), 16)),
        (torch.float32, torch.float32, 4, 8, 64, (heads, ("float", "float", 4), (1, 4))),
        (torch.bfloat16, torch.bfloat16, 32, 8, 64, (heads, (*BF16, 4), (1, 32))),
        (torch.bfloat16, torch.float32, 3, 7, 72, (flat, ("zk_bfloat16", "float", 8, 1), 2)),  # 18 packs
        (torch.float16, torch.float16, 1, 3, 96, (flat, ("zk_half", "zk_half", 8, 1), 1)),  # 12 packs
        (torch.bfloat16, torch.bfloat16, 1, 4, 2048, (flat, (*BF16, 8, 1), 8)),
        (torch.bfloat16, torch.bfloat16, 33, 8, 64, (flat, (*BF16, 8, 1), 17)),  # 2112
    ]:  # fmt: skip
        assert _both_plans(recorded, T, H, D, dtype, out_dtype) == (expected, expected), (dtype, T, H, D)
    assert _unaligned_two(recorded, 1, 8, 64) == (flat, (*BF16, 1, 1), 4)  # packs of one element


def test_calls_of_2_19_threads_take_the_gathered_form(recorded):
    """One thread per pack: 2^19 - 128 threads stay on the 128-thread form (SMALL = 0); from
    2^19 on, the 512-thread form that gathers the output LSE, its rows in tiles of 8 tokens
    with out_lse [H, T], not [T, H], up to 2^24 threads and past it; both merges. An unaligned
    call keeps the 128-thread form (the others are built for vector packs only)."""
    H, D = 8, 128  # 16 packs of 8 bf16 per row: 128 threads per token
    for ht in (False, True):
        gathered = ("merge_state_flat_gathered_kernel", (*BF16, 8, int(ht)))
        for T, expected in [
            (2**12 - 1, ("merge_state_flat_kernel", (*BF16, 8, 0), 2**12 - 1)),
            (2**12, (*gathered, 2**10)),
            (2**12 + 1, (*gathered, 2**10 + 1)),
            (2**17, (*gathered, 2**15)),
        ]:
            assert _both_plans(recorded, T, H, D, out_lse_ht=ht) == (expected, expected)
    assert _unaligned_two(recorded, 2**12, H, D) == ("merge_state_flat_kernel", (*BF16, 1, 0), 2**15)


def test_the_gathered_form_tiles_rows_by_the_layout_of_out_lse_else_of_s_a(recorded):
    """Rows in tiles of 8 tokens (TILE = 1) exactly when the LSE the kernel writes, or without
    one the LSE it reads first, has unit stride along tokens: out_lse [H, T] whatever the
    inputs, not [T, H]; without out_lse, s_a [H, T] and not [T, H]; any head count and row
    length, T not a multiple of 8."""
    for T, H, D, lse_ht, out_ht, tile in [
        (2**13, 32, 128, True, True, 1),
        (2**13 + 3, 32, 128, False, True, 1),
        (2**11 + 5, 128, 64, True, False, 0),
        (2**12, 16, 512, True, None, 1),
        (2**12, 16, 512, False, None, 0),
        (2**15, 1, 128, True, True, 1),  # one head: either layout is unit-stride along tokens
    ]:
        v_a, s_a, v_b, s_b = _states(T, H, D, torch.bfloat16, lse_ht)
        out_lse = None if out_ht is None else torch.empty(H, T).T if out_ht else torch.empty(T, H)
        zerokv.merge_state(
            v_a, s_a, v_b, s_b, out=torch.empty(T, H, D, dtype=torch.bfloat16), out_lse=out_lse
        )
        expected = ("merge_state_flat_gathered_kernel", (*BF16, 8, tile), -(-T * H * D // 8 // 512))
        assert recorded[-1][:3] == expected, (T, H, D, lse_ht, out_ht)


def _shifted(t):
    """``t``'s values one element into a fresh buffer: the data pointer loses its 16-byte
    alignment."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def test_alignment_is_part_of_the_signature(recorded):
    """An aligned call after an unaligned one of the same dtypes (and the other way round)
    keeps its own vector width: aligned inputs with an unaligned output are an unaligned call;
    the same for merge_states and the empty-row ops."""
    T, H, D = 16, 4, 64
    v_a, s_a, v_b, s_b = _states(T, H, D)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    for order in ((v_a, _shifted(v_a)), (_shifted(v_a), v_a)):
        for x in order:
            zerokv.merge_state(x, s_a, v_b, s_b)
            assert recorded[-1][1][2] == (1 if x.data_ptr() % 16 else 4)  # the heads form's bf16 packs
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=_shifted(out))
        assert recorded[-1][1][2] == 1
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)
        assert recorded[-1][1][2] == 4
    v, s = torch.stack([v_a, v_b]), torch.stack([s_a, s_b])
    for x in (_shifted(v), v, _shifted(v)):
        zerokv.merge_states(x, s)
        assert recorded[-1][1][2] == (1 if x.data_ptr() % 16 else 4)
    cu, lens = torch.tensor([0, 7, T], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    for x in (v_a.clone(), _shifted(v_a), v_a.clone()):
        zerokv.fixup_zero_kv_rows(x, torch.randn(T, H), lens, cu)
        assert recorded[-1][1][1] == (1 if x.data_ptr() % 16 else 8)


def test_vllm_reads_its_h_t_lses_as_their_transposes(recorded):
    """vLLM's [H, T] LSEs reach the kernel as the [T, H] layout (token stride 1) without a
    view made per call, the same launch as merge_state with ``.T`` views; an LSE of the wrong
    shape is reported in vLLM's terms."""
    T, H, D = 40, 4, 64
    v_a, _, v_b, _ = _states(T, H, D)
    p_lse, s_lse, o_lse = torch.randn(H, T), torch.randn(H, T), torch.empty(H, T)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    vllm.merge_attn_states(out, v_a, p_lse, v_b, s_lse, o_lse)
    name, targs, grid, a = recorded[-1]
    assert (a["sa"], a["sa_st"], a["sa_sh"], a["ol_st"], a["ol_sh"]) == (p_lse.data_ptr(), 1, T, 1, T)
    assert a["suffix_verbatim"] == 1
    zerokv.merge.merge_two(v_a, p_lse.T, v_b, s_lse.T, out, o_lse.T, suffix_verbatim=True, allocate_lse=False)
    assert recorded[-1][:3] == (name, targs, grid) and recorded[-1][3] == a
    with pytest.raises(ValueError, match=r"prefix_lse: expected shape \(4, 40\) \(num_heads, num_tokens\)"):
        vllm.merge_attn_states(out, v_a, p_lse.T.contiguous(), v_b, s_lse, o_lse)


def test_other_producers_take_the_same_path(recorded):
    """Arrays of another producer (numpy here, read through DLPack's facts as CuPy's are) are
    read into the same facts and launch what the same torch tensors launch; a later call with
    a partial overlap is rejected by name."""
    np = pytest.importorskip("numpy")
    T, H, D = 33, 4, 64
    v_a, s_a, v_b, s_b = (x.float() for x in _states(T, H, D))
    out, out_lse = torch.empty(T, H, D), torch.empty(T, H)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    want = recorded[-1]
    arrays = [x.numpy() for x in (v_a, s_a, v_b, s_b, out, out_lse)]
    for _ in range(2):  # the plan's first call, then its cheap check
        zerokv.merge_state(*arrays[:4], out=arrays[4], out_lse=arrays[5])
        assert recorded[-1] == want
    buf = np.zeros(T * H + 1, dtype=np.float32)
    with pytest.raises(ValueError, match="out_lse overlaps the input s_b"):
        zerokv.merge_state(*arrays[:3], buf[:-1].reshape(T, H), out=arrays[4], out_lse=buf[1:].reshape(T, H))


def test_inference_outputs_under_inference_mode_take_the_cheap_check(recorded, monkeypatch):
    """Engines run under ``torch.inference_mode()``, where outputs are inference tensors: a
    later call of a signature passes the cheap check (the full validation does not run again)
    for every op; outside inference mode the same outputs are still refused by name."""
    from zerokv.core import checks as _checks

    full = []
    writable = _checks.writable
    monkeypatch.setattr(_checks, "writable", lambda t, arg: (full.append(arg), writable(t, arg))[1])
    T, H, D = 16, 4, 64
    v_a, s_a, v_b, s_b = _states(T, H, D)
    cu = torch.tensor([0, 5, T], dtype=torch.int32)
    kv = torch.tensor([0, 3], dtype=torch.int32)
    with torch.inference_mode():
        out, out_lse = torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(T, H)
        v, s = torch.stack([v_a, v_b]), torch.stack([s_a, s_b])
        calls = [
            lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse),
            lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse, a_empty=(cu, kv)),
            lambda: vllm.merge_attn_states(out, v_a, s_a.T.contiguous(), v_b, s_b.T.contiguous(), None),
            lambda: zerokv.merge_states(v, s, out=out, out_lse=out_lse),
            lambda: zerokv.fixup_zero_kv_rows(out, out_lse, kv, cu),
        ]
        for call in calls:
            call()
            first, launched = len(full), len(recorded)
            assert first > 0  # the first call of a signature: every check, writable included
            call()
            assert len(full) == first, "a later call ran the full validation again"
            assert len(recorded) == launched + 1
    recorded.clear()
    with pytest.raises(ValueError, match="out: is an inference tensor"):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=torch.empty(T, H))
    assert recorded == []


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_empty_past_the_window_takes_the_runs(recorded, index_dtype):
    """[T, H] below the runs' threshold: up to A_WINDOW requests (int32) the one-pass form, past
    them (its search would go to global memory) and with int64 offsets the runs; the batch's
    class is part of the form's key on the first call of a signature and on the generated one."""
    T, H, D = 4200, 8, 128
    va, sa, vb, sb = _states(T, H, D)
    out, lse = torch.empty_like(va), torch.empty(T, H)
    W = _kernels.A_WINDOW
    for B in (W, W + 1, W, W + 1, 1, 400):
        cu = torch.linspace(0, T, B + 1).round().to(index_dtype)
        lens = torch.arange(B, dtype=index_dtype) % 3
        zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse, a_empty=(cu, lens))
        name, targs, _, args = recorded[-1]
        runs = B > W or index_dtype == torch.int64
        assert name == "merge_state_flat_gathered_kernel" and args["a_batch"] == B
        assert targs[-1] == _kernels.F_A_EMPTY | (_kernels.F_A64 if index_dtype == torch.int64 else 0) | (
            _kernels.F_A_RUN if runs else 0
        ), (B, targs)
