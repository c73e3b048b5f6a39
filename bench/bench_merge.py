"""merge_state and merge_states (``--only merge``): zerokv beside the baselines
(bench/baselines.py, bench/baselines_triton.py, bench/baselines_cuda.py).

merge_state runs the grid T x H x D x dtype (bf16, fp16) in both LSE layouts: ``TH`` (a
``[T, H]`` LSE) and ``HT`` (an ``[H, T]`` buffer passed as ``.T``, vLLM's layout). zerokv and
the Triton merge run in both; the vLLM-design CUDA merge reads its ``[H, T]`` LSE natively
(layout HT); torch eager and FlashInfer run with ``[T, H]`` (eager only up to ~1 GB moved: far
behind everywhere, and its float32 temporaries are large). merge_states runs N = 2, 4, 8 beside
torch eager.

Bytes floor: merge_state reads 2 V + 2 LSE and writes 1 V + 1 LSE; merge_states reads N V + N
LSE and writes 1 V + 1 LSE. Inputs are random with finite LSEs.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import zerokv
from zerokv import reference

from . import baselines, baselines_cuda, baselines_triton
from .common import (
    DTYPES,
    Bench,
    Entry,
    Row,
    Sets,
    Task,
    max_error,
    merge_bytes,
    sample_rows,
    states_bytes,
    to_np,
)

T_GRID = (1, 8, 64, 256, 512, 1024, 4096, 16384, 65536)
H_GRID = (8, 16, 32, 128)
D_GRID = (64, 128, 512)
EAGER_MAX_BYTES = 1.1e9
NAN = float("nan")
# implementation labels: the report reads them from the rows ("zerokv" is ours)
ZEROKV, VLLM_CUDA, TRITON = "zerokv", "vLLM-design CUDA", "Triton"
FLASHINFER, EAGER = "FlashInfer", "torch eager"

# A representative part of the grid: latency-bound, the middle, bandwidth-bound, D = 512.
QUICK = [
    ("bf16", 1, 16, 512), ("bf16", 1, 128, 128), ("bf16", 8, 32, 128), ("bf16", 64, 32, 128),
    ("bf16", 256, 128, 128), ("bf16", 256, 128, 512), ("bf16", 512, 128, 128), ("bf16", 1024, 8, 64),
    ("bf16", 4096, 128, 128), ("bf16", 16384, 16, 512), ("bf16", 16384, 128, 128), ("bf16", 65536, 8, 64),
    ("fp16", 1, 32, 128), ("fp16", 512, 128, 128), ("fp16", 16384, 128, 128),
]  # fmt: skip
DRY = [("bf16", 3, 2, 64), ("fp16", 1, 2, 8), ("bf16", 40, 4, 32), ("fp32", 5, 2, 16)]


def merge_grid(mode: str) -> list[tuple[str, int, int, int]]:
    if mode == "dry":
        return DRY
    if mode == "quick":
        return QUICK
    return [(dt, T, H, D) for dt in ("bf16", "fp16") for T in T_GRID for H in H_GRID for D in D_GRID]


def states_grid(mode: str) -> list[tuple[int, int, int, int]]:
    """(N, T, H, D), bf16; the large shapes move >= 256 MB at every N."""
    if mode == "dry":
        return [(2, 3, 2, 64), (4, 5, 2, 16), (8, 7, 3, 8)]
    big = (
        [(16384, 64, 128)]
        if mode == "quick"
        else [(64, 64, 128), (1024, 64, 128), (16384, 64, 128), (4096, 128, 512)]
    )
    return [(N, T, H, D) for N in (2, 4, 8) for T, H, D in big]


def tasks(b: Bench, part: str) -> list[Task]:
    out = [
        Task(part, f"merge_state {dt} T={T} H={H} D={D}", partial(run_merge_state, dt, T, H, D))
        for dt, T, H, D in merge_grid(b.mode)
    ]
    out += [
        Task(part, f"merge_states N={N} bf16 T={T} H={H} D={D}", partial(run_merge_states, N, T, H, D))
        for N, T, H, D in states_grid(b.mode)
    ]
    return out


def _zerokv_merge_state(va, sa, vb, sb, out, out_lse):
    return zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=out_lse)


def implementations(b: Bench, dtype: str, nbytes: int) -> list[tuple[str, Any, tuple[str, ...], str]]:
    """(label, merge, layouts, LSE base) of what runs here."""
    impls: list[tuple[str, Any, tuple[str, ...], str]] = [(ZEROKV, _zerokv_merge_state, ("TH", "HT"), "e")]
    fn = baselines_cuda.vllm_design_stand_in if b.dry else baselines_cuda.vllm_design_merge
    impls.append((VLLM_CUDA, fn, ("HT",), "e"))
    if baselines_triton.triton_runs(b.dry):
        impls.append((TRITON, baselines_triton.triton_merge_state, ("TH", "HT"), "e"))
    fi = None if b.dry else baselines.flashinfer_merge_state()
    if fi is not None and dtype in ("bf16", "fp16"):
        impls.append((FLASHINFER, fi, ("TH",), "2"))
    if nbytes <= EAGER_MAX_BYTES:
        impls.append((EAGER, baselines.eager_merge_state, ("TH",), "e"))
    return impls


def skip_if_no_room(b: Bench, op: str, need: float, **fields: Any) -> list[Row] | None:
    free = b.free_bytes()
    if need <= 0.85 * free:
        return None
    note = f"skipped: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
    return [Row(op=op, impl=ZEROKV, note=note, **fields)]


def run_merge_state(dt: str, T: int, H: int, D: int, b: Bench) -> list[Row]:
    torch, dev = b.torch, b.device
    tdt = getattr(torch, DTYPES[dt])
    nbytes = merge_bytes(dt, T, H, D)
    K = b.n_sets(nbytes)
    fields = {"dtype": dt, "T": T, "H": H, "D": D}
    # inputs and outputs of K sets, the LSEs in both layouts, plus the eager path's temporaries
    eager = 6 * T * H * D * 4 if nbytes <= EAGER_MAX_BYTES else 0
    if skipped := skip_if_no_room(b, "merge_state", K * (nbytes + 9 * T * H * 4) + eager, **fields):
        return skipped
    va = torch.randn(K, T, H, D, device=dev, dtype=tdt)
    vb = torch.randn(K, T, H, D, device=dev, dtype=tdt)
    sa = torch.randn(K, T, H, device=dev) * 3
    sb = torch.randn(K, T, H, device=dev) * 3
    out = torch.empty(K, T, H, D, device=dev, dtype=tdt)
    lse = {"TH": torch.empty(K, T, H, device=dev), "HT": torch.empty(K, H, T, device=dev)}
    ins = {"TH": (sa, sb), "HT": (sa.transpose(1, 2).contiguous(), sb.transpose(1, 2).contiguous())}

    def view(layout: str, x: Any) -> Any:
        return x if layout == "TH" else x.T

    def make(layout: str, k: int) -> tuple:
        a, s = ins[layout]
        return va[k], view(layout, a[k]), vb[k], view(layout, s[k]), out[k], view(layout, lse[layout][k])

    sets = {layout: Sets(K, partial(make, layout)) for layout in ("TH", "HT")}
    ti, hi = sample_rows(torch, T, H, dev)
    x = [to_np(t[0][ti, hi])[:, None] for t in (va, sa, vb, sb)]  # the sample as [n, 1, D], [n, 1]
    want = {base: [r[:, 0] for r in reference.merge_state(*x, lse_base=base)] for base in ("e", "2")}

    def check(layout: str, base: str, fn: Any) -> float:
        s = sets[layout][0]
        s[4].fill_(NAN)
        s[5].fill_(NAN)
        o, ls = fn(*s)
        b.sync()
        ro, rl = want[base]
        return max(max_error(to_np(o[ti, hi]), ro), max_error(to_np(ls[ti, hi]), rl))

    entries = [
        Entry(name, fn, sets[layout], partial(check, layout, base), {"layout": layout} | ({"lse_base": base} if base != "e" else {}))
        for name, fn, layouts, base in implementations(b, dt, nbytes)
        for layout in layouts
    ]  # fmt: skip
    return b.measure("merge_state", entries, nbytes, **fields)


def _zerokv_merge_states(v, s, out, out_lse):
    return zerokv.merge_states(v, s, out=out, out_lse=out_lse)


def run_merge_states(N: int, T: int, H: int, D: int, b: Bench) -> list[Row]:
    torch, dev = b.torch, b.device
    nbytes = states_bytes("bf16", N, T, H, D)
    K = b.n_sets(nbytes)
    fields = {"dtype": "bf16", "T": T, "H": H, "D": D}
    eager = (N + 2) * T * H * D * 4 if nbytes <= EAGER_MAX_BYTES else 0
    if skipped := skip_if_no_room(b, "merge_states", K * nbytes + eager, params={"N": N}, **fields):
        return skipped
    v = torch.randn(K, N, T, H, D, device=dev, dtype=torch.bfloat16)
    s = torch.randn(K, N, T, H, device=dev) * 3
    out = torch.empty(K, T, H, D, device=dev, dtype=torch.bfloat16)
    out_lse = torch.empty(K, T, H, device=dev)
    sets = Sets(K, lambda k: (v[k], s[k], out[k], out_lse[k]))
    ti, hi = sample_rows(torch, T, H, dev)
    ro, rl = reference.merge_states(to_np(v[0][:, ti, hi]), to_np(s[0][:, ti, hi]))

    def check(fn: Any) -> float:
        st = sets[0]
        st[2].fill_(NAN)
        st[3].fill_(NAN)
        o, ls = fn(*st)
        b.sync()
        return max(max_error(to_np(o[ti, hi]), ro), max_error(to_np(ls[ti, hi]), rl))

    impls = [(ZEROKV, _zerokv_merge_states)]
    if nbytes <= EAGER_MAX_BYTES:
        impls.append((EAGER, baselines.eager_merge_states))
    entries = [Entry(name, fn, sets, check, {"N": N}) for name, fn in impls]
    return b.measure("merge_states", entries, nbytes, **fields)
