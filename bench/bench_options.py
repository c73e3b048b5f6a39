"""merge_state's options beside the plain merge (``--only options``): each option of
``merge_state`` (``a_empty`` with 25 % and 50 % empty requests, ``sinks``, a row mask, vLLM's
verbatim suffix, ``prefix_rows``, fp8 with ``out_scale``, per-group fp8 in both scale formats)
beside the plain merge of the same tensors and beside fixup + merge; per-group fp8 beside a
Triton merge of vLLM's design; and the seed pipeline: fused ``a_empty`` against vLLM's mask +
``masked_fill_`` + merge. bf16, H = 128, D = 128. A part of its own because it measures the
cost of each option over the plain merge, not the merge against the baselines
(``bench_merge``, whose T grid and implementation labels it shares).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import zerokv
import zerokv.core.checks
import zerokv.core.dtypes
import zerokv.core.kernels

from . import baselines_triton
from .bench_merge import T_GRID, TRITON, ZEROKV, skip_if_no_room
from .common import Bench, Entry, Row, Sets, Task, merge_bytes

OPTIONS_T = (256, 2048, 8192)  # quick; full: the merge grid's T from 256 on
OPTIONS_H, OPTIONS_D = 128, 128
QUANT_GROUP = 128
MANY_REQUESTS = 256  # a_empty's batch past the window's 64 requests


def options_grid(mode: str) -> list[int]:
    if mode == "dry":
        return [40]
    return list(OPTIONS_T) if mode == "quick" else [T for T in T_GRID if T >= 256]


def tasks(b: Bench, part: str) -> list[Task]:
    out = [
        Task(part, f"merge_state options bf16 T={T}", partial(run_options, T)) for T in options_grid(b.mode)
    ]
    out += [
        Task(part, f"seed pipeline bf16 T={T}", partial(run_seed, T))
        for T in options_grid(b.mode)
        if T <= 8192
    ]
    return out


def _requests(torch: Any, T: int, frac: float, dev: Any, seed: int, count: int = 0) -> tuple[Any, Any, Any]:
    """``(cu_seqlens_q, kv_lens, cu_seqlens_kv)`` int32 of equal requests (``count``, or T / 16
    of them up to 64, at least 1), a fraction ``frac`` of them with no context (at least one
    unless 0)."""
    B = count or max(1, min(64, T // 16))
    g = torch.Generator().manual_seed(seed)
    cu = torch.linspace(0, T, B + 1).round().to(torch.int32)
    kv = torch.randint(1, 4096, (B,), generator=g, dtype=torch.int32)
    kv[torch.randperm(B, generator=g)[: max(1, round(frac * B)) if frac else 0]] = 0
    ctx = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(kv, 0).to(torch.int32)])
    return cu.to(dev), kv.to(dev), ctx.to(dev)


def run_options(T: int, b: Bench) -> list[Row]:
    """Each option of merge_state beside the plain merge of the same tensors (bf16, LSE [T, H];
    the plain merge and ``a_empty`` also with the LSEs [H, T]; ``a_empty`` with
    ``MANY_REQUESTS`` requests and with int64 offsets as well), and beside the two launches it
    replaces (fixup + plain merge for ``a_empty``). Bytes are the plain merge's for every row, so
    that % of copy compares times."""
    torch, dev = b.torch, b.device
    H, D = OPTIONS_H, OPTIONS_D
    nbytes = merge_bytes("bf16", T, H, D)
    K = b.n_sets(nbytes)
    fields = {"dtype": "bf16", "T": T, "H": H, "D": D}
    if skipped := skip_if_no_room(b, "merge_options", 2 * K * nbytes, **fields):
        return skipped
    bf = torch.bfloat16
    va = torch.randn(K, T, H, D, device=dev, dtype=bf)
    vb = torch.randn(K, T, H, D, device=dev, dtype=bf)
    sa = torch.randn(K, T, H, device=dev) * 3
    sb = torch.randn(K, T, H, device=dev) * 3
    out = torch.empty(K, T, H, D, device=dev, dtype=bf)
    out8 = torch.empty(K, T, H, D, device=dev, dtype=torch.float8_e4m3fn)
    lse = torch.empty(K, T, H, device=dev)
    scales = torch.empty(K, T, H * D // QUANT_GROUP, device=dev)
    reqs = {f: _requests(torch, T, f, dev, seed=T) for f in (0.0, 0.25, 0.5)}
    # past 64 requests a_empty's search is the binary one (one round trip a level), not the window
    many = {f: _requests(torch, T, f, dev, seed=T, count=MANY_REQUESTS) for f in (0.25, 0.5)}
    # the same requests with int64 offsets (torch's default integer): other kernels (forms.py)
    wide = {f: tuple(x.long() for x in reqs[f]) for f in (0.0, 0.25)}
    sinks = torch.randn(H, device=dev)
    mask = torch.rand(T, device=dev) < 0.9
    scale = torch.tensor([0.02], device=dev)
    sets = Sets(K, lambda k: (va[k], sa[k], vb[k], sb[k], out[k], lse[k], out8[k], scales[k]))
    # the same values with the LSEs laid [H, T] (vLLM's and FlashAttention's): a_empty's forms
    # differ by layout (tiles), so its rows come in both
    sa_ht, sb_ht, lse_ht = (x.transpose(1, 2).contiguous() for x in (sa, sb, lse))
    sets_ht = Sets(
        K, lambda k: (va[k], sa_ht[k].T, vb[k], sb_ht[k].T, out[k], lse_ht[k].T, out8[k], scales[k])
    )
    merge_two = _merge_two()

    def plain(va, sa, vb, sb, o, ol, o8, bs):
        return zerokv.merge_state(va, sa, vb, sb, out=o, out_lse=ol)

    def a_empty(f, requests=reqs):
        cu, kv, _ = requests[f]
        return lambda va, sa, vb, sb, o, ol, o8, bs: zerokv.merge_state(
            va, sa, vb, sb, out=o, out_lse=ol, a_empty=(cu, kv)
        )

    def fixup_then_plain(f):
        cu, kv, _ = reqs[f]

        def call(va, sa, vb, sb, o, ol, o8, bs):
            zerokv.fixup_zero_kv_rows(va, sa, kv, cu)
            return zerokv.merge_state(va, sa, vb, sb, out=o, out_lse=ol)

        return call

    def one_pass(f):
        cu, kv, _ = reqs[f]
        return lambda va, sa, vb, sb, o, ol, o8, bs: _a_empty_one_pass(va, sa, vb, sb, o, ol, cu, kv)

    def group_fp8(fmt):
        return lambda va, sa, vb, sb, o, ol, o8, bs: zerokv.merge_state(
            va, sa, vb, sb, out=o8, out_lse=ol, out_block_scale=bs, quant_group=QUANT_GROUP, scale_format=fmt
        )

    def triton_group(ue8m0):
        return lambda va, sa, vb, sb, o, ol, o8, bs: baselines_triton.triton_group_fp8_merge(
            va, sa, vb, sb, o8, ol, bs, QUANT_GROUP, ue8m0
        )

    # a_empty's other search paths, in both layouts: past the window, and int64 offsets
    search_rows = [
        *(
            (ZEROKV, a_empty(f, many), {"option": "a_empty", "empty": f, "requests": MANY_REQUESTS})
            for f in many
        ),
        *((ZEROKV, a_empty(f, wide), {"option": "a_empty", "empty": f, "offsets": "int64"}) for f in wide),
    ]
    impls: list[tuple[str, Any, dict]] = [
        (ZEROKV, plain, {"option": "none"}),
        (ZEROKV, a_empty(0.0), {"option": "a_empty", "empty": 0.0}),
        (ZEROKV, a_empty(0.25), {"option": "a_empty", "empty": 0.25}),
        (ZEROKV, a_empty(0.5), {"option": "a_empty", "empty": 0.5}),
        *search_rows,
        ("zerokv fixup + merge", fixup_then_plain(0.25), {"option": "a_empty", "empty": 0.25}),
        ("zerokv fixup + merge", fixup_then_plain(0.5), {"option": "a_empty", "empty": 0.5}),
        (ZEROKV, lambda va, sa, vb, sb, o, ol, *_: zerokv.merge_state(va, sa, vb, sb, out=o, out_lse=ol, sinks=sinks),
         {"option": "sinks"}),
        (ZEROKV, lambda va, sa, vb, sb, o, ol, *_: merge_two(va, sa, vb, sb, o, ol, row_mask=mask),
         {"option": "row_mask"}),
        (ZEROKV, lambda va, sa, vb, sb, o, ol, *_: merge_two(
            va, sa, vb, sb, o, ol, prefix_rows=T // 2, suffix_verbatim=True), {"option": "suffix_verbatim"}),
        (ZEROKV, lambda va, sa, vb, sb, o, ol, *_: zerokv.merge_state(
            va, sa, vb, sb, out=o, out_lse=ol, prefix_rows=T // 2), {"option": "prefix_rows"}),
        (ZEROKV, lambda va, sa, vb, sb, o, ol, o8, bs: zerokv.merge_state(
            va, sa, vb, sb, out=o8, out_lse=ol, out_scale=scale), {"option": "out_scale"}),
        (ZEROKV, group_fp8("float32"), {"option": "group_fp8", "scale_format": "float32"}),
        (ZEROKV, group_fp8("ue8m0"), {"option": "group_fp8", "scale_format": "ue8m0"}),
    ]  # fmt: skip
    if not b.dry:  # a direct launch: GPU tensors only
        for f in (0.0, 0.25, 0.5):
            impls.append(("zerokv, a_empty in one pass", one_pass(f), {"option": "a_empty", "empty": f}))
    if baselines_triton.triton_runs(b.dry):
        impls.append((TRITON, triton_group(False), {"option": "group_fp8", "scale_format": "float32"}))
        impls.append((TRITON, triton_group(True), {"option": "group_fp8", "scale_format": "ue8m0"}))
    entries = [Entry(name, fn, sets, None, {**params, "layout": "TH"}) for name, fn, params in impls]
    ht = [
        (ZEROKV, plain, {"option": "none"}),
        *((ZEROKV, a_empty(f), {"option": "a_empty", "empty": f}) for f in (0.0, 0.25, 0.5)),
        *search_rows,
        *(
            ("zerokv fixup + merge", fixup_then_plain(f), {"option": "a_empty", "empty": f})
            for f in (0.25, 0.5)
        ),
    ]
    entries += [Entry(name, fn, sets_ht, None, {**params, "layout": "HT"}) for name, fn, params in ht]
    return b.measure("merge_options", entries, nbytes, **fields)


def run_seed(T: int, b: Bench) -> list[Row]:
    """The seeds' problem for one chunk: empty-context requests and the merge. zerokv's fused
    merge (``a_empty``) beside vLLM's path: the LSE mask (a Triton kernel of vLLM's design), the
    output's ``masked_fill_`` and the vLLM-design CUDA merge; LSE laid [H, T] for both."""
    torch, dev = b.torch, b.device
    H, D = OPTIONS_H, OPTIONS_D
    nbytes = merge_bytes("bf16", T, H, D)
    K = b.n_sets(nbytes)
    fields = {"dtype": "bf16", "T": T, "H": H, "D": D}
    if skipped := skip_if_no_room(b, "seed_pipeline", 2 * K * nbytes, **fields):
        return skipped
    bf = torch.bfloat16
    va = torch.randn(K, T, H, D, device=dev, dtype=bf)
    vb = torch.randn(K, T, H, D, device=dev, dtype=bf)
    sa = torch.randn(K, H, T, device=dev) * 3
    sb = torch.randn(K, H, T, device=dev) * 3
    out = torch.empty(K, T, H, D, device=dev, dtype=bf)
    lse = torch.empty(K, H, T, device=dev)
    row_mask = torch.empty(T, device=dev, dtype=torch.bool)
    sets = Sets(K, lambda k: (va[k], sa[k].T, vb[k], sb[k].T, out[k], lse[k].T))
    entries = []
    for f in (0.25, 0.5):
        cu, kv, ctx = _requests(torch, T, f, dev, seed=T + 1)

        def fused(va, sa, vb, sb, o, ol, cu=cu, kv=kv):
            return zerokv.merge_state(va, sa, vb, sb, out=o, out_lse=ol, a_empty=(cu, kv))

        def vllm(va, sa, vb, sb, o, ol, cu=cu, ctx=ctx):
            return baselines_triton.vllm_seed_pipeline(va, sa, vb, sb, o, ol, cu, ctx, row_mask)

        entries.append(Entry(ZEROKV, fused, sets, None, {"empty": f, "layout": "HT"}))
        if not b.dry and baselines_triton.triton is not None:
            entries.append(
                Entry("vLLM mask + masked_fill_ + merge", vllm, sets, None, {"empty": f, "layout": "HT"})
            )
    return b.measure("seed_pipeline", entries, nbytes, **fields)


def _a_empty_one_pass(va: Any, sa: Any, vb: Any, sb: Any, o: Any, ol: Any, cu: Any, kv: Any) -> Any:
    """The fused a_empty merge on the gathered form in one span per block (v_a loaded with v_b
    on every row) where the library takes its runs of spans (F_A_RUN), launched through the
    library's form, parameters by name and launcher: the comparison behind forms.py's choice."""
    from zerokv.core import device, facts, forms, merge_plans, plans, spec, validation

    objs = (va, sa, vb, sb, o, ol, cu, kv, None, None, None)
    f = facts.of(spec.MERGE_STATE, validation.validate(spec.MERGE_STATE, objs, {"lse_base": "e"}), objs)
    f.prefix_rows = f.T
    c = forms.MergeCall(
        f.T, f.H, f.D, 16 // va.element_size(), str(va.dtype).split(".")[-1], str(o.dtype).split(".")[-1],
        frozenset({"a_empty"}), False, True, True, ol.stride(0) == 1 and ol.stride(1) != 1, cu.dtype.itemsize == 8,
    )  # fmt: skip
    ctypes = (zerokv.core.dtypes.ctype(c.in_dtype), zerokv.core.dtypes.ctype(c.out_dtype))
    form = forms.flat_options(c, forms.Device(device.sm_count(f.device), device.l2_bytes(f.device)), ctypes)
    targs = (*form.targs[:-1], form.targs[-1] & ~zerokv.core.kernels.F_A_RUN)
    form = form._replace(targs=targs, run_tail=0)
    form = form._replace(grid=forms.launch_grid(form, f.T)[0])
    consts = merge_plans.Consts()
    consts.k, consts.inv_k = zerokv.core.checks.LSE_BASES["e"]
    consts.suffix_verbatim, consts.a_is64, consts.prefix_rows, consts.ue8m0 = 0, int(c.a64), 0, 0
    launcher = plans.launcher(form.kernel, targs, f.device)
    get = merge_plans.getter(form.kernel)
    f.rows = f.T * f.H
    launcher.launch_values(form.grid, form.grid_y, device.torch_stream(f.device), get(f, form, consts))
    return o, ol


def _merge_two() -> Any:
    """The two-way merge behind the adapters (row masks, vLLM's verbatim suffix)."""
    from zerokv import merge

    return merge.merge_two
