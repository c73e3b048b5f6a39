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
