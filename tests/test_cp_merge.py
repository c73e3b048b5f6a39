"""cp_merge and vLLM's DCP combine adapters across the ranks of a process group.

* CPU: gloo groups of 1, 2, 3 and 4 processes (one spawn of four processes, sub-groups for the
  smaller sizes), every case inside that one spawn.
* One GPU: the kernels alone, with N ranks simulated in one process (the collectives replaced
  by copies of what the other simulated ranks produced in earlier passes).
* Two GPUs: NCCL, the same cases, bf16/fp16/fp32, D in {128, 512}, T in {0, 1, 7, 4096}, and a
  CUDA graph captured and replayed with new inputs.

Every rank builds all ranks' inputs from one seed, passes its own, and compares its output with
the float64 reference over all ranks' inputs (``zerokv.reference.merge_states``). Outputs are
poisoned with NaN before each call.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import os
import traceback
import types

import numpy as np
import pytest
import torch
from conftest import f64

import zerokv
from zerokv import reference
from zerokv.compat import vllm

cpm = importlib.import_module("zerokv.cp_merge")  # the module (zerokv.cp_merge is the function)
dist = torch.distributed
NAN = float("nan")
INF = float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --- inputs and checks -------------------------------------------------------------------------


def states(seed, N, T, H, D, dtype, device, *, empty=0.15, plus_inf=0.05, spread=4.0):
    """All ranks' states ``V [N, T, H, D]``, ``S [N, T, H]``: random, with a share of empty
    entries (-inf, some +inf) whose V is NaN / Inf garbage, and a few rows empty on every rank."""
    v, s = _states(seed, N, T, H, D, empty, plus_inf, spread)
    return torch.from_numpy(v).to(dtype).to(device), torch.from_numpy(s).float().to(device)


@functools.lru_cache(maxsize=64)  # the simulated ranks ask for the same states many times
def _states(seed, N, T, H, D, empty, plus_inf, spread):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((N, T, H, D))
    s = rng.standard_normal((N, T, H)) * spread + rng.standard_normal((1, T, H)) * 2
    e = rng.random((N, T, H)) < empty
    p = rng.random((N, T, H)) < plus_inf
    if T > 2:
        e[:, T // 2, 0] = True  # a row empty on every rank
        p[0, T // 2, 0] = True  # (one of them +inf)
    s[e] = -np.inf
    s[p] = np.inf
    garbage = np.where(rng.random(v.shape) < 0.5, np.nan, np.inf)
    return np.where((e | p)[..., None], garbage, v), s


def ulp(x, kind):
    """Spacing of the values of dtype ``kind`` around ``|x|``."""
    mant, emin = {
        torch.float32: (23, -126),
        torch.float16: (10, -14),
        torch.bfloat16: (7, -126),
        "e4m3": (3, -6),
    }[kind]
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0**emin)))
    return 2.0 ** (e - mant)


def check(ctx, got, want, mag, kind, what, roundings=1):
    """NaN and +-inf exactly where expected; finite values within ``roundings`` roundings of
    the output dtype (each half a unit) of the float64 value, plus float32 arithmetic on the
    magnitude ``mag`` (the sum of |share|: cancellation does not hide an error)."""
    if not ctx.checking:
        return
    a = f64(got)
    e = np.asarray(want, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert (np.isnan(a) == np.isnan(e)).all(), f"{what}: NaN at {np.argwhere(np.isnan(a) != np.isnan(e))[:4]}"
    inf = np.isinf(e)
    assert (np.isinf(a) == inf).all() and (a[inf] == e[inf]).all(), f"{what}: infinities differ"
    fin = np.isfinite(e)
    if kind == "lse":
        bound = 2e-5 * np.maximum(1.0, np.abs(e))
    else:
        m = np.broadcast_to(np.asarray(mag, dtype=np.float64), e.shape)
        bound = roundings * 0.5 * ulp(np.abs(e) * (1 + 1e-5), kind) + 4e-6 * m + 1e-30
        if roundings > 1:  # a 16-bit wire: each share rounded, then the sum at each step
            bound = bound + roundings * 0.5 * ulp(m, kind)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - e)
        bad = fin & ~(err <= bound)
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {fin.sum()} values off, worst {err[bad].max():.3g} at "
        f"{np.argwhere(bad)[0].tolist()} (bound {bound[bad][0]:.3g})"
    )


REFERENCE = [True]  # False while simulated ranks run the passes whose results are not checked


def expected(V, S, base="e", sinks=None):
    """float64 reference over all ranks, and the magnitude of the shares (for the bounds)."""
    if not REFERENCE[0]:
        return None, None, None
    Vd, Sd = f64(V), f64(S)
    sk = None if sinks is None else f64(sinks)
    out, lse = reference.merge_states(Vd, Sd, base, sk)
    mag, _ = reference.merge_states(np.abs(Vd), Sd, base, sk)
    return out, lse, mag


def heads(x, ctx, scatter):
    """This rank's part of an ``[T, H, ...]`` array."""
    if scatter == "none" or x is None:
        return x
    Hn = x.shape[1] // ctx.N
    return x[:, ctx.rank * Hn : (ctx.rank + 1) * Hn]


def poisoned(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(NAN) if dtype.is_floating_point and t.numel() else t


class Ctx:
    """One rank's view: rank, group size, group (None in the simulation), device, whether
    checks run (the simulation's early passes produce no results)."""

    def __init__(self, rank, N, group, device, checking=True, real=True):
        self.rank, self.N, self.group, self.device = rank, N, group, device
        self.checking, self.real = checking, real


def roundings_for(ctx, wire, dtype):
    """One rounding with a float32 wire or on the CPU (float64 sums); with a 16-bit wire, one
    per share and per step of the sum."""
    if ctx.device.type == "cpu" or wire in (None, torch.float32) or dtype == torch.float32:
        return 1
    return 2 * ctx.N + 1


# --- cases: each runs on every rank of the group, in the same order ----------------------------


def case_grid(ctx, dtypes, Ts, Ds, wires, seed=0):
    """Random states over shapes, dtypes, both scatter modes, both LSE bases, wires."""
    k = seed
    for dtype in dtypes:
        for T in Ts:
            for D in Ds:
                for scatter in ("heads", "none"):
                    for wire in wires:
                        wire = dtype if wire == "input" else wire
                        k += 1
                        base = "e" if k % 2 else 2
                        H = 2 * ctx.N if scatter == "heads" else 3
                        V, S = states(k, ctx.N, T, H, D, dtype, ctx.device)
                        want, lse, mag = expected(V, S, base)
                        Hn = H // ctx.N if scatter == "heads" else H
                        out = poisoned((T, Hn, D), dtype, ctx.device)
                        got, got_lse = zerokv.cp_merge(
                            V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, lse_base=base,
                            return_lse=True, wire_dtype=wire, out=out,
                        )  # fmt: skip
                        what = f"{dtype} T={T} D={D} {scatter} base={base} wire={wire}"
                        assert got is out
                        check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), dtype, what,
                              roundings_for(ctx, wire, dtype))  # fmt: skip
                        check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")
                        if k % 3 == 0:  # allocated output, no LSE
                            only = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter,
                                                   lse_base=base, wire_dtype=wire)  # fmt: skip
                            assert isinstance(only, torch.Tensor) and only.dtype == dtype
                            check(ctx, only, heads(want, ctx, scatter), heads(mag, ctx, scatter), dtype,
                                  what + " allocated", roundings_for(ctx, wire, dtype))  # fmt: skip


def case_empty_rows(ctx):
    """Empty shards (-inf, +inf, garbage V), rows empty on every rank: (0, -inf), never NaN."""
    N, T, H, D = ctx.N, 40, 2 * ctx.N, 24
    for scatter in ("heads", "none"):
        V, S = states(7, N, T, H, D, torch.bfloat16, ctx.device, empty=0.4, plus_inf=0.2)
        S[:, 3, :] = -INF
        S[0, 5, :] = INF  # +inf on one rank, -inf on the others: still empty
        S[1:, 5, :] = -INF
        V[:, 3] = NAN
        V[:, 5] = INF
        want, lse, mag = expected(V, S)
        got, got_lse = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, return_lse=True)
        check(
            ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.bfloat16, f"empty {scatter}"
        )
        check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", f"empty {scatter} lse")
        if ctx.checking:
            assert not torch.isnan(got).any()
            assert (f64(got[[3, 5]]) == 0).all() and (f64(got_lse[[3, 5]]) == -np.inf).all()


def case_nan(ctx):
    """A NaN LSE on one rank makes that row NaN on every rank (native rule); others untouched."""
    N, T, H, D = ctx.N, 9, 2 * ctx.N, 8
    V, S = states(11, N, T, H, D, torch.float32, ctx.device, empty=0.1, plus_inf=0.0)
    S[N - 1, 4, 0] = NAN
    S[0, 6, H - 1] = NAN
    want, lse, mag = expected(V, S)
    for scatter in ("heads", "none"):
        got, got_lse = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, return_lse=True)
        check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.float32, f"nan {scatter}")
        check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", f"nan {scatter} lse")


def case_sinks(ctx):
    """Sinks counted once: random, -inf (no sink), +inf ((0, +inf)), rows with no keys (0, sink)."""
    N, T, H, D = ctx.N, 12, 2 * ctx.N, 16
    for base in ("e", 2):
        for scatter in ("heads", "none"):
            V, S = states(13, N, T, H, D, torch.float16, ctx.device)
            S[:, 2, :] = -INF
            sinks = torch.from_numpy(np.random.default_rng(5).standard_normal(H) * 3).float().to(ctx.device)
            sinks[0] = -INF
            if H > 2:
                sinks[H - 1] = INF
            want, lse, mag = expected(V, S, base, sinks)
            got, got_lse = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, lse_base=base,
                                           sinks=sinks, return_lse=True)  # fmt: skip
            what = f"sinks base={base} {scatter}"
            check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.float16, what)
            check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")


def case_layouts(ctx):
    """Strided LSE ([H, T] buffer), padded head stride, strided outputs, fp32 and fp8 outputs."""
    N, T, H, D = ctx.N, 21, 2 * ctx.N, 32
    dev = ctx.device
    V, S = states(17, N, T, H, D, torch.bfloat16, dev)
    want, lse, mag = expected(V, S)
    s_ht = S[ctx.rank].T.contiguous().T  # [T, H] view of an [H, T] buffer
    v_pad = torch.full((T, H, D + 8), NAN, dtype=V.dtype, device=dev)[:, :, 3 : 3 + D]  # unaligned
    v_pad.copy_(V[ctx.rank])
    Hn = H // N
    big = torch.full((T, Hn + 1, D + 4), NAN, dtype=torch.float32, device=dev)
    out = big[:, 1:, 2 : 2 + D]
    lse_buf = torch.full((Hn, T + 3), NAN, device=dev)
    out_lse = lse_buf[:, 1 : 1 + T].T
    got, got_lse = zerokv.cp_merge(v_pad, s_ht, ctx.group, out=out, out_lse=out_lse, return_lse=True)
    assert got is out and got_lse is out_lse
    check(ctx, out, heads(want, ctx, "heads"), heads(mag, ctx, "heads"), torch.float32, "strided fp32 out")
    check(ctx, out_lse, heads(lse, ctx, "heads"), None, "lse", "strided out_lse")
    if ctx.checking:  # nothing outside the views written
        assert torch.isnan(big[:, 0]).all() and torch.isnan(big[:, 1:, :2]).all()
        assert torch.isnan(lse_buf[:, 0]).all() and torch.isnan(lse_buf[:, T + 1 :]).all()
    # out_lse without return_lse: written, output returned alone
    ol = poisoned((T, Hn), torch.float32, dev)
    only = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, out_lse=ol)
    assert isinstance(only, torch.Tensor)
    check(ctx, ol, heads(lse, ctx, "heads"), None, "lse", "out_lse without return_lse")
    # fp8 e4m3 output with a scale
    scale = torch.tensor([0.05], device=dev)
    o8 = torch.zeros((T, H, D), dtype=torch.float8_e4m3fn, device=dev)
    zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter="none", out=o8, out_scale=scale)
    if ctx.checking:
        check(ctx, o8, np.clip(want / 0.05, -448, 448), mag / 0.05, "e4m3", "fp8 out")


def vllm_mask_reference(seq_lens, qsl, T):
    """vLLM's mask_dcp_empty_shards_ in numpy (searchsorted as vLLM calls it)."""
    rows = np.arange(T)
    idx = np.minimum(np.searchsorted(qsl[1:], rows, side="right"), len(seq_lens) - 1)
    return (rows >= qsl[-1]) | (seq_lens[idx] == 0)


def case_vllm(ctx):
    """cp_lse_ag_out_rs / _ar: vLLM's empty-shard rule from seq_lens / query_start_loc per rank,
    NaN and +inf LSEs as empty, both bases, 4-D output, [T, H, 1] LSE, a group coordinator."""
    N, H, D = ctx.N, 2 * ctx.N, 16
    rng = np.random.default_rng(23)
    q_lens = rng.integers(0, 5, size=6)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    T = int(qsl[-1]) + 3  # three padding rows past the batch
    coordinator = types.SimpleNamespace(device_group=ctx.group, world_size=N, rank_in_group=ctx.rank)
    for k, (fn, scatter) in enumerate(((vllm.cp_lse_ag_out_rs, "heads"), (vllm.cp_lse_ag_out_ar, "none"))):
        for base_e in (True, False):
            V, S = states(29 + k, N, T, H, D, torch.bfloat16, ctx.device, empty=0.1, plus_inf=0.05)
            S[N - 1, 1, 0] = NAN  # vLLM: NaN counts as empty
            lens = rng.integers(0, 3, size=(N, len(q_lens)))  # this rank's KV per request; 0: empty shard
            lens[:, 0] = 0  # request 0 empty on every rank
            Sm = f64(S)
            for r in range(N):
                Sm[r, vllm_mask_reference(lens[r], qsl, T)] = -np.inf
            Sm = np.where(np.isnan(Sm) | (Sm == np.inf), -np.inf, Sm)
            want, lse, mag = expected(V, torch.from_numpy(Sm), "e" if base_e else 2)
            idx = torch.int32 if k else torch.int64
            seq_lens = torch.from_numpy(lens[ctx.rank]).to(idx).to(ctx.device)
            q = torch.from_numpy(qsl).to(torch.int32).to(ctx.device)
            s_in = S[ctx.rank].clone()
            v_in = V[ctx.rank].clone()
            got, got_lse = fn(
                v_in.unsqueeze(1), s_in.unsqueeze(-1), coordinator, None, True, base_e, seq_lens, q
            )
            what = f"vllm {fn.__name__} base_e={base_e}"
            check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.bfloat16, what,
                  roundings_for(ctx, torch.bfloat16, torch.bfloat16))  # fmt: skip
            check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")
            if ctx.checking:
                assert torch.equal(s_in.nan_to_num(), S[ctx.rank].nan_to_num()), "cp_attn_lse was modified"
                assert torch.equal(v_in.nan_to_num(), V[ctx.rank].nan_to_num()), "cp_attn_out was modified"
                assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
            plain = fn(V[ctx.rank], S[ctx.rank], ctx.group)  # no mask, process group, no LSE
            Sp = f64(S)
            want_p, _, mag_p = expected(V, torch.from_numpy(np.where(np.isnan(Sp), -np.inf, Sp)))
            check(ctx, plain, heads(want_p, ctx, scatter), heads(mag_p, ctx, scatter), torch.bfloat16,
                  what + " unmasked", roundings_for(ctx, torch.bfloat16, torch.bfloat16))  # fmt: skip
    # no requests: only the rows past query_start_loc[0] are masked (vLLM would fail)
    V, S = states(31, N, 6, H, D, torch.float32, ctx.device, empty=0.0, plus_inf=0.0)
    Sm = f64(S)
    Sm[:, 4:] = -np.inf
    want, _, mag = expected(V, torch.from_numpy(Sm))
    none = torch.zeros(0, dtype=torch.int32, device=ctx.device)
    got = vllm.cp_lse_ag_out_ar(V[ctx.rank], S[ctx.rank], ctx.group, seq_lens=none,
                                query_start_loc=torch.tensor([4], dtype=torch.int32, device=ctx.device))  # fmt: skip
    check(ctx, got, want, mag, torch.float32, "vllm, no requests")


def raises(ctx, exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"expected {match!r} in {e!r}"
        return
    raise AssertionError(f"expected {exc.__name__} ({match})")


def case_bad_input(ctx):
    """Rejected calls raise on every rank (no hang) and write nothing."""
    N, T, H, D, dev = ctx.N, 5, 2 * ctx.N, 8, ctx.device
    V, S = states(37, N, T, H, D, torch.float32, dev)
    v, s = V[ctx.rank], S[ctx.rank]
    out = poisoned((T, H // N, D), torch.float32, dev)
    bad_h = torch.zeros((T, 2 * N + 1, D), device=dev)
    if N > 1:
        raises(
            ctx,
            ValueError,
            "cannot be scattered",
            lambda: zerokv.cp_merge(bad_h, torch.zeros(T, 2 * N + 1, device=dev), ctx.group),
        )
    raises(
        ctx,
        ValueError,
        "out: expected shape",
        lambda: zerokv.cp_merge(v, s, ctx.group, out=poisoned((T, H + 1, D), torch.float32, dev)),
    )
    raises(
        ctx,
        ValueError,
        "sinks",
        lambda: zerokv.cp_merge(v, s, ctx.group, out=out, sinks=torch.zeros(H + 1, device=dev)),
    )
    raises(ctx, ValueError, "scatter", lambda: zerokv.cp_merge(v, s, ctx.group, out=out, scatter="rows"))
    raises(ctx, ValueError, "lse_base", lambda: zerokv.cp_merge(v, s, ctx.group, out=out, lse_base=10))
    raises(
        ctx,
        TypeError,
        "wire_dtype",
        lambda: zerokv.cp_merge(v, s, ctx.group, out=out, wire_dtype=torch.int32),
    )
    raises(ctx, ValueError, "s: expected shape", lambda: zerokv.cp_merge(v, s[:, :1], ctx.group, out=out))
    raises(ctx, TypeError, "v: expected a torch tensor", lambda: zerokv.cp_merge(f64(v), s, ctx.group))
    raises(
        ctx,
        ValueError,
        "float8_e4m3fn",
        lambda: zerokv.cp_merge(v, s, ctx.group, out=out, out_scale=torch.ones(1, device=dev)),
    )
    raises(
        ctx,
        ValueError,
        "provided together",
        lambda: vllm.cp_lse_ag_out_rs(
            v, s, ctx.group, seq_lens=torch.zeros(2, dtype=torch.int32, device=dev)
        ),
    )
    raises(ctx, ValueError, "one boundary per sequence", lambda: vllm.cp_lse_ag_out_ar(
        v, s, ctx.group, seq_lens=torch.zeros(2, dtype=torch.int32, device=dev),
        query_start_loc=torch.zeros(2, dtype=torch.int32, device=dev)))  # fmt: skip
    if ctx.real:
        raises(ctx, TypeError, "ProcessGroup", lambda: zerokv.cp_merge(v, s, "group", out=out))
    if ctx.checking:
        assert torch.isnan(out).all(), "a rejected call wrote its output"
    if ctx.device.type == "cpu" and N > 1:  # detectable only on the host path
        t = T + (ctx.rank == N - 1)
        raises(ctx, ValueError, "T differs across the ranks", lambda: zerokv.cp_merge(
            torch.zeros((t, H, D)), torch.zeros((t, H)), ctx.group))  # fmt: skip
        bad = torch.zeros((T, H, D), dtype=torch.int32) if ctx.rank == 0 else v
        exc, msg = (TypeError, "dtype int32") if ctx.rank == 0 else (ValueError, "rank(s) [0]")
        raises(ctx, exc, msg, lambda: zerokv.cp_merge(bad, s, ctx.group, out=out))
        if ctx.checking:
            assert torch.isnan(out).all(), "a rejected call wrote its output"


def cpu_cases(ctx):
    return [
        ("grid", lambda: case_grid(ctx, DTYPES, (0, 1, 7, 33), (1, 8, 13), (None,))),
        ("empty rows", lambda: case_empty_rows(ctx)),
        ("nan", lambda: case_nan(ctx)),
        ("sinks", lambda: case_sinks(ctx)),
        ("layouts", lambda: case_layouts(ctx)),
        ("vllm", lambda: case_vllm(ctx)),
        ("bad input", lambda: case_bad_input(ctx)),
    ]


def run_cases(cases) -> list[str]:
    failures = []
    for name, fn in cases:
        try:
            fn()
        except Exception as e:  # collect every failure; the ranks stay in step
            failures.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
    return failures


# --- CPU: gloo, one spawn of four processes ------------------------------------------------------

WORLD = 4


def _gloo_worker(rank: int, init: str, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    results = {}
    try:
        for n in range(1, WORLD + 1):
            group = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=120))
            if rank < n:
                ctx = Ctx(rank, n, group, torch.device("cpu"))
                results[n] = run_cases(cpu_cases(ctx))
            dist.barrier()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    d = tmp_path_factory.mktemp("gloo")
    torch.multiprocessing.start_processes(
        _gloo_worker, args=(f"file://{d / 'store'}", str(d)), nprocs=WORLD, join=True, start_method="spawn"
    )
    by_n: dict[int, list[str]] = {}
    for r in range(WORLD):
        for n, fails in json.loads((d / f"rank{r}.json").read_text()).items():
            by_n.setdefault(int(n), []).extend(f"rank {r}: {x}" for x in fails)
    return by_n


@pytest.mark.parametrize("n", range(1, WORLD + 1))
def test_gloo_group(gloo_results, n):
    assert n in gloo_results, f"group of {n} did not run"
    assert not gloo_results[n], "\n".join(gloo_results[n])


# --- host-side behaviour without a group ---------------------------------------------------------


def test_needs_an_initialised_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ValueError, match="not initialised"):
        zerokv.cp_merge(torch.zeros(2, 2, 4), torch.zeros(2, 2))


def test_empty_shard_rows_matches_searchsorted():
    rng = np.random.default_rng(3)
    for B in (1, 2, 5, 33):
        for _ in range(20):
            qsl = np.concatenate([[0], np.cumsum(rng.integers(0, 4, size=B))])
            lens = rng.integers(0, 2, size=B)
            T = int(qsl[-1]) + int(rng.integers(0, 3))
            assert (cpm.empty_shard_rows(lens, qsl, T) == vllm_mask_reference(lens, qsl, T)).all()
    assert cpm.empty_shard_rows(np.zeros(0), np.array([2]), 4).tolist() == [False, False, True, True]


def test_shares_sum_to_the_reference():
    """Summing every rank's share of V gives the N-way merge (float64 host math)."""
    rng = np.random.default_rng(9)
    N, T, H, D = 3, 6, 4, 5
    v = rng.standard_normal((N, T, H, D))
    s = rng.standard_normal((N, T, H)) * 3
    s[0, 1, 2] = -np.inf
    s[:, 2, 0] = np.inf
    sinks = rng.standard_normal(H)
    want, lse = reference.merge_states(v, s, "e", sinks)
    total = 0.0
    for r in range(N):
        f, g = cpm.shares(s, r, "e", sinks)
        total = total + np.where(f[..., None] > 0, f[..., None] * v[r], 0.0)
        np.testing.assert_allclose(g, lse, rtol=1e-12)
    np.testing.assert_allclose(total, want, rtol=1e-12, atol=1e-12)


# --- one GPU: the kernels alone, ranks simulated ------------------------------------------------


class SimulatedWorld:
    """N ranks in one process on one GPU. Each case runs three passes over the ranks; the k-th
    collective of a rank records its input, and returns what all ranks recorded for their k-th
    call once every rank has (the LSEs from pass 1 on, the sums in pass 2)."""

    def __init__(self, N):
        self.N, self.rank, self.k = N, 0, 0
        self.gathered: dict = {}
        self.summed: dict = {}

    def start(self, rank):
        self.rank, self.k = rank, 0

    def _next(self):
        self.k += 1
        return self.k

    def all_gather(self, out, src, group=None, async_op=False):
        got = self.gathered.setdefault(self._next(), {})
        got[self.rank] = src.clone()
        if len(got) == self.N:
            out.copy_(torch.cat([got[r].reshape(-1) for r in range(self.N)]))
        return _Done() if async_op else None

    def reduce_scatter(self, out, src, group=None, async_op=False):
        got = self.summed.setdefault(self._next(), {})
        got[self.rank] = src.clone()
        if len(got) == self.N:
            total = sum(got[r].float() for r in range(self.N)).view(self.N, -1)[self.rank]
            out.copy_(total.to(out.dtype))
        return _Done() if async_op else None

    def all_reduce(self, t, group=None, async_op=False):
        got = self.summed.setdefault(self._next(), {})
        got[self.rank] = t.clone()
        if len(got) == self.N:
            t.copy_(sum(got[r].float() for r in range(self.N)).to(t.dtype))
        return _Done() if async_op else None


class _Done:
    def wait(self):
        return True


def pipelined(module, chunk_bytes):
    """Force the chunked (pipelined) combine on small inputs; returns the undo."""
    saved = module._OVERLAP_MIN_BYTES, module._OVERLAP_CHUNK_BYTES
    module._OVERLAP_MIN_BYTES, module._OVERLAP_CHUNK_BYTES = 1, chunk_bytes

    def undo():
        module._OVERLAP_MIN_BYTES, module._OVERLAP_CHUNK_BYTES = saved

    return undo


def case_pipelined(ctx):
    """The chunked combine (collectives issued asynchronously, kernels per chunk of tokens):
    chunk edges inside the batch, both scatter modes, both wires, converted and direct outputs."""
    undo = pipelined(cpm, 20_000)
    try:
        case_grid(ctx, (torch.bfloat16, torch.float32), (1, 37, 300), (24, 128), (None, "input"), seed=500)
        case_empty_rows(ctx)
        case_vllm(ctx)
        if ctx.checking:
            assert len(cpm._chunks(300, 4 * 2 * ctx.N * 128, 2, False)) > 1
    finally:
        undo()


def simulate(monkeypatch, N, case):
    world = SimulatedWorld(N)
    monkeypatch.setattr(cpm, "_group", lambda torch_, group, arg: (None, N, world.rank))
    monkeypatch.setattr(
        cpm, "_collectives", lambda torch_: (world.all_gather, world.reduce_scatter, world.all_reduce)
    )
    try:
        for p in range(3):
            REFERENCE[0] = p == 2
            for r in range(N):
                world.start(r)
                case(Ctx(r, N, None, torch.device("cuda", 0), checking=p == 2, real=False))
    finally:
        REFERENCE[0] = True


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_kernels_with_simulated_ranks(monkeypatch, N):
    torch.manual_seed(N)
    simulate(monkeypatch, N, lambda c: case_grid(c, DTYPES, (0, 1, 7, 300), (13, 128), (None, "input")))
    simulate(monkeypatch, N, case_empty_rows)
    simulate(monkeypatch, N, case_nan)
    simulate(monkeypatch, N, case_sinks)
    simulate(monkeypatch, N, case_layouts)
    simulate(monkeypatch, N, case_vllm)
    simulate(monkeypatch, N, case_bad_input)
    simulate(monkeypatch, N, case_pipelined)


# --- two GPUs: NCCL --------------------------------------------------------------------------------


def gpu_grid(ctx):
    """Output dtype x D x T x scatter x wire (float32 and the input dtype) on real NCCL."""
    k = 100
    for dtype in DTYPES:
        for D in (128, 512):
            for T in (0, 1, 7, 4096):
                k += 1
                H = 2 * ctx.N
                V, S = states(k, ctx.N, T, H, D, dtype, ctx.device)
                want, lse, mag = expected(V, S)
                for scatter in ("heads", "none"):
                    for wire in (None, dtype):
                        Hn = H // ctx.N if scatter == "heads" else H
                        out = poisoned((T, Hn, D), dtype, ctx.device)
                        out_lse = poisoned((T, Hn), torch.float32, ctx.device)
                        zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, wire_dtype=wire,
                                        out=out, out_lse=out_lse)  # fmt: skip
                        what = f"nccl {dtype} T={T} D={D} {scatter} wire={wire}"
                        check(ctx, out, heads(want, ctx, scatter), heads(mag, ctx, scatter), dtype, what,
                              roundings_for(ctx, wire, dtype))  # fmt: skip
                        check(ctx, out_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")


def case_graph(ctx, chunk_bytes=None):
    """cp_merge captured in a CUDA graph with its NCCL collectives (issued asynchronously and
    waited for in the pipelined combine: ``chunk_bytes``); replayed on new inputs."""
    undo = pipelined(cpm, chunk_bytes) if chunk_bytes else (lambda: None)
    try:
        _graph(ctx)
    finally:
        undo()


def _graph(ctx):
    N, T, H, D, dev = ctx.N, 64, 4 * ctx.N, 128, ctx.device
    V, S = states(41, N, T, H, D, torch.bfloat16, dev)
    v, s = V[ctx.rank].clone(), S[ctx.rank].clone()
    out = poisoned((T, H // N, D), torch.bfloat16, dev)
    out_lse = poisoned((T, H // N), torch.float32, dev)
    zerokv.cp_merge(v, s, ctx.group, out=out, out_lse=out_lse)  # warm-up: compile, NCCL set-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev), capture_error_mode="thread_local"):
        zerokv.cp_merge(v, s, ctx.group, out=out, out_lse=out_lse)
    for seed in (43, 47):
        V, S = states(seed, N, T, H, D, torch.bfloat16, dev)
        v.copy_(V[ctx.rank])
        s.copy_(S[ctx.rank])
        out.fill_(NAN)
        out_lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        want, lse, mag = expected(V, S)
        check(
            ctx,
            out,
            heads(want, ctx, "heads"),
            heads(mag, ctx, "heads"),
            torch.bfloat16,
            f"graph replay {seed}",
        )
        check(ctx, out_lse, heads(lse, ctx, "heads"), None, "lse", f"graph replay {seed} lse")


def _nccl_worker(rank: int, world: int, init: str, outdir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    failures = []
    try:
        ctx = Ctx(rank, world, None, torch.device("cuda", rank))
        cases = [(n, fn) for n, fn in cpu_cases(ctx) if n != "grid"]
        cases += [("gpu grid", lambda: gpu_grid(ctx)), ("graph", lambda: case_graph(ctx))]
        cases += [
            ("pipelined", lambda: case_pipelined(ctx)),
            ("pipelined graph", lambda: case_graph(ctx, 50_000)),
        ]
        failures = run_cases(cases)
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(failures, f)
        dist.destroy_process_group()


def nccl_run(tmp_path, world: int) -> None:
    torch.multiprocessing.start_processes(
        _nccl_worker, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=world, join=True,
        start_method="spawn",
    )  # fmt: skip
    failures = [
        f"rank {r}: {x}" for r in range(world) for x in json.loads((tmp_path / f"rank{r}.json").read_text())
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_nccl_one_gpu(tmp_path):
    """A real NCCL group of one: the default-group path, no collectives, the same cases."""
    nccl_run(tmp_path, 1)


@pytest.mark.multigpu
def test_nccl_two_gpus(tmp_path):
    nccl_run(tmp_path, 2)
