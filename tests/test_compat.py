"""The engine adapters: exact signatures, their conventions (layout, LSE base), their edges; the
values against the independent oracles (``oracles.py``), on the CPU path and the GPU alike."""

from __future__ import annotations

import numpy as np
import oracles
import pytest
import torch
from batches import check_empty_rows, empty_rows, garbage_state, make_batch
from conftest import assert_close, f64
from states import INF, NAN, make_states

import zerokv
from zerokv.compat import flashinfer, sglang, vllm

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _states(T, H, D, dtype, device, seed=0, edges=True):
    return make_states(T, H, D, dtype, device, seed=seed, edges=edges)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_vllm_merge_attn_states_hn_layout(device, dtype):
    T, H, D = 300, 8, 64
    v_p, s_p, v_s, s_s = _states(T, H, D, dtype, device, seed=1)
    p_lse, s_lse = s_p.T.contiguous(), s_s.T.contiguous()  # vLLM's [H, T]
    output = torch.full_like(v_p, NAN)
    output_lse = torch.full((H, T), NAN, device=device)
    assert vllm.merge_attn_states(output, v_p, p_lse, v_s, s_lse, output_lse) is None
    ref_out, ref_lse = oracles.merge2(*(f64(x) for x in (v_p, s_p, v_s, s_s)))
    assert_close(output, ref_out, dtype, "output")
    assert_close(output_lse.T, ref_lse, torch.float32, "output_lse")


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_prefill_tokens_with_context_copies_the_suffix_verbatim(device):
    T, H, D, k = 64, 4, 32, 40
    v_p, s_p, v_s, s_s = _states(T, H, D, torch.float16, device, seed=2, edges=False)
    s_s[50, 1] = INF  # FA2's empty marker past the cutoff: vLLM keeps it as it is
    v_s[50, 1] = NAN
    s_s[k, 2] = INF  # at the cutoff row itself
    v_s[k, 2] = NAN
    output = torch.full_like(v_p, NAN)
    output_lse = torch.full((H, T), NAN, device=device)
    vllm.merge_attn_states(output, v_p, s_p.T, v_s, s_s.T, output_lse, prefill_tokens_with_context=k)
    assert torch.equal(output[k:].isnan(), v_s[k:].isnan())
    assert torch.equal(output[k:].nan_to_num(), v_s[k:].nan_to_num())
    assert torch.equal(output_lse.T[k:], s_s[k:])
    ref_out, ref_lse = oracles.merge2(*(f64(x)[:k] for x in (v_p, s_p, v_s, s_s)))
    assert_close(output[:k], ref_out, torch.float16)
    assert_close(output_lse.T[:k], ref_lse, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("marker", [INF, -INF])
@pytest.mark.parametrize("k", [1, 40, 63])
def test_the_cutoff_row_holds_an_empty_suffix(device, marker, k):
    """Rows k - 1 (the last merged) and k (the first past the cutoff) hold an empty state b
    (``marker``, NaN V) in every head. vLLM merges row k - 1 (a alone) and copies row k as it
    is (the marker and the NaN); the native ``prefix_rows`` gives row k the empty state."""
    T, H, D = 64, 3, 16
    v_p, s_p, v_s, s_s = _states(T, H, D, torch.float32, device, seed=4, edges=False)
    for row in (k - 1, k):
        s_s[row], v_s[row] = marker, NAN
    output, output_lse = torch.full_like(v_p, NAN), torch.full((H, T), NAN, device=device)
    vllm.merge_attn_states(output, v_p, s_p.T, v_s, s_s.T, output_lse, prefill_tokens_with_context=k)
    want = oracles.merge2(v_p, s_p, v_s, s_s, prefix_rows=k, verbatim=True)
    assert_close(output, want[0], torch.float32, "vLLM out")
    assert_close(output_lse.T, want[1], torch.float32, "vLLM lse")
    assert output[k].isnan().all() and (output_lse[:, k] == marker).all()  # row k: verbatim
    out, lse = zerokv.merge_state(v_p, s_p, v_s, s_s, prefix_rows=k)
    want = oracles.merge2(v_p, s_p, v_s, s_s, prefix_rows=k)
    assert_close(out, want[0], torch.float32, "native out")
    assert_close(lse, want[1], torch.float32, "native lse")
    assert (out[k] == 0).all() and (lse[k] == -INF).all()  # row k: the empty rule


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_both_empty_gives_zero_and_minus_inf_and_no_lse_when_none(device):
    v_p, s_p, v_s, s_s = _states(8, 2, 16, torch.bfloat16, device, seed=3, edges=False)
    s_p[:] = -INF
    s_s[:] = -INF
    v_p[:] = NAN  # scratch garbage
    kept = s_p.clone(), s_s.clone()
    output = torch.full_like(v_p, NAN)
    vllm.merge_attn_states(output, v_p, s_p.T, v_s, s_s.T)
    assert (output == 0).all()
    # no output_lse: the LSE inputs (the only LSE buffers in reach) are left as they were
    assert torch.equal(s_p, kept[0]) and torch.equal(s_s, kept[1])
    # with an output_lse: -inf in every entry of the [H, T] buffer
    output = torch.full_like(v_p, NAN)
    output_lse = torch.full((2, 8), NAN, device=device)
    vllm.merge_attn_states(output, v_p, s_p.T, v_s, s_s.T, output_lse)
    assert (output == 0).all()
    assert (output_lse == -INF).all()


def test_vllm_errors_name_vllm_arguments():
    v_p, s_p, v_s, s_s = _states(8, 2, 16, torch.float32, "cpu", edges=False)
    out = torch.empty_like(v_p)
    with pytest.raises(ValueError, match="suffix_lse"):
        vllm.merge_attn_states(out, v_p, s_p.T, v_s, s_s.T[:1])
    with pytest.raises(TypeError, match="suffix_output"):
        vllm.merge_attn_states(out, v_p, s_p.T, v_s.half(), s_s.T)
    with pytest.raises(TypeError, match="prefill_tokens_with_context"):
        vllm.merge_attn_states(out, v_p, s_p.T, v_s, s_s.T, prefill_tokens_with_context=2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_output", [False, True])
def test_vllm_mask_empty_context(device, flat_output):
    cu, kv = make_batch(20, 30, "random", seed=4)
    rows = empty_rows(cu, kv)
    T, H, D = int(cu[-1]), 4, 64
    out, lse_th = garbage_state(T, H, D, torch.bfloat16, rows, device, 5, lse_ht=True)
    lse_hn = lse_th.T  # the [H, T] buffer itself
    before = out.clone(), lse_th.clone()
    cu_kv = torch.cat([torch.zeros(1, dtype=kv.dtype), kv.cumsum(0).to(kv.dtype)])
    target = out.view(T, H * D) if flat_output else out
    vllm.mask_empty_context(lse_hn, target, cu.to(device), cu_kv.to(device))
    check_empty_rows(out, lse_th, *before, rows)


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_merge_state_v2(device):
    v_a, s_a, v_b, s_b = _states(129, 16, 72, torch.bfloat16, device, seed=6)
    v, s = sglang.merge_state_v2(v_a, s_a, v_b, s_b)
    ref_out, ref_lse = oracles.merge2(*(f64(x) for x in (v_a, s_a, v_b, s_b)))
    assert_close(v, ref_out, torch.bfloat16)
    assert_close(s, ref_lse, torch.float32)
    # in place into v_a, s_merged allocated; an LSE given in another float dtype is converted
    keep = v_a.clone()
    v2, s2 = sglang.merge_state_v2(keep, s_a.double(), v_b, s_b, v_merged=keep)
    assert v2 is keep and s2.dtype == torch.float32
    assert_close(v2, ref_out, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_fixup_ignores_a_too_small_max_seq_len(device):
    cu, kv = make_batch(12, 40, "random", seed=7)
    rows = empty_rows(cu, kv)
    out, lse = garbage_state(int(cu[-1]), 8, 128, torch.float16, rows, device, 8, lse_ht=False)
    before = out.clone(), lse.clone()
    sglang.fixup_zero_kv_rows(out, lse, kv.to(device), cu.to(device), 1)
    check_empty_rows(out, lse, *before, rows)


@pytest.mark.parametrize("device", DEVICES)
def test_flashinfer_merge_state_is_base_2(device):
    v_a, s_a, v_b, s_b = _states(200, 8, 128, torch.float16, device, seed=9)
    v, s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    ref_out, ref_lse = oracles.merge2(*(f64(x) for x in (v_a, s_a, v_b, s_b)), base=2)
    assert_close(v, ref_out, torch.float16)
    assert_close(s, ref_lse, torch.float32)
    fin = np.isfinite(ref_lse)
    natural = oracles.merge2(*(f64(x) for x in (v_a, s_a, v_b, s_b)))[1]
    assert (
        np.isfinite(natural[fin]).all() and (np.abs(natural[fin] - ref_lse[fin]) > 0.1).any()
    )  # the base matters


@pytest.mark.parametrize("device", DEVICES)
def test_flashinfer_merge_state_in_place_with_mask(device):
    T = 100
    v, s, v_o, s_o = _states(T, 4, 64, torch.bfloat16, device, seed=10)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(0)) < 0.5
    before = v.clone(), s.clone()
    ref_out, ref_lse = oracles.merge2(*(f64(x) for x in (v, s, v_o, s_o)), base=2)
    flashinfer.merge_state_in_place(v, s, v_o, s_o, mask=mask.to(device))
    m = mask.numpy()
    assert_close(v[mask.to(device)], ref_out[m], torch.bfloat16)
    assert_close(s[mask.to(device)], ref_lse[m], torch.float32)
    off = (~mask).to(device)
    assert torch.equal(v[off].view(torch.int16), before[0][off].view(torch.int16))
    assert torch.equal(s[off].view(torch.int32), before[1][off].view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_flashinfer_merge_states_tnhd(device):
    T, N, H, D = 65, 5, 8, 64
    states = [_states(T, H, D, torch.float32, device, seed=20 + i) for i in range(N)]
    v = torch.stack([st[0] for st in states], dim=1)  # [T, N, H, D]
    s = torch.stack([st[1] for st in states], dim=1)
    V, S = flashinfer.merge_states(v, s)
    ref_out, ref_lse = oracles.merge(f64(v.transpose(0, 1)), f64(s.transpose(0, 1)), base=2)
    assert_close(V, ref_out, torch.float32)
    assert_close(S, ref_lse, torch.float32)
