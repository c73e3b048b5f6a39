"""A checked call's facts against the tensors and the one home of alignment (core/layout.py).

``facts.of`` of each op's spec holds a signature's first call and the calls its bound call
does not take, from the full validation: random strided layouts, offsets and LSE orientations
are validated and each pointer and stride, and the signature's alignment, compared with the
tensors and ``layout.aligned``. (The bound calls' byte ends and overlaps: tests/test_bound_calls.py and
tests/test_checks.py.)
"""

from __future__ import annotations

import random

import pytest
import torch

from zerokv.core import facts as _facts
from zerokv.core import layout as _layout
from zerokv.core import spec as _spec
from zerokv.core import validation as _validation

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _strided(rng, T, H, D, dtype, pad_h, pad_t, offset):
    """A [T, H, D] view of a larger buffer: head and token strides padded, start offset."""
    sh = D + pad_h
    st = H * sh + pad_t
    base = torch.randn(offset + T * st + 8, dtype=torch.float32).to(dtype)
    return base.as_strided((T, H, D), (st, sh, 1), offset)


def _lse(rng, T, H, ht, pad, offset):
    """A [T, H] float32 LSE view, or with ``ht`` the [H, T] buffer vLLM keeps."""
    if ht:
        base = torch.randn(offset + H * (T + pad) + 4)
        return base.as_strided((H, T), (T + pad, 1), offset)
    base = torch.randn(offset + T * (H + pad) + 4)
    return base.as_strided((T, H), (H + pad, 1), offset)


@pytest.mark.parametrize("seed", range(40))
def test_the_facts_of_two_hold_each_tensor_and_its_alignment_is_layout_aligned(seed):
    rng = random.Random(seed)
    T, H, D = rng.randint(1, 40), rng.randint(1, 9), rng.choice((8, 16, 64, 128))
    dtype, ht = rng.choice(DTYPES), rng.random() < 0.3

    def v():
        return _strided(
            rng, T, H, D, dtype, rng.choice((0, 0, 8, 3)), rng.choice((0, 8, 5)), rng.choice((0, 8, 1))
        )

    def s():
        return _lse(rng, T, H, ht, rng.choice((0, 3)), rng.choice((0, 1)))

    va, vb, out, sa, sb, ol = v(), v(), v(), s(), s(), s()
    objs = (va, sa, vb, sb, out, ol, None, None, None, None, None)
    views = (va, sa.t(), vb, sb.t(), out, ol.t(), *objs[6:]) if ht else objs  # [H, T]: read as [T, H]
    f = _facts.of(_spec.MERGE_STATE, _validation.validate(_spec.MERGE_STATE, views, {"lse_base": "e"}), objs)
    assert f.objs is objs and f.device == -1 and f.torch
    for name, t in (("va", va), ("vb", vb), ("out", out)):
        assert (getattr(f, name), getattr(f, f"{name}_st"), getattr(f, f"{name}_sh")) == (
            t.data_ptr(),
            *t.stride()[:2],
        )
    for name, t in (("sa", sa), ("sb", sb), ("ol", ol)):
        st = t.stride()[::-1] if ht else t.stride()
        ptr = getattr(f, "olse" if name == "ol" else name)
        assert (ptr, getattr(f, f"{name}_st"), getattr(f, f"{name}_sh")) == (t.data_ptr(), *st)
    assert (f.T, f.H, f.D) == (T, H, D)
    w = _layout.vec(va.element_size())
    aligned = all(
        _layout.aligned(
            t.data_ptr(), t.element_size(), w, t.stride(0) | t.stride(1) | (D if t is not out else 0)
        )
        for t in (va, vb, out)
    )
    assert f.sig[-2] == aligned


@pytest.mark.parametrize("seed", range(20))
def test_the_facts_of_n_and_of_the_row_ops_alignment_is_layout_aligned(seed):
    rng = random.Random(seed)
    N, T, H, D = rng.randint(1, 4), rng.randint(1, 30), rng.randint(1, 8), rng.choice((8, 16, 128))
    dtype = rng.choice(DTYPES)
    off = rng.choice((0, 1, 8))
    v = torch.randn(off + N * T * H * (D + 8) + 8).to(dtype)
    v = v.as_strided((N, T, H, D), (T * H * (D + 8), H * (D + 8), D + 8, 1), off)
    s = torch.randn(N, T, H)
    f = _facts.of(
        _spec.MERGE_STATES, _validation.validate(_spec.MERGE_STATES, (v, s), {"lse_base": "e"}), (v, s)
    )
    w = _layout.vec(v.element_size())
    st = v.stride()
    assert f.sig[-2] == _layout.aligned(v.data_ptr(), v.element_size(), w, st[0] | st[1] | st[2] | D)
    assert (f.v, f.v_sn, f.v_st, f.v_sh, f.s_sn, f.s_st, f.s_sh) == (v.data_ptr(), *st[:3], *s.stride())
    out = _strided(rng, T, H, D, dtype, rng.choice((0, 8, 3)), 0, off)
    cu, lens = torch.tensor([0, T], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    objs = (out, torch.randn(T, H), cu, lens)
    r = _facts.of(_spec.FIXUP_ZERO_KV_ROWS, _validation.validate(_spec.FIXUP_ZERO_KV_ROWS, objs), objs)
    want = _layout.aligned(out.data_ptr(), out.element_size(), w, out.stride(0) | out.stride(1) | D)
    assert r.sig[-2] == want and (r.out_st, r.out_sh, r.batch) == (*out.stride()[:2], 1)
