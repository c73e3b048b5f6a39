"""End to end: chunked-context prefill where some requests have no context in some chunks.

Per-chunk attention comes from the one attention oracle (``oracles.attention``, float64, rounded
to float32 as a kernel writes it) except in the rows of requests without keys, which get garbage
as the faulty kernels leave it (V = NaN, a finite LSE). After the fixup + merge, or after the
empty-aware merge alone, the result equals attention over the whole context; merging without
the fixup does not, in exactly the rows of the requests with an empty chunk.
"""

from __future__ import annotations

import numpy as np
import oracles
import pytest
import torch

import zerokv

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def attend(q, k, v, causal_offset=None):
    """An attention kernel's output for q [Tq, H, D] over k, v [Tk, H, D]: ``(out, lse [Tq, H])``
    float32 on q's device. Rows without keys get garbage: V = NaN and a finite LSE."""
    Tq, H, _ = q.shape
    if k.shape[0] == 0:
        return torch.full_like(q, float("nan")), torch.randn(Tq, H, device=q.device) + 5.0
    out, lse = oracles.attention(q, k, v, causal_offset=causal_offset)
    return tuple(torch.from_numpy(x).float().to(q.device) for x in (out, lse))


def _batch(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.tensor([3, 1, 0, 5, 2, 4])
    ctx_lens = torch.tensor([40, 0, 7, 90, 13, 0])
    H, D = 4, 32
    q = [torch.randn(int(n), H, D, generator=g).to(device) for n in q_lens]
    kv_new = [
        (torch.randn(int(n), H, D, generator=g).to(device), torch.randn(int(n), H, D, generator=g).to(device))
        for n in q_lens
    ]
    ctx = [
        (torch.randn(int(n), H, D, generator=g).to(device), torch.randn(int(n), H, D, generator=g).to(device))
        for n in ctx_lens
    ]
    return q_lens, ctx_lens, q, kv_new, ctx


def _chunked(device, mode):
    q_lens, ctx_lens, q, kv_new, ctx = _batch(device)
    plan = zerokv.plan_context_chunks(q_lens, ctx_lens, 48)
    assert plan.num_chunks > 1 and bool(plan.has_empty.any())
    cu_q = plan.cu_seqlens_q.to(device)
    q_all = torch.cat(q)
    H, D = q_all.shape[1:]
    acc = torch.zeros_like(q_all)
    acc_lse = torch.full((q_all.shape[0], H), float("-inf"), device=device)
    for c in range(plan.num_chunks):
        parts = [
            attend(
                q[i], *(t[int(plan.starts[c, i]) : int(plan.starts[c, i] + plan.lens[c, i])] for t in ctx[i])
            )
            for i in range(len(q))
        ]
        out_c = torch.cat([p[0] for p in parts])
        lse_c = torch.cat([p[1] for p in parts])
        lens_c = plan.lens[c].to(device)
        if mode == "fixup_then_merge":
            if plan.has_empty[c]:  # decided on the CPU: no device sync
                zerokv.fixup_zero_kv_rows(out_c, lse_c, lens_c, cu_q)
            zerokv.merge_state(out_c, lse_c, acc, acc_lse, out=acc, out_lse=acc_lse)
        elif mode == "empty_aware_merge":
            zerokv.merge_state(out_c, lse_c, acc, acc_lse, out=acc, out_lse=acc_lse, a_empty=(cu_q, lens_c))
        else:  # no fixup at all
            zerokv.merge_state(out_c, lse_c, acc, acc_lse, out=acc, out_lse=acc_lse)
    suffix = [attend(q[i], *kv_new[i], causal_offset=0) for i in range(len(q))]
    out = torch.empty_like(acc)
    zerokv.merge_state(
        acc, acc_lse, torch.cat([s[0] for s in suffix]), torch.cat([s[1] for s in suffix]), out=out
    )
    # whole-context attention: context then the request's new tokens (causal among the new ones)
    full = [
        oracles.attention(
            q[i],
            torch.cat([ctx[i][0], kv_new[i][0]]),
            torch.cat([ctx[i][1], kv_new[i][1]]),
            causal_offset=int(ctx_lens[i]),
        )[0]
        for i in range(len(q))
    ]
    return out, torch.from_numpy(np.concatenate(full)).float().to(device), plan


def _rows_with_an_empty_chunk(plan) -> torch.Tensor:
    """Query rows of the requests that have no context in some chunk (a plain loop)."""
    cu, lens = plan.cu_seqlens_q.tolist(), plan.lens.tolist()
    rows = torch.zeros(cu[-1], dtype=torch.bool)
    for i in range(len(cu) - 1):
        if any(chunk[i] == 0 for chunk in lens):
            rows[cu[i] : cu[i + 1]] = True
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fixup_then_merge", "empty_aware_merge"])
def test_chunked_prefill_equals_whole_context_attention(device, mode):
    out, expected, _ = _chunked(device, mode)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_without_the_fixup_the_result_is_wrong(device):
    """Rows of requests that always had context stay right (finite, equal to attention over the
    whole context); every row of a request with an empty chunk took the garbage in."""
    out, expected, plan = _chunked(device, "none")
    hit = _rows_with_an_empty_chunk(plan).to(device)
    assert hit.any() and not hit.all()
    assert out[~hit].isfinite().all()
    torch.testing.assert_close(out[~hit], expected[~hit], atol=2e-5, rtol=2e-5)
    close = torch.isclose(out[hit], expected[hit], atol=1e-3)  # NaN is never close
    assert not close.flatten(1).all(dim=1).any(), "a row of a request with an empty chunk came out right"
