"""Cases of ``cp_merge`` and vLLM's DCP combine adapters, run by every rank of a group.

Used by ``tests/test_cp_merge.py`` (gloo on the CPU, ranks simulated on one GPU) and
``tests/test_multigpu.py`` (NCCL on two GPUs). Every rank builds all ranks' inputs from one
seed, passes its own, and compares its output with independent oracles (``oracles.py``, never
zerokv's reference): the float64 merge of all ranks' inputs (``oracles.merge``) and, for the
split-keys case, attention computed directly over all keys (``oracles.attention``). Outputs are
poisoned with NaN before each call.

Failures surface: a check never raises inside a case. It records its message on the rank's
``Ctx`` and the case goes on, so every rank issues every collective in the same order whatever
the values; the failures are gathered and asserted once every rank has finished.
"""

from __future__ import annotations

import functools
import importlib
import traceback
import types

import numpy as np
import oracles
import torch
from conftest import f64

import zerokv
from zerokv.compat import vllm

cpm = importlib.import_module("zerokv.cp_merge")  # the module (zerokv.cp_merge is the function)
cp_ag = importlib.import_module("zerokv.cp_merge.allgather")
cp_cpu = importlib.import_module("zerokv.cp_merge.cpu_path")
NAN = float("nan")
INF = float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODES = (("heads", "allgather"), ("none", "allgather"), ("heads", "a2a"))  # (scatter, exchange)

# --- ranks and their failures --------------------------------------------------------------------


class Ctx:
    """One rank's view: rank, group size, group (None in the simulation), device, whether
    checks run (the simulation's early passes produce no results), and the failures found."""

    def __init__(self, rank, N, group, device, checking=True, real=True, failures=None):
        self.rank, self.N, self.group, self.device = rank, N, group, device
        self.checking, self.real = checking, real
        self.failures = [] if failures is None else failures
        self.case = ""

    def expect(self, ok, message):
        """Record ``message`` when ``ok`` is false; never raises (the ranks stay in step)."""
        if self.checking and not ok:
            self.failures.append(f"rank {self.rank} of {self.N}, {self.case}: {message}")


def run_cases(ctx, cases):
    """Run every case; an exception (a bug, not a wrong value) is recorded and the next case runs."""
    for name, fn in cases:
        ctx.case = name
        try:
            fn()
        except Exception as e:
            ctx.failures.append(
                f"rank {ctx.rank} of {ctx.N}, {name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            )
    return ctx.failures


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


def split_keys(seed, N, T, H, D, base, sinks=None):
    """Attention over keys split into N shards (``oracles.attention``, float64): each row its own
    K keys, logits ``q.k / sqrt(Dk)`` in base-``base`` units with a spread of about 3; shard r
    holds a contiguous span of a row's keys (spans of every size, empty ones included: LSE -inf,
    V NaN). Returns the shards' states ``V [N, T, H, D]``, ``S [N, T, H]`` and attention over all
    keys at once ``(out, lse, mag)``, ``mag`` the same weights over ``|v|`` (``sinks``: one more
    logit per head in the normaliser, with V = 0)."""
    rng = np.random.default_rng(seed)
    K, Dk = 3 * N + 2, 16
    q = rng.standard_normal((T, 1, H, Dk)) * np.sqrt(3.0)  # q.k / sqrt(Dk): standard deviation 3
    k = rng.standard_normal((T, K, H, Dk)) * np.sqrt(3.0)
    values = rng.standard_normal((T, K, H, D))
    cuts = np.sort(rng.integers(0, K + 1, size=(T, N - 1)), axis=1)
    edges = np.concatenate([np.zeros((T, 1), int), cuts, np.full((T, 1), K)], axis=1)  # [T, N + 1]
    edges[0, :] = 0  # token 0: every key on the last rank, the others empty
    edges[0, -1] = K
    if T > 1:
        edges[1, 1:] = K  # token 1: every key on rank 0
    V = np.full((N, T, H, D), np.nan)
    S = np.full((N, T, H), -np.inf)
    out, lse, mag = np.zeros((T, H, D)), np.zeros((T, H)), np.zeros((T, H, D))
    for t in range(T):
        for r in range(N):
            lo, hi = edges[t, r], edges[t, r + 1]
            if hi > lo:
                o, s_ = oracles.attention(q[t], k[t, lo:hi], values[t, lo:hi], base)
                V[r, t], S[r, t] = o[0], s_[0]
        o, s_ = oracles.attention(q[t], k[t], values[t], base, sinks)
        out[t], lse[t] = o[0], s_[0]
        mag[t] = oracles.attention(q[t], k[t], np.abs(values[t]), base, sinks)[0][0]
    return V, S, out, lse, mag


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
    magnitude ``mag`` (the sum of |share|: cancellation does not hide an error). A mismatch is
    recorded on ``ctx``, never raised."""
    if not ctx.checking:
        return
    try:
        _check(got, want, mag, kind, what, roundings)
    except AssertionError as e:
        ctx.expect(False, str(e))


def _check(got, want, mag, kind, what, roundings):
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
WRONG = [0.0]  # a deliberate error added to the oracle (the failure-surfacing test only)


def expected(V, S, base="e", sinks=None):
    """The float64 merge of all ranks' states (the oracle), and the magnitude of the shares (for
    the bounds)."""
    if not REFERENCE[0]:
        return None, None, None
    Vd, Sd = f64(V), f64(S)
    sk = None if sinks is None else f64(sinks)
    out, lse = oracles.merge(Vd, Sd, base, sk)
    mag, _ = oracles.merge(np.abs(Vd), Sd, base, sk)
    return out + WRONG[0], lse, mag


def heads(x, ctx, scatter):
    """This rank's part of an ``[T, H, ...]`` array."""
    if scatter == "none" or x is None:
        return x
    Hn = x.shape[1] // ctx.N
    return x[:, ctx.rank * Hn : (ctx.rank + 1) * Hn]


def poisoned(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(NAN) if dtype.is_floating_point and t.numel() else t


def roundings_for(ctx, wire, dtype, exchange="allgather"):
    """One rounding with a float32 wire, on the CPU (float64 sums) or over the all-to-all (V
    sent as it is, merged in float32); with a 16-bit summing wire, one per share and per step."""
    if (
        exchange == "a2a"
        or ctx.device.type == "cpu"
        or wire in (None, torch.float32)
        or dtype == torch.float32
    ):
        return 1
    return 2 * ctx.N + 1


def modes(scatters=("heads", "none")):
    return [(sc, ex) for sc, ex in MODES if sc in scatters]


# --- cases: each runs on every rank of the group, in the same order ----------------------------


def case_grid(ctx, dtypes, Ts, Ds, wires, seed=0):
    """Random states over shapes, dtypes, the three modes, both LSE bases, wires."""
    k = seed
    for dtype in dtypes:
        for T in Ts:
            for D in Ds:
                for scatter, exchange in modes():
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
                            V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange,
                            lse_base=base, return_lse=True, wire_dtype=wire, out=out,
                        )  # fmt: skip
                        what = f"{dtype} T={T} D={D} {scatter} {exchange} base={base} wire={wire}"
                        ctx.expect(got is out, f"{what}: out not returned")
                        r = roundings_for(ctx, wire, dtype, exchange)
                        check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), dtype, what, r)
                        check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")
                        if k % 3 == 0:  # allocated output, no LSE
                            only = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter,
                                                   exchange=exchange, lse_base=base, wire_dtype=wire)  # fmt: skip
                            ctx.expect(
                                isinstance(only, torch.Tensor) and only.dtype == dtype, f"{what}: allocated"
                            )
                            check(ctx, only, heads(want, ctx, scatter), heads(mag, ctx, scatter), dtype,
                                  what + " allocated", r)  # fmt: skip


def case_empty_rows(ctx):
    """Empty shards (-inf, +inf, garbage V), rows empty on every rank: (0, -inf), never NaN."""
    N, T, H, D = ctx.N, 40, 2 * ctx.N, 24
    for scatter, exchange in modes():
        V, S = states(7, N, T, H, D, torch.bfloat16, ctx.device, empty=0.4, plus_inf=0.2)
        S[:, 3, :] = -INF
        S[0, 5, :] = INF  # +inf on one rank, -inf on the others: still empty
        S[1:, 5, :] = -INF
        V[:, 3] = NAN
        V[:, 5] = INF
        want, lse, mag = expected(V, S)
        got, got_lse = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange,
                                       return_lse=True)  # fmt: skip
        what = f"empty {scatter} {exchange}"
        check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.bfloat16, what)
        check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")
        if ctx.checking:
            ctx.expect(not torch.isnan(got).any(), f"{what}: NaN in the output")
            ctx.expect((f64(got[[3, 5]]) == 0).all() and (f64(got_lse[[3, 5]]) == -np.inf).all(),
                       f"{what}: rows empty on every rank are not (0, -inf)")  # fmt: skip


def case_every_empty_pattern(ctx):
    """Every pattern of empty ranks for one row (2^N of them, -inf and +inf, garbage V)."""
    N, D = ctx.N, 8
    T = 2**N
    H = N
    V, S = states(9, N, T, H, D, torch.float32, ctx.device, empty=0.0, plus_inf=0.0)
    for t in range(T):
        for r in range(N):
            if t >> r & 1:
                S[r, t] = INF if (t + r) % 3 == 0 else -INF
                V[r, t] = NAN if r % 2 else INF
    want, lse, mag = expected(V, S)
    for scatter, exchange in modes():
        got, got_lse = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange,
                                       return_lse=True)  # fmt: skip
        what = f"empty patterns {scatter} {exchange}"
        check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.float32, what)
        check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")


def case_nan(ctx):
    """A NaN LSE on one rank makes that row NaN on every rank (native rule); others untouched."""
    N, T, H, D = ctx.N, 9, 2 * ctx.N, 8
    V, S = states(11, N, T, H, D, torch.float32, ctx.device, empty=0.1, plus_inf=0.0)
    S[N - 1, 4, 0] = NAN
    S[0, 6, H - 1] = NAN
    want, lse, mag = expected(V, S)
    for scatter, exchange in modes():
        got, got_lse = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange,
                                       return_lse=True)  # fmt: skip
        what = f"nan {scatter} {exchange}"
        check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.float32, what)
        check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")


def case_sinks(ctx):
    """Sinks counted once: random, -inf (no sink), +inf ((0, +inf)), rows with no keys (0, sink)."""
    N, T, H, D = ctx.N, 12, 2 * ctx.N, 16
    for base in ("e", 2):
        for scatter, exchange in modes():
            V, S = states(13, N, T, H, D, torch.float16, ctx.device)
            S[:, 2, :] = -INF
            sinks = torch.from_numpy(np.random.default_rng(5).standard_normal(H) * 3).float().to(ctx.device)
            sinks[0] = -INF
            if H > 2:
                sinks[H - 1] = INF
            want, lse, mag = expected(V, S, base, sinks)
            got, got_lse = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange,
                                           lse_base=base, sinks=sinks, return_lse=True)  # fmt: skip
            what = f"sinks base={base} {scatter} {exchange}"
            check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.float16, what)
            check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")


def case_split_keys(ctx):
    """The defining property, against attention computed over all keys at once (not the
    reference merge): shards of every size (empty ones too), both bases, with and without sinks."""
    N, T, H, D = ctx.N, 6, 2 * ctx.N, 16
    for k, base in enumerate(("e", 2, "e")):
        sinks = np.random.default_rng(k).standard_normal(H) if k == 2 else None
        V, S, want, lse, mag = split_keys(50 + k, N, T, H, D, base, sinks)
        v = torch.from_numpy(V[ctx.rank]).float().to(ctx.device)
        s = torch.from_numpy(S[ctx.rank]).float().to(ctx.device)
        sk = None if sinks is None else torch.from_numpy(sinks).float().to(ctx.device)
        for scatter, exchange in modes():
            for dtype in (torch.float32, torch.bfloat16):
                Hn = H // N if scatter == "heads" else H
                out = poisoned((T, Hn, D), dtype, ctx.device)
                zerokv.cp_merge(v, s, ctx.group, scatter=scatter, exchange=exchange, lse_base=base, sinks=sk,
                                out=out)  # fmt: skip
                what = f"split keys base={base} sinks={sk is not None} {scatter} {exchange} {dtype}"
                check(ctx, out, heads(want, ctx, scatter), heads(mag, ctx, scatter), dtype, what,
                      3 if dtype == torch.float32 else 1)  # fmt: skip


def case_modes_agree(ctx):
    """AG + RS, AG + AR and the all-to-all give outputs within one output rounding of each other."""
    N, T, H, D = ctx.N, 17, 2 * ctx.N, 40
    for dtype in DTYPES:
        V, S = states(61, N, T, H, D, dtype, ctx.device)
        got = {}
        for scatter, exchange in MODES:
            o = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange)
            got[(scatter, exchange)] = f64(o if scatter == "heads" else heads(o, ctx, "heads"))
        if not ctx.checking:
            continue
        _, _, mag = expected(V, S)
        m = heads(mag, ctx, "heads")
        base = got[MODES[0]]
        for mode in MODES[1:]:
            other = got[mode]
            with np.errstate(invalid="ignore"):
                bound = ulp(np.maximum(np.abs(base), np.abs(other)), dtype) + 8e-6 * m
                same = (base == other) | (np.abs(base - other) <= bound)
            same |= np.isnan(base) & np.isnan(other)
            ctx.expect(same.all(), f"{dtype}: {mode} differs from {MODES[0]} by more than one rounding "
                                   f"at {np.argwhere(~same)[:3].tolist()}")  # fmt: skip


def case_send_buffer(ctx):
    """The all-to-all without the pack: the state written into cp_send_buffer's views (reused
    for two calls), the same results as the packed call."""
    N, T, H, D = ctx.N, 11, 2 * ctx.N, 24
    Hn = H // N
    for dtype in (torch.bfloat16, torch.float32):
        v, lse, send = zerokv.cp_send_buffer(T, H, D, dtype, ctx.group, device=ctx.device)
        ctx.expect(tuple(v.shape) == (N, T, Hn, D) and tuple(lse.shape) == (N, T, Hn), "view shapes")
        ctx.expect(v.dtype == dtype and lse.dtype == torch.float32, "view dtypes")
        for seed in (71, 73):
            V, S = states(seed, N, T, H, D, dtype, ctx.device)
            for j in range(N):  # what an attention kernel would write through the views
                v[j].copy_(V[ctx.rank][:, j * Hn : (j + 1) * Hn])
                lse[j].copy_(S[ctx.rank][:, j * Hn : (j + 1) * Hn])
            want, want_lse, mag = expected(V, S, 2)
            out = poisoned((T, Hn, D), dtype, ctx.device)
            out_lse = poisoned((T, Hn), torch.float32, ctx.device)
            got = zerokv.cp_merge(
                v, lse, ctx.group, exchange="a2a", send=send, out=out, out_lse=out_lse, lse_base=2
            )
            what = f"send buffer {dtype} seed={seed}"
            ctx.expect(got is out, f"{what}: out not returned")
            check(ctx, out, heads(want, ctx, "heads"), heads(mag, ctx, "heads"), dtype, what)
            check(ctx, out_lse, heads(want_lse, ctx, "heads"), None, "lse", what + " lse")
        alloc, alloc_lse = zerokv.cp_merge(
            v, lse, ctx.group, exchange="a2a", send=send, return_lse=True, lse_base=2
        )
        ctx.expect(
            alloc.dtype == dtype and tuple(alloc.shape) == (T, Hn, D), "allocated output of the send buffer"
        )
        check(
            ctx,
            alloc,
            heads(want, ctx, "heads"),
            heads(mag, ctx, "heads"),
            dtype,
            f"send buffer {dtype} alloc",
        )


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
    for exchange in ("allgather", "a2a"):
        what = f"layouts {exchange}"
        big = torch.full((T, Hn + 1, D + 4), NAN, dtype=torch.float32, device=dev)
        out = big[:, 1:, 2 : 2 + D]
        lse_buf = torch.full((Hn, T + 3), NAN, device=dev)
        out_lse = lse_buf[:, 1 : 1 + T].T
        got, got_lse = zerokv.cp_merge(v_pad, s_ht, ctx.group, exchange=exchange, out=out, out_lse=out_lse,
                                       return_lse=True)  # fmt: skip
        ctx.expect(got is out and got_lse is out_lse, f"{what}: outputs not returned")
        check(
            ctx,
            out,
            heads(want, ctx, "heads"),
            heads(mag, ctx, "heads"),
            torch.float32,
            what + " strided fp32 out",
        )
        check(ctx, out_lse, heads(lse, ctx, "heads"), None, "lse", what + " strided out_lse")
        if ctx.checking:  # nothing outside the views written
            ctx.expect(
                torch.isnan(big[:, 0]).all() and torch.isnan(big[:, 1:, :2]).all(), f"{what}: wrote past out"
            )
            ctx.expect(torch.isnan(lse_buf[:, 0]).all() and torch.isnan(lse_buf[:, T + 1 :]).all(),
                       f"{what}: wrote past out_lse")  # fmt: skip
        # out_lse without return_lse: written, output returned alone
        ol = poisoned((T, Hn), torch.float32, dev)
        only = zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, exchange=exchange, out_lse=ol)
        ctx.expect(isinstance(only, torch.Tensor), f"{what}: return_lse=False returned {type(only).__name__}")
        check(ctx, ol, heads(lse, ctx, "heads"), None, "lse", what + " out_lse without return_lse")
        # fp8 e4m3 output with a scale
        scale = torch.tensor([0.05], device=dev)
        scatter = "none" if exchange == "allgather" else "heads"
        o8 = torch.zeros((T, H if scatter == "none" else Hn, D), dtype=torch.float8_e4m3fn, device=dev)
        zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange, out=o8,
                        out_scale=scale)  # fmt: skip
        if ctx.checking:
            check(ctx, o8, heads(np.clip(want / 0.05, -448, 448), ctx, scatter), heads(mag / 0.05, ctx, scatter),
                  "e4m3", what + " fp8 out")  # fmt: skip


def vllm_mask_reference(seq_lens, qsl, T):
    """vLLM's mask_dcp_empty_shards_ in numpy (searchsorted as vLLM calls it)."""
    rows = np.arange(T)
    idx = np.minimum(np.searchsorted(qsl[1:], rows, side="right"), len(seq_lens) - 1)
    return (rows >= qsl[-1]) | (seq_lens[idx] == 0)


VLLM_FNS = (
    (vllm.cp_lse_ag_out_rs, "heads", "allgather"),
    (vllm.cp_lse_ag_out_ar, "none", "allgather"),
    (vllm.dcp_a2a_lse_reduce, "heads", "a2a"),
)


def case_vllm(ctx):
    """cp_lse_ag_out_rs / _ar / dcp_a2a_lse_reduce: vLLM's empty-shard rule from seq_lens /
    query_start_loc per rank, NaN and +inf LSEs as empty, both bases, 4-D output, [T, H, 1] LSE,
    a group coordinator."""
    N, H, D = ctx.N, 2 * ctx.N, 16
    rng = np.random.default_rng(23)
    q_lens = rng.integers(0, 5, size=6)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    T = int(qsl[-1]) + 3  # three padding rows past the batch
    coordinator = types.SimpleNamespace(device_group=ctx.group, world_size=N, rank_in_group=ctx.rank)
    for k, (fn, scatter, exchange) in enumerate(VLLM_FNS):
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
            idx = torch.int32 if k % 2 else torch.int64
            seq_lens = torch.from_numpy(lens[ctx.rank]).to(idx).to(ctx.device)
            q = torch.from_numpy(qsl).to(torch.int32).to(ctx.device)
            s_in = S[ctx.rank].clone()
            v_in = V[ctx.rank].clone()
            got, got_lse = fn(
                v_in.unsqueeze(1), s_in.unsqueeze(-1), coordinator, None, True, base_e, seq_lens, q
            )
            what = f"vllm {fn.__name__} base_e={base_e}"
            r = roundings_for(ctx, torch.bfloat16, torch.bfloat16, exchange)
            check(ctx, got, heads(want, ctx, scatter), heads(mag, ctx, scatter), torch.bfloat16, what, r)
            check(ctx, got_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")
            if ctx.checking:
                ctx.expect(
                    torch.equal(s_in.nan_to_num(), S[ctx.rank].nan_to_num()), f"{what}: cp_attn_lse modified"
                )
                ctx.expect(
                    torch.equal(v_in.nan_to_num(), V[ctx.rank].nan_to_num()), f"{what}: cp_attn_out modified"
                )
                ctx.expect(
                    got.dtype == torch.bfloat16 and not torch.isnan(got).any(), f"{what}: dtype or NaN"
                )
            plain = fn(V[ctx.rank], S[ctx.rank], ctx.group)  # no mask, process group, no LSE
            Sp = f64(S)
            want_p, _, mag_p = expected(V, torch.from_numpy(np.where(np.isnan(Sp), -np.inf, Sp)))
            check(ctx, plain, heads(want_p, ctx, scatter), heads(mag_p, ctx, scatter), torch.bfloat16,
                  what + " unmasked", r)  # fmt: skip
    # no requests: only the rows past query_start_loc[0] are masked (vLLM would fail)
    V, S = states(31, N, 6, H, D, torch.float32, ctx.device, empty=0.0, plus_inf=0.0)
    Sm = f64(S)
    Sm[:, 4:] = -np.inf
    want, _, mag = expected(V, torch.from_numpy(Sm))
    none = torch.zeros(0, dtype=torch.int32, device=ctx.device)
    q4 = torch.tensor([4], dtype=torch.int32, device=ctx.device)
    got = vllm.cp_lse_ag_out_ar(V[ctx.rank], S[ctx.rank], ctx.group, seq_lens=none, query_start_loc=q4)
    check(ctx, got, want, mag, torch.float32, "vllm, no requests")
    got = vllm.dcp_a2a_lse_reduce(V[ctx.rank], S[ctx.rank], ctx.group, seq_lens=none, query_start_loc=q4)
    check(
        ctx, got, heads(want, ctx, "heads"), heads(mag, ctx, "heads"), torch.float32, "vllm a2a, no requests"
    )


def raises(ctx, exc, match, fn):
    """Record a failure unless ``fn()`` raises ``exc`` with ``match`` in its message."""
    try:
        fn()
    except exc as e:
        ctx.expect(match in str(e), f"expected {match!r} in {e!r}")
        return
    except Exception as e:
        ctx.expect(False, f"expected {exc.__name__} ({match}), got {type(e).__name__}: {e}")
        return
    ctx.expect(False, f"expected {exc.__name__} ({match}), nothing raised")


def case_bad_input(ctx):
    """Rejected calls raise on every rank (no hang) and write nothing."""
    N, T, H, D, dev = ctx.N, 5, 2 * ctx.N, 8, ctx.device
    V, S = states(37, N, T, H, D, torch.float32, dev)
    v, s = V[ctx.rank], S[ctx.rank]
    out = poisoned((T, H // N, D), torch.float32, dev)
    cp = zerokv.cp_merge
    if N > 1:
        bad_h = torch.zeros((T, 2 * N + 1, D), device=dev)
        bad_s = torch.zeros(T, 2 * N + 1, device=dev)
        raises(ctx, ValueError, "cannot be scattered", lambda: cp(bad_h, bad_s, ctx.group))
        raises(ctx, ValueError, "cannot be scattered", lambda: cp(bad_h, bad_s, ctx.group, exchange="a2a"))
        raises(ctx, ValueError, f"H={2 * N + 1} must be divisible by DCP world size {N}",
               lambda: vllm.dcp_a2a_lse_reduce(bad_h, bad_s, ctx.group))  # fmt: skip
    raises(ctx, ValueError, "out: expected shape",
           lambda: cp(v, s, ctx.group, out=poisoned((T, H + 1, D), torch.float32, dev)))  # fmt: skip
    raises(
        ctx, ValueError, "sinks", lambda: cp(v, s, ctx.group, out=out, sinks=torch.zeros(H + 1, device=dev))
    )
    raises(ctx, ValueError, "scatter", lambda: cp(v, s, ctx.group, out=out, scatter="rows"))
    raises(ctx, ValueError, "exchange: expected 'allgather' or 'a2a', got 'ring'",
           lambda: cp(v, s, ctx.group, out=out, exchange="ring"))  # fmt: skip
    raises(ctx, ValueError, "needs scatter='heads'",
           lambda: cp(v, s, ctx.group, out=out, scatter="none", exchange="a2a"))  # fmt: skip
    raises(ctx, ValueError, "lse_base", lambda: cp(v, s, ctx.group, out=out, lse_base=10))
    raises(ctx, TypeError, "wire_dtype", lambda: cp(v, s, ctx.group, out=out, wire_dtype=torch.int32))
    raises(ctx, ValueError, "s: expected shape", lambda: cp(v, s[:, :1], ctx.group, out=out))
    raises(ctx, TypeError, "v: expected a torch tensor", lambda: cp(f64(v), s, ctx.group))
    raises(ctx, TypeError, "v: dtype float8_e4m3fn is not supported",
           lambda: cp(v.to(torch.float8_e4m3fn), s, ctx.group, exchange="a2a"))  # fmt: skip
    raises(ctx, ValueError, "Cannot pack fp32 LSE into output dtype torch.float8_e4m3fn",
           lambda: vllm.dcp_a2a_lse_reduce(v.to(torch.float8_e4m3fn), s, ctx.group))  # fmt: skip
    raises(
        ctx,
        ValueError,
        "float8_e4m3fn",
        lambda: cp(v, s, ctx.group, out=out, out_scale=torch.ones(1, device=dev)),
    )
    raises(
        ctx,
        ValueError,
        "provided together",
        lambda: vllm.dcp_a2a_lse_reduce(
            v, s, ctx.group, seq_lens=torch.zeros(2, dtype=torch.int32, device=dev)
        ),
    )
    raises(ctx, ValueError, "one boundary per sequence", lambda: vllm.cp_lse_ag_out_ar(
        v, s, ctx.group, seq_lens=torch.zeros(2, dtype=torch.int32, device=dev),
        query_start_loc=torch.zeros(2, dtype=torch.int32, device=dev)))  # fmt: skip
    sv, slse, send = zerokv.cp_send_buffer(T, H, D, torch.float32, ctx.group, device=dev)
    raises(ctx, ValueError, "pass the views cp_send_buffer returned",
           lambda: cp(v, s, ctx.group, exchange="a2a", send=send, out=out))  # fmt: skip
    raises(ctx, ValueError, "send: a send buffer is for exchange='a2a'",
           lambda: cp(sv, slse, ctx.group, send=send, out=out))  # fmt: skip
    raises(ctx, TypeError, "send: expected what cp_send_buffer returned",
           lambda: cp(sv, slse, ctx.group, exchange="a2a", send=object(), out=out))  # fmt: skip
    raises(ctx, ValueError, "send buffer carries float32",
           lambda: cp(sv, slse, ctx.group, exchange="a2a", send=send, wire_dtype=torch.bfloat16))  # fmt: skip
    raises(ctx, ValueError, "H: 7 heads cannot be split" if N > 1 else "T: expected a non-negative int",
           lambda: zerokv.cp_send_buffer(-1 if N == 1 else 4, 7, 8, torch.float32, ctx.group, device=dev))  # fmt: skip
    if ctx.real:
        raises(ctx, TypeError, "ProcessGroup", lambda: cp(v, s, "group", out=out))
    if ctx.checking:
        ctx.expect(torch.isnan(out).all(), "a rejected call wrote its output")
    if ctx.device.type == "cpu" and N > 1:  # detectable only on the host path
        t = T + (ctx.rank == N - 1)
        raises(ctx, ValueError, "T differs across the ranks",
               lambda: cp(torch.zeros((t, H, D)), torch.zeros((t, H)), ctx.group, exchange="a2a"))  # fmt: skip
        ex = "a2a" if ctx.rank == 0 else "allgather"
        raises(ctx, ValueError, "exchange differs across the ranks", lambda: cp(v, s, ctx.group, exchange=ex))
        bad = torch.zeros((T, H, D), dtype=torch.int32) if ctx.rank == 0 else v
        exc, msg = (TypeError, "dtype int32") if ctx.rank == 0 else (ValueError, "rank(s) [0]")
        raises(ctx, exc, msg, lambda: cp(bad, s, ctx.group, out=out))
        if ctx.checking:
            ctx.expect(torch.isnan(out).all(), "a rejected call wrote its output")


def case_wrong_value(ctx):
    """A deliberately wrong reference on the last rank (the failure-surfacing test): the rank
    records the mismatch with its message and every rank goes on in step."""
    WRONG[0] = 0.25 if ctx.rank == ctx.N - 1 else 0.0
    try:
        case_grid(ctx, (torch.float32,), (3,), (8,), (None,), seed=900)
    finally:
        WRONG[0] = 0.0


def cases(ctx, grid):
    """Every case of a group, in order; ``grid`` runs the grid of shapes and dtypes."""
    return [
        ("grid", grid),
        ("empty rows", lambda: case_empty_rows(ctx)),
        ("every empty pattern", lambda: case_every_empty_pattern(ctx)),
        ("nan", lambda: case_nan(ctx)),
        ("sinks", lambda: case_sinks(ctx)),
        ("split keys", lambda: case_split_keys(ctx)),
        ("modes agree", lambda: case_modes_agree(ctx)),
        ("send buffer", lambda: case_send_buffer(ctx)),
        ("layouts", lambda: case_layouts(ctx)),
        ("vllm", lambda: case_vllm(ctx)),
        ("bad input", lambda: case_bad_input(ctx)),
    ]


# --- GPU: the chunked combine, CUDA graphs, NCCL ---------------------------------------------------


def pipelined(chunk_bytes):
    """Force the chunked (pipelined) all-gather combine on small inputs; returns the undo."""
    saved = cp_ag._OVERLAP_MIN_BYTES, cp_ag._OVERLAP_CHUNK_BYTES
    cp_ag._OVERLAP_MIN_BYTES, cp_ag._OVERLAP_CHUNK_BYTES = 1, chunk_bytes

    def undo():
        cp_ag._OVERLAP_MIN_BYTES, cp_ag._OVERLAP_CHUNK_BYTES = saved

    return undo


def case_pipelined(ctx):
    """The chunked combine (collectives issued asynchronously, kernels per chunk of tokens):
    chunk edges inside the batch, both scatter modes, both wires, converted and direct outputs."""
    undo = pipelined(20_000)
    try:
        case_grid(ctx, (torch.bfloat16, torch.float32), (1, 37, 300), (24, 128), (None, "input"), seed=500)
        case_empty_rows(ctx)
        case_vllm(ctx)
        ctx.expect(len(cp_ag._chunks(300, 4 * 2 * ctx.N * 128, 2, False)) > 1, "no chunks")
    finally:
        undo()


def gpu_grid(ctx):
    """Output dtype x D x T x mode x wire (float32 and the input dtype) on real NCCL."""
    k = 100
    for dtype in DTYPES:
        for D in (128, 512):
            for T in (0, 1, 7, 4096):
                k += 1
                H = 2 * ctx.N
                V, S = states(k, ctx.N, T, H, D, dtype, ctx.device)
                want, lse, mag = expected(V, S)
                for scatter, exchange in MODES:
                    for wire in (None, dtype):
                        Hn = H // ctx.N if scatter == "heads" else H
                        out = poisoned((T, Hn, D), dtype, ctx.device)
                        out_lse = poisoned((T, Hn), torch.float32, ctx.device)
                        zerokv.cp_merge(V[ctx.rank], S[ctx.rank], ctx.group, scatter=scatter, exchange=exchange,
                                        wire_dtype=wire, out=out, out_lse=out_lse)  # fmt: skip
                        what = f"nccl {dtype} T={T} D={D} {scatter} {exchange} wire={wire}"
                        check(ctx, out, heads(want, ctx, scatter), heads(mag, ctx, scatter), dtype, what,
                              roundings_for(ctx, wire, dtype, exchange))  # fmt: skip
                        check(ctx, out_lse, heads(lse, ctx, scatter), None, "lse", what + " lse")


def case_graph(ctx, exchange="allgather", chunk_bytes=None, send_buffer=False):
    """cp_merge captured in a CUDA graph with its collectives (issued asynchronously and waited
    for in the pipelined combine: ``chunk_bytes``; the all-to-all with or without the pack);
    replayed on new inputs."""
    undo = pipelined(chunk_bytes) if chunk_bytes else (lambda: None)
    try:
        _graph(ctx, exchange, send_buffer)
    finally:
        undo()


def _graph(ctx, exchange, send_buffer):
    N, T, H, D, dev = ctx.N, 64, 4 * ctx.N, 128, ctx.device
    Hn = H // N
    V, S = states(41, N, T, H, D, torch.bfloat16, dev)
    send = None
    if send_buffer:
        v, s, send = zerokv.cp_send_buffer(T, H, D, torch.bfloat16, ctx.group, device=dev)
    else:
        v, s = V[ctx.rank].clone(), S[ctx.rank].clone()
    out = poisoned((T, Hn, D), torch.bfloat16, dev)
    out_lse = poisoned((T, Hn), torch.float32, dev)

    def load(V, S):
        if send_buffer:
            for j in range(N):
                v[j].copy_(V[ctx.rank][:, j * Hn : (j + 1) * Hn])
                s[j].copy_(S[ctx.rank][:, j * Hn : (j + 1) * Hn])
        else:
            v.copy_(V[ctx.rank])
            s.copy_(S[ctx.rank])

    def call():
        zerokv.cp_merge(v, s, ctx.group, exchange=exchange, send=send, out=out, out_lse=out_lse)

    load(V, S)
    call()  # warm-up: compile, NCCL set-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev), capture_error_mode="thread_local"):
        call()
    for seed in (43, 47):
        V, S = states(seed, N, T, H, D, torch.bfloat16, dev)
        load(V, S)
        out.fill_(NAN)
        out_lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        want, lse, mag = expected(V, S)
        what = f"graph {exchange} send_buffer={send_buffer} replay {seed}"
        check(ctx, out, heads(want, ctx, "heads"), heads(mag, ctx, "heads"), torch.bfloat16, what)
        check(ctx, out_lse, heads(lse, ctx, "heads"), None, "lse", what + " lse")


def nccl_cases(ctx):
    grid = ("gpu grid", lambda: gpu_grid(ctx))
    return [grid, *cases(ctx, None)[1:]] + [
        ("graph", lambda: case_graph(ctx)),
        ("graph a2a", lambda: case_graph(ctx, "a2a")),
        ("graph a2a send buffer", lambda: case_graph(ctx, "a2a", send_buffer=True)),
        ("pipelined", lambda: case_pipelined(ctx)),
        ("pipelined graph", lambda: case_graph(ctx, chunk_bytes=50_000)),
    ]


def _nccl_worker(rank: int, world: int, init: str, outdir: str) -> None:
    import datetime
    import json
    import os

    dist = torch.distributed
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    failures = []
    try:
        ctx = Ctx(rank, world, None, torch.device("cuda", rank))
        failures = run_cases(ctx, nccl_cases(ctx))
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(failures, f)
        dist.destroy_process_group()


def nccl_run(tmp_path, world: int) -> None:
    """Spawn ``world`` processes, one per GPU, in an NCCL group; every case; failures of every
    rank asserted together."""
    import json

    torch.multiprocessing.start_processes(
        _nccl_worker, args=(world, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=world, join=True,
        start_method="spawn",
    )  # fmt: skip
    failures = [x for r in range(world) for x in json.loads((tmp_path / f"rank{r}.json").read_text())]
    assert not failures, "\n".join(failures)
