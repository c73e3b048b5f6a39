"""Random ragged batches (query and context lengths) for the empty-row tests."""

from __future__ import annotations

import torch

NAN = float("nan")


# (B, max_q, H, D) for the empty-row kernel tests: one request of one row, head_dim 7 (scalar
# path), 72 (unaligned to 16 bytes for some dtypes), and batches of many requests.
KERNEL_CASES = [(1, 1, 1, 7), (7, 3, 16, 72), (64, 300, 8, 128), (300, 400, 4, 64)]


def make_batch(B: int, max_q: int, empty: str, seed: int, index_dtype=torch.int32):
    """``(cu_seqlens_q [B+1], kv_lens [B])`` with query lengths in [0, max_q] (0 and 1 included
    when B allows) and ``empty`` in {"none", "one", "all", "random"} deciding which kv_lens are 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, max_q + 1, (B,), generator=g)
    if B >= 3:
        q[0], q[1] = 0, 1
    kv = torch.randint(1, 50, (B,), generator=g)
    if empty == "one":
        kv[int(torch.randint(0, B, (1,), generator=g))] = 0
    elif empty == "all":
        kv[:] = 0
    elif empty == "random":
        kv[torch.rand(B, generator=g) < 0.4] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)])
    return cu.to(index_dtype), kv.to(index_dtype)


def empty_rows(cu: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    T = int(cu[-1])
    rows = torch.zeros(T, dtype=torch.bool)
    for i in torch.nonzero(kv.cpu() == 0).flatten().tolist():
        rows[int(cu[i]) : int(cu[i + 1])] = True
    return rows


def garbage_state(T: int, H: int, D: int, dtype, rows: torch.Tensor, device, seed: int, lse_ht: bool):
    """Random V / LSE everywhere; in ``rows``: V = NaN or Inf garbage and a finite LSE, as the
    attention kernels leave them. ``lse_ht``: the LSE lives in an ``[H, T]`` buffer (returned
    as its ``[T, H]`` view)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(T, H, D, generator=g).to(dtype)
    lse = torch.randn(T, H, generator=g) * 3
    out[rows] = NAN
    out[rows, :, ::3] = float("inf")
    lse[rows] = torch.randn(int(rows.sum()), H, generator=g)
    out = out.to(device)
    lse = lse.T.contiguous().to(device).T if lse_ht else lse.to(device)
    return out, lse


def check_empty_rows(out, lse, before_out, before_lse, rows):
    """Rows: exactly (0, -inf); every other row bitwise as before."""
    rows = rows.to(out.device)
    assert (out[rows] == 0).all() and not out[rows].isnan().any()
    assert (lse[rows] == float("-inf")).all()
    keep = ~rows
    # untouched rows: bitwise equal (NaN-safe through the raw bits)
    assert torch.equal(bits(out[keep]), bits(before_out[keep]))
    assert torch.equal(bits(lse[keep]), bits(before_lse[keep]))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()])
