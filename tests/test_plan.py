"""plan_context_chunks: CPU-only chunk metadata and flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zerokv


def _check_plan(q, ctx, budget, align=1):
    plan = zerokv.plan_context_chunks(q, ctx, budget, align=align)
    q, ctx = np.asarray(q), np.asarray(ctx)
    lens, starts, cu_kv = (np.asarray(x) for x in (plan.lens, plan.starts, plan.cu_seqlens_kv))
    C, B = plan.num_chunks, q.shape[0]
    assert lens.shape == (C, B) and starts.shape == (C, B) and cu_kv.shape == (C, B + 1)
    for arr in (plan.lens, plan.starts, plan.cu_seqlens_kv, plan.cu_seqlens_q, plan.max_seqlen_kv):
        assert arr.dtype in (np.int32, torch.int32)
    assert plan.chunk_width % align == 0
    # every context token of every request lies in exactly one chunk, in order
    for i in range(B):
        covered = np.zeros(ctx[i], dtype=int)
        for c in range(C):
            covered[starts[c, i] : starts[c, i] + lens[c, i]] += 1
            assert lens[c, i] <= plan.chunk_width
        assert (covered == 1).all()
    assert (lens.sum(axis=1) <= budget).all()
    np.testing.assert_array_equal(cu_kv[:, 1:] - cu_kv[:, :-1], lens)
    np.testing.assert_array_equal(np.asarray(plan.cu_seqlens_q), np.concatenate([[0], np.cumsum(q)]))
    np.testing.assert_array_equal(np.asarray(plan.max_seqlen_kv), lens.max(axis=1, initial=0))
    empty_rows = ((lens == 0) * q).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(plan.num_empty_rows), empty_rows)
    np.testing.assert_array_equal(np.asarray(plan.has_empty), empty_rows > 0)
    np.testing.assert_array_equal(np.asarray(plan.all_rows_active), empty_rows == 0)
    return plan


def test_hand_made_batch():
    plan = _check_plan(torch.tensor([3, 0, 5, 2]), torch.tensor([10, 0, 25, 4]), 24)
    assert plan.num_chunks == 4 and plan.chunk_width == 8  # 3 requests with context share 24
    assert plan.lens.tolist() == [[8, 0, 8, 4], [2, 0, 8, 0], [0, 0, 8, 0], [0, 0, 1, 0]]
    assert plan.has_empty.tolist() == [False, True, True, True]
    assert plan.num_empty_rows.tolist() == [0, 2, 5, 5]
    assert isinstance(plan.lens, torch.Tensor) and plan.lens.device.type == "cpu"


def test_no_context_at_all_means_no_chunks():
    plan = _check_plan(np.array([4, 1]), np.array([0, 0]), 16)
    assert plan.num_chunks == 0 and isinstance(plan.lens, np.ndarray)


def test_align_rounds_the_width_down():
    plan = _check_plan([1, 1, 1], [100, 37, 64], 100, align=16)
    assert plan.chunk_width == 32


@pytest.mark.parametrize("seed", range(20))
def test_random_batches(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 40))
    q = rng.integers(0, 6, B)
    ctx = rng.integers(0, 300, B) * (rng.random(B) < 0.8)
    budget = int(rng.integers(B, 2000))
    _check_plan(q, ctx, budget, align=int(rng.choice([1, 1, 4])) if budget >= 4 * B else 1)


@pytest.mark.parametrize(
    "q, ctx, budget, exc, needle",
    [
        ([1, 2], [3], 8, ValueError, "batch sizes"),
        ([], [], 8, ValueError, "empty"),
        ([1, -2], [3, 4], 8, ValueError, "negative"),
        ([[1, 2]], [[3, 4]], 8, ValueError, "1-D"),
        ([1, 2], [3, 4], 0, ValueError, "chunk_tokens"),
        ([1, 2], [3, 4], 1, ValueError, "too small"),
        ([1, 2], [3, 4], 2.5, TypeError, "chunk_tokens"),
        ([1.0, 2.0], [3, 4], 8, TypeError, "query_lens"),
    ],
)
def test_errors(q, ctx, budget, exc, needle):
    with pytest.raises(exc, match=needle):
        zerokv.plan_context_chunks(q, ctx, budget)


def test_lengths_off_the_cpu_are_rejected():
    with pytest.raises(ValueError, match="CPU"):
        zerokv.plan_context_chunks(torch.tensor([1], device="meta"), torch.tensor([2]), 8)
