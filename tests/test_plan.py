"""plan_context_chunks: CPU-only chunk metadata and flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zerokv


def _expected_chunks(ctx, budget, align):
    """The chunking rule of the docstring, request by request in Python ints: W = (budget // R)
    rounded down to a multiple of ``align`` (R: requests with context), C = ceil(max / W),
    request i's chunk c the tokens [c W, (c + 1) W) of its context."""
    ctx = [int(n) for n in ctx]
    R = 0
    for n in ctx:
        if n > 0:
            R += 1
    W = budget // max(R, 1)
    W -= W % align
    assert max(ctx) // W < 10**6, "a plan this check counts chunk by chunk"
    C = 0
    while max(ctx) > C * W:  # the fewest chunks of W tokens that hold the longest context
        C += 1
    starts = [[min(c * W, n) for n in ctx] for c in range(C)]
    lens = [[max(0, min(n, (c + 1) * W) - c * W) for n in ctx] for c in range(C)]
    return W, C, starts, lens


def _check_plan(q, ctx, budget, align=1):
    plan = zerokv.plan_context_chunks(q, ctx, budget, align=align)
    W, C, want_starts, want_lens = _expected_chunks(np.asarray(ctx).tolist(), budget, align)
    assert (plan.chunk_width, plan.num_chunks) == (W, C)
    assert np.asarray(plan.starts).tolist() == want_starts or C == 0
    assert np.asarray(plan.lens).tolist() == want_lens or C == 0
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


def test_the_width_counts_only_requests_with_context():
    """Five requests, two with context: W = 40 // 2 = 20 (not 40 // 5), C = ceil(45 / 20) = 3;
    aligned to 8: W = 16, C = 3."""
    plan = _check_plan([1, 2, 3, 4, 5], [0, 45, 0, 7, 0], 40)
    assert (plan.chunk_width, plan.num_chunks) == (20, 3)
    plan = _check_plan([1, 2, 3, 4, 5], [0, 45, 0, 7, 0], 40, align=8)
    assert (plan.chunk_width, plan.num_chunks) == (16, 3)


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


# --- values are checked before anything is cast or allocated ---------------------------------


@pytest.mark.parametrize(
    "q, ctx, budget, exc, needle",
    [
        (np.array([2**63, 1], np.uint64), [3, 4], 8, ValueError, "query_lens: length 9223372036854775808"),
        (
            [1, 2],
            np.array([1, 2**64 - 1], np.uint64),
            8,
            ValueError,
            "context_lens: length 18446744073709551615",
        ),
        ([1], [2**31], 8, ValueError, "context_lens: length 2147483648 at index 0 exceeds int32"),
        ([2**31 - 1, 1], [1, 1], 8, ValueError, "query_lens: the total 2147483648 exceeds int32"),
        ([1, 1], [2**31 - 1, 2**31 - 1], 2**32, ValueError, "chunk_tokens: a chunk of 4294967294"),
        ([1], [10**12], 1, ValueError, "context_lens"),
        ([1], [2**31 - 1], 1, ValueError, "plan entries"),
        ([1], [2], 2**63, ValueError, "chunk_tokens: expected at most 2"),
        (torch.tensor([1.0]), [2], 8, TypeError, "query_lens: expected integers, got dtype torch.float32"),
        (torch.tensor([1.0], requires_grad=True), [2], 8, TypeError, "query_lens: expected integers"),
        (torch.tensor([True]), [2], 8, TypeError, "query_lens: expected integers"),
        ([1], np.array([2.0]), 8, TypeError, "context_lens: expected integers"),
        ([1], np.array([True]), 8, TypeError, "context_lens: expected integers"),
        (None, [2], 8, TypeError, "query_lens"),
        (5, [2], 8, TypeError, "query_lens"),
        (["a"], [2], 8, TypeError, "query_lens"),
        ([1], [2], True, TypeError, "chunk_tokens"),
        ([1], [2], np.float32(8), TypeError, "chunk_tokens"),
        ([1], [2], -8, ValueError, "chunk_tokens"),
    ],
)
def test_bad_values_are_refused_before_casting(q, ctx, budget, exc, needle):
    with pytest.raises(exc, match=needle):
        zerokv.plan_context_chunks(q, ctx, budget)


@pytest.mark.parametrize(
    "align, exc", [(0, ValueError), (-4, ValueError), (1.0, TypeError), (2**64, ValueError)]
)
def test_bad_align(align, exc):
    with pytest.raises(exc, match="align"):
        zerokv.plan_context_chunks([1], [2], 8, align=align)


def test_a_huge_context_is_refused_without_allocating(monkeypatch):
    """[1], [10**12], 1 would be 10^12 chunks: refused before numpy is asked for memory."""
    calls = []
    for name in ("zeros", "arange", "empty"):
        real = getattr(np, name)
        monkeypatch.setattr(
            np, name, lambda *a, _real=real, _name=name, **k: calls.append((_name, a)) or _real(*a, **k)
        )
    for ctx, needle in (([10**12], "context_lens: length 1000000000000"), ([2**31 - 1], "plan entries")):
        with pytest.raises(ValueError, match=needle):
            zerokv.plan_context_chunks([1], ctx, 1)
    assert calls == []


def test_uint64_lengths_that_fit_are_planned_like_int64():
    plan = _check_plan(np.array([3, 0, 5], np.uint64), np.array([10, 0, 25], np.uint64), 24)
    ref = zerokv.plan_context_chunks([3, 0, 5], [10, 0, 25], 24)
    np.testing.assert_array_equal(plan.lens, ref.lens)


def test_strided_torch_lengths_are_read_as_they_are():
    q = torch.tensor([3, 1], dtype=torch.int64)[::1]
    ctx = torch.tensor([0, 9, 0, 4], dtype=torch.int32)[::2]  # a strided view: [0, 0]
    plan = _check_plan(q, ctx, 8)
    assert plan.num_chunks == 0


def test_the_largest_values_that_fit_are_planned():
    big = 2**31 - 1
    plan = zerokv.plan_context_chunks([big], [big], 2**62)
    assert plan.num_chunks == 1 and plan.chunk_width == 2**62
    assert plan.cu_seqlens_kv.tolist() == [[0, big]] and plan.cu_seqlens_q.tolist() == [0, big]
    # many chunks, right at the int32 edge of the context
    plan = zerokv.plan_context_chunks([1, 1], [big, 5], 2**28)
    assert plan.num_chunks == -(-big // 2**27)
    assert int(plan.starts[-1, 0]) + int(plan.lens[-1, 0]) == big
