"""Random partial attention states with every edge the contract names, for the tests."""

from __future__ import annotations

import torch

NAN, INF = float("nan"), float("inf")


def make_states(T: int, H: int, D: int, dtype, device="cpu", seed: int = 0, edges: bool = True):
    """``(v_a, s_a, v_b, s_b)``: random states (LSE spread ~ +-8) plus, when ``edges``, rows
    where a is empty (-inf, V = NaN garbage), b is empty (+inf as FA2 writes, V = NaN), both
    are empty, an LSE is NaN, and the LSE gap is huge (1e4)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    v_a = torch.randn(T, H, D, generator=g).to(dtype)
    v_b = torch.randn(T, H, D, generator=g).to(dtype)
    s_a = torch.randn(T, H, generator=g) * 4
    s_b = torch.randn(T, H, generator=g) * 4
    if edges and T * H > 0:
        rows = torch.rand(T, H, generator=g)
        a_empty = rows < 0.08
        b_empty = (rows >= 0.08) & (rows < 0.16)
        both = (rows >= 0.16) & (rows < 0.20)
        nan = (rows >= 0.20) & (rows < 0.21)
        gap = (rows >= 0.21) & (rows < 0.25)
        s_a[a_empty | both] = -INF
        v_a[a_empty | both] = NAN
        s_b[b_empty] = INF
        s_b[both] = -INF
        v_b[b_empty | both] = NAN
        s_a[nan] = NAN
        s_a[gap] = s_b[gap] + 1e4
    return tuple(x.to(device) for x in (v_a, s_a, v_b, s_b))


def layout_states(T, H, D, dtype=torch.bfloat16, lse_ht=False, pad_h=0, seed=0):
    """Inputs in engine layouts: padded heads (``pad_h``), an [H, T] LSE buffer as ``.T``. V is
    left unfilled: launches are recorded, not made, so its values are never read."""
    g = torch.Generator().manual_seed(seed + T * 131 + H * 7 + D)
    v = [torch.empty(T, H + pad_h, D, dtype=dtype)[:, :H] for _ in range(2)]
    s = [torch.randn(H, T, generator=g).T if lse_ht else torch.randn(T, H, generator=g) for _ in range(2)]
    return v[0], s[0], v[1], s[1]
