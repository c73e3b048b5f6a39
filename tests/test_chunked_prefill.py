"""End to end: chunked-context prefill where some requests have no context in some chunks.

Per-chunk attention comes from a reference that, like the faulty kernels, leaves garbage in the
rows of requests without keys (V = NaN, a finite LSE). After the fixup + merge, or after the
empty-aware merge alone, the result equals attention over the whole context; merging without
the fixup does not.
"""

from __future__ import annotations

import pytest
import torch

import zerokv

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def attend(q, k, v, causal_offset=None):
    """Softmax attention of q [Tq, H, D] over k, v [Tk, H, D] in float32 -> (out, lse [Tq, H]).
    Rows without keys get garbage: V = NaN and a finite LSE (as some kernels leave them)."""
    Tq, H, D = q.shape
    if k.shape[0] == 0:
        return torch.full_like(q, float("nan")), torch.randn(Tq, H, device=q.device) + 5.0
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    if causal_offset is not None:  # query i sees keys j <= i + offset
        i = torch.arange(Tq, device=q.device)[:, None]
        j = torch.arange(k.shape[0], device=q.device)[None, :]
        scores = scores.masked_fill(j > i + causal_offset, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v)
    return out, lse.T.contiguous()


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
        attend(
            q[i],
            torch.cat([ctx[i][0], kv_new[i][0]]),
            torch.cat([ctx[i][1], kv_new[i][1]]),
            causal_offset=int(ctx_lens[i]),
        )[0]
        for i in range(len(q))
    ]
    return out, torch.cat(full)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fixup_then_merge", "empty_aware_merge"])
def test_chunked_prefill_equals_whole_context_attention(device, mode):
    out, expected = _chunked(device, mode)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_without_the_fixup_the_result_is_wrong(device):
    out, expected = _chunked(device, "none")
    assert not torch.allclose(out, expected, atol=1e-3, equal_nan=False)
