"""zerokv.compat.flashinfer against FlashInfer's wrappers: an LSE of another floating dtype is
converted to float32 first (as ``s.to(torch.float32)``), ``merge_states`` of N = 0 states gives
(0, -inf), and the in-place form leaves a non-float32 ``s`` as it was. The oracles compute in
base 2 on their own (``oracles.merge`` with ``base=2``, attention over split keys in base-2
units), never through zerokv's reference. CPU always; the same on the GPU."""

from __future__ import annotations

import math

import numpy as np
import oracles
import pytest
import torch
from conftest import assert_close, f64

from zerokv.compat import flashinfer as fi

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
T, H, D = 37, 4, 64


def _states(device, lse_dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    v_a, v_b = (torch.randn(T, H, D, generator=g).to(device) for _ in range(2))
    s_a, s_b = ((torch.randn(T, H, generator=g) * 3).to(lse_dtype).to(device) for _ in range(2))
    return v_a, s_a, v_b, s_b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lse_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_merge_state_converts_the_lse_as_flashinfer(device, lse_dtype):
    v_a, s_a, v_b, s_b = _states(device, lse_dtype)
    out, lse = fi.merge_state(v_a, s_a, v_b, s_b)
    assert lse.dtype == torch.float32 and out.dtype == v_a.dtype
    want_v, want_s = oracles.merge2(f64(v_a), f64(s_a.float()), f64(v_b), f64(s_b.float()), base=2)
    assert_close(out, want_v, torch.float32, "V")
    assert_close(lse, want_s, torch.float32, "LSE")
    assert s_a.dtype == lse_dtype  # the caller's LSE is not changed


def test_numpy_bf16_lse():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    v_a, s_a, v_b, s_b = (x.numpy() for x in _states("cpu", torch.float32))
    out, lse = fi.merge_state(v_a, s_a.astype(ml_dtypes.bfloat16), v_b, s_b.astype(ml_dtypes.bfloat16))
    want_v, want_s = oracles.merge2(
        v_a, s_a.astype(ml_dtypes.bfloat16).astype(np.float64), v_b,
        s_b.astype(ml_dtypes.bfloat16).astype(np.float64), base=2,
    )  # fmt: skip
    assert lse.dtype == np.float32
    assert_close(out, want_v, torch.float32, "V")
    assert_close(lse, want_s, torch.float32, "LSE")


@pytest.mark.parametrize("lse_dtype", [torch.int32, torch.bool])
def test_an_integer_lse_is_a_type_error_naming_it(lse_dtype):
    v_a, s_a, v_b, s_b = _states("cpu", torch.float32)
    with pytest.raises(TypeError, match="s_b"):
        fi.merge_state(v_a, s_a, v_b, s_b.to(lse_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_with_a_bf16_lse_updates_v_only(device):
    v, s, v_other, s_other = _states(device, torch.bfloat16)
    v0, s0 = v.clone(), s.clone()
    fi.merge_state_in_place(v, s, v_other, s_other)
    want_v, _ = oracles.merge2(f64(v0), f64(s0.float()), f64(v_other), f64(s_other.float()), base=2)
    assert_close(v, want_v, torch.float32, "V")
    assert torch.equal(s, s0)  # FlashInfer updates a float32 copy of s: the caller's s keeps its values


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_with_a_float32_lse_updates_both(device):
    v, s, v_other, s_other = _states(device, torch.float32)
    v0, s0 = v.clone(), s.clone()
    fi.merge_state_in_place(v, s, v_other, s_other)
    want_v, want_s = oracles.merge2(f64(v0), f64(s0), f64(v_other), f64(s_other), base=2)
    assert_close(v, want_v, torch.float32, "V")
    assert_close(s, want_s, torch.float32, "LSE")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_states_of_no_states_is_the_empty_state(device, dtype):
    v = torch.randn(T, 0, H, D).to(dtype).to(device)
    s = torch.randn(T, 0, H).to(device)
    out, lse = fi.merge_states(v, s)
    assert out.shape == (T, H, D) and out.dtype == dtype and out.device.type == device
    assert lse.shape == (T, H) and lse.dtype == torch.float32
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_merge_states_of_no_states_numpy():
    out, lse = fi.merge_states(np.ones((T, 0, H, D), np.float16), np.ones((T, 0, H), np.float32))
    assert out.dtype == np.float16 and out.shape == (T, H, D) and not out.any()
    assert lse.dtype == np.float32 and np.isneginf(lse).all()


@pytest.mark.parametrize("device", DEVICES)
def test_merge_states_converts_a_bf16_lse(device):
    g = torch.Generator().manual_seed(9)
    v = torch.randn(T, 3, H, D, generator=g).to(device)
    s = (torch.randn(T, 3, H, generator=g) * 2).bfloat16().to(device)
    out, lse = fi.merge_states(v, s)
    want_v, want_s = oracles.merge(f64(v.transpose(0, 1)), f64(s.float().transpose(0, 1)), base=2)
    assert_close(out, want_v, torch.float32, "V")
    assert_close(lse, want_s, torch.float32, "LSE")
    assert lse.dtype == torch.float32 and math.isfinite(float(lse.sum()))


# --- base 2 from attention itself: chunk states of split keys merge to attention over all keys ---


def _split_keys(device, seed, N=4, T=9, H=3, D=16, L=30):
    """States of attention over N chunks of the keys in base-2 units (one chunk empty, as FA2
    leaves it: +inf and NaN V), as float32 tensors ``V [T, N, H, D]``, ``S [T, N, H]``, and
    attention over all keys, float64."""
    q, k, v = oracles.random_attention(T, H, D, L, seed)
    bounds = oracles.random_bounds(L, N, np.random.default_rng(seed))
    vs, ss = oracles.chunk_states(q, k, v, bounds, base=2, empty_as="fa2", seed=seed)
    assert np.isinf(ss).any() and np.isfinite(ss).any()
    to = lambda x: torch.from_numpy(np.ascontiguousarray(x)).float().to(device)  # noqa: E731
    vs32, ss32 = to(vs.swapaxes(0, 1)), to(ss.swapaxes(0, 1))
    return vs32, ss32, oracles.attention(q, k, v, base=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [1, 2])
def test_merge_states_of_split_keys_is_base_2_attention(device, seed):
    v, s, (want_v, want_s) = _split_keys(device, seed)
    out, lse = fi.merge_states(v, s)
    # the chunk states were rounded to float32: the float32 bound (their rounding moves the weights)
    assert_close(out, want_v, torch.float32, "V", roundings=2, arithmetic="float32")
    assert_close(lse, want_s, torch.float32, "LSE", roundings=2, arithmetic="float32")
    exact = oracles.merge(f64(v.transpose(0, 1)), f64(s.transpose(0, 1)), base=2)
    assert_close(out, exact[0], torch.float32, "V of the float32 states")
    assert_close(lse, exact[1], torch.float32, "LSE of the float32 states")


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_folded_over_split_keys_is_base_2_attention(device):
    """merge_state, then merge_state_in_place, over the chunks in turn: base-2 attention."""
    v, s, (want_v, want_s) = _split_keys(device, seed=3)
    acc_v, acc_s = fi.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    for i in range(2, v.shape[1]):
        fi.merge_state_in_place(acc_v, acc_s, v[:, i].contiguous(), s[:, i].contiguous())
    n = v.shape[1]
    assert_close(acc_v, want_v, torch.float32, "V", roundings=2 * n, arithmetic="float32")
    assert_close(acc_s, want_s, torch.float32, "LSE", roundings=2 * n, arithmetic="float32")
