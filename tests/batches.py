"""Random ragged batches (query and context lengths) for the empty-row tests, offsets that lie
about the tensors (for the bounds tests and the sanitizer run), and outputs laid inside poisoned
buffers."""

from __future__ import annotations

import random
from dataclasses import dataclass

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
    wrong = ~(out == 0).flatten(1).all(1) | ~(lse == float("-inf")).all(1)
    assert not (wrong & rows).any(), f"rows not (0, -inf): {_first(wrong & rows)}"
    # untouched rows: bitwise equal (NaN-safe through the raw bits)
    changed = (bits(out) != bits(before_out)).flatten(1).any(1) | (bits(lse) != bits(before_lse)).any(1)
    assert not (changed & ~rows).any(), f"rows written that must stay untouched: {_first(changed & ~rows)}"


def _first(rows: torch.Tensor) -> list[int]:
    return torch.nonzero(rows).flatten()[:8].tolist()


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN compares equal to the same NaN."""
    return x.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


# --- offsets that lie: past T, negative, decreasing, wider than 32 bits, no request ------------

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class Lying:
    """Offsets for a ``[T, H, D]`` state: ``cu`` query offsets ``[B + 1]``, ``kv`` KV lengths
    ``[B]`` (the fixup's and ``a_empty``'s rule), ``cu_kv`` context offsets ``[B + 1]`` (the
    mask's rule). Python ints, so the expected rows never go through the code under test."""

    id: str
    T: int
    cu: tuple[int, ...]
    kv: tuple[int, ...]
    cu_kv: tuple[int, ...]
    H: int = 3

    @property
    def index_dtypes(self) -> tuple[torch.dtype, ...]:
        """int64 only when a value does not fit in 32 bits."""
        values = self.cu + self.kv + self.cu_kv
        if all(INT32_MIN <= x <= INT32_MAX for x in values):
            return (torch.int32, torch.int64)
        return (torch.int64,)

    def tensors(self, index_dtype: torch.dtype, device="cpu"):
        """``(cu, kv, cu_kv)`` as tensors of ``index_dtype``."""
        return tuple(
            torch.tensor(x, dtype=index_dtype, device=device) for x in (self.cu, self.kv, self.cu_kv)
        )


def _scrambled(seed: int, B: int, T: int) -> Lying:
    """Many requests whose offsets walk from below 0 to past T, stepping backwards now and then:
    more requests than one scan step of the kernels (256), lies all along the batch."""
    r = random.Random(seed)
    cu, cu_kv = [-20], [0]
    for _ in range(B):
        cu.append(cu[-1] + r.randint(-3, 6))
        cu_kv.append(cu_kv[-1] + r.choice((0, -2, 1, 4, 4, 4, 4, 4)))
    kv = tuple(r.choice((0, 1, 7, -3, INT32_MAX, INT32_MIN, 9, 2)) for _ in range(B))
    return Lying(f"scrambled_B{B}", T, tuple(cu), kv, tuple(cu_kv), H=2)


LYING_CASES = (
    Lying("valid", 10, (0, 3, 3, 7, 10), (0, 4, 0, 2), (0, 0, 4, 4, 6)),
    Lying("past_T", 10, (0, 4, 9, 15), (0, 3, 0), (0, 0, 3, 3)),
    Lying("all_past_T", 10, (12, 14, 20), (0, 0), (5, 5, 5)),
    Lying("negative_first", 10, (-5, 2, 6, 10), (0, 1, 0), (4, 4, 9, 9)),
    Lying("all_negative", 10, (-9, -4, -1), (0, 0), (1, 1, 1)),
    Lying("decreasing", 10, (0, 6, 3, 10), (0, 0, 7), (0, 0, 0, 7)),
    Lying("decreasing_overlap", 10, (8, 2, 5, 1, 10), (0, 0, 3, 0), (9, 9, 9, 12, 12)),
    Lying("decreasing_context", 10, (0, 3, 6, 10), (1, 0, 2), (5, 2, 2, 9)),
    Lying("equal_neighbours", 10, (0, 0, 5, 5, 10), (0, 0, 0, 0), (2, 2, 2, 2, 2)),
    Lying("uncovered_rows", 10, (2, 5, 7), (0, 0), (1, 1, 1)),
    Lying("int32_extremes", 10, (INT32_MIN, 3, INT32_MAX), (0, 0), (INT32_MIN, INT32_MIN, INT32_MAX)),
    Lying("int32_extreme_lens", 10, (0, 4, 10), (INT32_MIN, INT32_MAX), (INT32_MAX, INT32_MIN, 5)),
    Lying("above_2^31", 10, (0, 2**31 + 5, 2**31 + 9), (0, 0), (0, 0, 2**31 + 5)),
    Lying("above_2^32", 10, (0, 2, 2**32 + 3, 2**32 + 6), (5, 0, 0), (0, 3, 3, 3)),
    Lying("lens_zero_in_low_32_bits", 10, (0, 3, 6, 10), (2**32, -1, -(2**40)), (0, 2**32, 2**32, 2**33)),
    Lying("huge_negative", 10, (-(2**40), 4, 2**62), (0, 0), (-(2**40), -(2**40), 2**62)),
    Lying("B0", 10, (3,), (), (7,)),
    Lying("B0_at_zero", 10, (0,), (), (0,)),
    Lying("T0", 0, (0, 5, 10), (0, 0), (0, 0, 0)),
    Lying("T0_B0", 0, (0,), (), (0,)),
    Lying("H0", 10, (0, 4, 12), (0, 0), (0, 0, 0), H=0),
    _scrambled(3, 300, 400),
)


# --- outputs inside poisoned buffers: a write outside the view shows --------------------------


@dataclass
class Poisoned:
    """A view ``buf[index]`` (transposed when ``transposed``) inside a NaN-filled ``buf``."""

    buf: torch.Tensor
    index: tuple[slice, ...]
    transposed: bool = False

    @property
    def view(self) -> torch.Tensor:
        v = self.buf[self.index]
        return v.T if self.transposed else v

    def surroundings_unchanged(self, before: torch.Tensor) -> bool:
        """Every byte of ``buf`` outside the view equals ``before`` (a clone of ``buf``)."""
        after = self.buf.detach().cpu().clone()
        after[self.index] = before.cpu()[self.index]
        return torch.equal(bits(after), bits(before.cpu()))


def poisoned_v(x: torch.Tensor, padded: bool, pad: int = 2) -> Poisoned:
    """``x [T, H, D]`` copied into a NaN buffer with ``pad`` rows before and after; ``padded``
    adds a head and a head_dim element too (the view is then neither flat nor aligned)."""
    T, H, D = x.shape
    e = int(padded)
    buf = torch.full((T + 2 * pad, H + e, D + e), NAN, dtype=x.dtype, device=x.device)
    p = Poisoned(buf, (slice(pad, pad + T), slice(0, H), slice(0, D)))
    p.view.copy_(x)
    return p


def poisoned_lse(x: torch.Tensor, ht: bool, pad: int = 2) -> Poisoned:
    """``x [T, H]`` copied into a NaN buffer: ``[T + 2 pad, H + 1]``, or with ``ht`` an
    ``[H + 1, T + 2 pad]`` buffer seen through its transpose."""
    T, H = x.shape
    if ht:
        buf = torch.full((H + 1, T + 2 * pad), NAN, dtype=x.dtype, device=x.device)
        p = Poisoned(buf, (slice(0, H), slice(pad, pad + T)), transposed=True)
    else:
        buf = torch.full((T + 2 * pad, H + 1), NAN, dtype=x.dtype, device=x.device)
        p = Poisoned(buf, (slice(pad, pad + T), slice(0, H)))
    p.view.copy_(x)
    return p
