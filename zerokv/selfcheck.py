"""The self-check behind ``python -m zerokv``: every op against what it must compute.

Always: each op on the CPU path (numpy in) against attention computed directly over keys split
into chunks and against closed forms (not against the float64 reference, which the CPU path
runs). On a GPU: each op per dtype against the reference, with µs and GB/s, and an fp8-output
merge. Without one: every kernel compiled through NVRTC for sm_80 and sm_90 (the two fp8
conversions), cached; with neither a GPU nor NVRTC the self-check fails saying what to install.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import NamedTuple

import numpy as np

from . import reference, versions

OFFLINE_ARCHS = ("sm_80", "sm_90")  # software and hardware fp8 conversion


class Row(NamedTuple):
    op: str
    dtype: str
    shape: str
    err: float
    tol: float
    us: float | None = None
    gbps: float | None = None

    def ok(self) -> bool:
        return self.err <= self.tol  # NaN (never <=) fails too

    def __str__(self) -> str:
        us = f"{self.us:9.1f}" if self.us is not None else "        -"
        bw = f"{self.gbps:8.0f}" if self.gbps is not None else "       -"
        return f"{self.op:22s} {self.dtype:15s} {self.shape:16s} {self.err:10.2e} {self.tol:8.0e} {us} {bw}"


HEADER = f"{'op':22s} {'dtype':15s} {'shape':16s} {'max error':>10s} {'limit':>8s} {'µs':>9s} {'GB/s':>8s}"


def gpu_available() -> bool:
    """Whether a CUDA GPU can run the GPU checks (the driver asked before CuPy's import, which
    makes CuPy's cache directory; one that cannot be made raises ``CacheDirError``)."""
    from .core import disk_cache as _cache
    from .core import probe as _probe

    if "cupy" not in sys.modules and importlib.util.find_spec("cupy") is None:
        return False  # no CuPy: no GPU path, and no CuPy cache directory to make
    if _probe.driver_devices()[0] == 0:
        return False
    _cache.check_cupy_cache_dir()
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:  # no device or no driver
        return False


_dist = versions.installed  # package metadata (a test stands in for it)


def environment() -> tuple[str, list[str]]:
    """One line of versions (from package metadata: imports nothing), and warnings."""
    return versions.environment(_dist)


def _err(out, ref_out, lse, ref_lse) -> float:
    """The larger of the two ``reference.max_error`` (NaN and inf must sit where expected)."""
    return max(reference.max_error(out, ref_out), reference.max_error(lse, ref_lse))


# --- the CPU path: against attention over all keys and closed forms, not the reference ---------
# (the CPU path runs the reference: comparing the two would check nothing)


def _attention(q, k, v, base: float, sink=None):
    """float64 softmax attention of ``q [T, H, E]`` over ``k [L, H, E]``, ``v [L, H, D]`` with
    logits in units of ``base``; a sink is one more logit of value zero; no keys: (0, -inf)."""
    x = np.einsum("the,lhe->thl", q, k) * np.log(base) / np.sqrt(q.shape[-1])
    vals = np.moveaxis(v, 0, 1)  # [H, L, D]
    if sink is not None:
        x = np.concatenate([x, np.broadcast_to(sink * np.log(base), x.shape[:2])[..., None]], -1)
        vals = np.concatenate([vals, np.zeros_like(vals[:, :1])], 1)
    if x.shape[-1] == 0:
        return np.zeros((*q.shape[:2], v.shape[-1])), np.full(q.shape[:2], -np.inf)
    top = x.max(-1, keepdims=True)
    p = np.exp(x - top)
    z = p.sum(-1, keepdims=True)
    return np.einsum("thl,hld->thd", p / z, vals), (top[..., 0] + np.log(z[..., 0])) / np.log(base)


def _split_keys_errors(rng: np.random.Generator) -> tuple[float, float]:
    """Attention over keys in chunks (one empty as (0, -inf), one as FA2 leaves it: +inf with NaN
    V), merged by merge_states and by a chain of merge_state, both LSE bases, sinks, against
    attention over all keys at once: the defining property of an LSE merge."""
    import zerokv

    T, H, D, L = 9, 3, 12, 40
    q, k = rng.standard_normal((T, H, 8)) * 2, rng.standard_normal((L, H, 8)) * 2
    v, sink = rng.standard_normal((L, H, D)), rng.standard_normal(H)
    errs = [0.0, 0.0]
    for base in (np.e, 2.0):
        states = [_attention(q, k[lo:hi], v[lo:hi], base) for lo, hi in ((0, 0), (0, 13), (13, 13), (13, L))]
        states[2] = (np.full((T, H, D), np.nan), np.full((T, H), np.inf))
        vs = np.stack([s[0] for s in states]).astype(np.float32)
        ss = np.stack([s[1] for s in states]).astype(np.float32)
        want_o, want_s = _attention(q, k, v, base, sink)
        lse_base = "e" if base == np.e else 2
        sinks = sink.astype(np.float32)
        o, s = zerokv.merge_states(vs, ss, lse_base=lse_base, sinks=sinks)
        errs[1] = max(errs[1], _err(o, want_o, s, want_s))
        o, s = vs[0], ss[0]
        for i in range(1, len(vs)):
            o, s = zerokv.merge_state(o, s, vs[i], ss[i], lse_base=lse_base, sinks=sinks if i == 3 else None)
        errs[0] = max(errs[0], _err(o, want_o, s, want_s))
    return errs[0], errs[1]


def _closed_form_error() -> float:
    """merge_state on one row each, worked by hand: equal LSEs halve, ln 3 against 0 weighs 3:1,
    base 2, an empty a (-inf or +inf) with NaN V gives b, both empty (0, -inf), NaN propagates;
    prefix_rows=4 (row 4: b alone, b +inf -> (0, -inf)), a_empty (row 5), a sink at the LSE."""
    import zerokv

    n, ln2, ln3 = np.nan, np.log(2.0), np.log(3.0)
    va, vb = np.array([1.0, 2.0]), np.array([10.0, 20.0])
    # (s_a, s_b, v_a, v_b, expected out, expected lse) for rows 0-5
    rows = [
        (0.0, 0.0, va, vb, (va + vb) / 2, ln2),
        (ln3, 0.0, va, vb, 0.75 * va + 0.25 * vb, 2 * ln2),
        (np.inf, 1.5, [n, n], vb, vb, 1.5),
        (n, 0.0, va, vb, [n, n], n),
        (5.0, np.inf, va, [n, n], [0.0, 0.0], -np.inf),
        (7.0, -0.5, [n, n], vb, vb, -0.5),
    ]
    v_a, v_b, want_o = (np.array([r[i] for r in rows], np.float32)[:, None] for i in (2, 3, 4))
    s_a, s_b, want_s = (np.array([[r[i]] for r in rows], np.float32) for i in (0, 1, 5))
    cu, kv = np.array([0, 5, 6]), np.array([3, 0])
    o, s = zerokv.merge_state(v_a, s_a, v_b, s_b, prefix_rows=4, a_empty=(cu, kv))
    err = _err(o, want_o, s, want_s)
    o, s = zerokv.merge_state(
        v_a[:1], s_a[:1], v_b[:1], np.full_like(s_b[:1], -np.inf), sinks=np.zeros(1, np.float32)
    )
    err = max(err, _err(o, v_a[:1] / 2, s, np.full((1, 1), ln2)))  # sink 0 at LSE 0: half, ln 2
    o, s = zerokv.merge_state(v_a[:1], s_a[:1], v_b[:1], s_b[:1], lse_base=2)
    return max(err, _err(o, (v_a[:1] + v_b[:1]) / 2, s, np.ones((1, 1))))  # base 2: LSE 0 + 1


def _empty_rows_error(op: str) -> float:
    """Requests at rows [0, 2), [2, 2), [2, 5), [5, 6) of 7 (row 6 in none); requests 0 and 2
    empty (kv_lens 0; context spans [3, 3) and [5, 4)): rows 0-4 become (0, -inf), 5-6 stay."""
    import zerokv

    rng = np.random.default_rng(1)
    out, lse = (
        rng.standard_normal((7, 2, 3)).astype(np.float32),
        rng.standard_normal((7, 2)).astype(np.float32),
    )
    out[:5] = np.nan
    want_o, want_s = out.astype(np.float64), lse.astype(np.float64)
    want_o[:5], want_s[:5] = 0.0, -np.inf
    cu = np.array([0, 2, 2, 5, 6], np.int32)
    if op == "fixup_zero_kv_rows":
        zerokv.fixup_zero_kv_rows(out, lse, np.array([0, 3, 0, 1], np.int32), cu)
    else:
        zerokv.mask_empty_context(out, lse, cu, np.array([3, 3, 5, 4, 9], np.int32))
    exact = np.array_equal(out, want_o, equal_nan=True) and np.array_equal(lse, want_s)
    return 0.0 if exact else float("inf")  # writes exact zeros and -inf, copies the rest


def run_cpu() -> list[Row]:
    """Each op on the CPU path (numpy in, float32 out) against attention computed directly over
    split keys and against closed forms: a broken reference fails here."""
    rng = np.random.default_rng(0)
    chain, n_way = _split_keys_errors(rng)
    closed = _closed_form_error()
    tol = 1e-5  # float32 inputs and output: a few float32 roundings of values of order one
    return [
        Row("merge_state", "float32", "split keys+forms", max(chain, closed), tol),
        Row("merge_states", "float32", "split keys", n_way, tol),
        Row("fixup_zero_kv_rows", "float32", "7x2x3", _empty_rows_error("fixup_zero_kv_rows"), 0.0),
        Row("mask_empty_context", "float32", "7x2x3", _empty_rows_error("mask_empty_context"), 0.0),
    ]


# --- the GPU ----------------------------------------------------------------------------------

# max abs error allowed against the float64 reference, by output dtype (values ~ N(0, 1))
GPU_TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def run_gpu() -> list[Row]:
    import torch

    import zerokv

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def timed(fn, nbytes):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / reps
        return us, nbytes / us / 1e3

    def f64(*xs, n=512, axis=0):  # the reference runs on the first n tokens (rows are independent)
        return [x.narrow(axis, 0, min(n, x.shape[axis])).double().cpu().numpy() for x in xs]

    for dtype, T, H, D in (
        (torch.bfloat16, 16384, 128, 128),
        (torch.float16, 4097, 16, 72),
        (torch.float32, 1024, 8, 7),
    ):
        name = str(dtype).removeprefix("torch.")
        tol = GPU_TOL[name]
        shape = f"{T}x{H}x{D}"
        v = torch.randn(2, T, H, D, device=dev, dtype=dtype, generator=gen)
        s = torch.randn(2, T, H, device=dev, generator=gen) * 3
        s[0, ::7] = float("-inf")  # empty prefix rows ...
        v[0, ::7] = float("nan")  # ... whose V is garbage that must not be read
        va, vb, sa, sb = v[0].contiguous(), v[1].contiguous(), s[0].contiguous(), s[1].contiguous()
        out = torch.full((T, H, D), float("nan"), device=dev, dtype=dtype)
        lse = torch.full((T, H), float("nan"), device=dev)
        nbytes = 3 * va.numel() * va.element_size() + 3 * sa.numel() * 4

        us, gbps = timed(lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse), nbytes)
        ro, rl = reference.merge_state(*f64(va, sa, vb, sb))
        rows.append(Row("merge_state", name, shape, _err(*f64(out), ro, *f64(lse), rl), tol, us, gbps))

        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        us, gbps = timed(lambda: zerokv.merge_states(v, s, out=out, out_lse=lse), nbytes)
        ro, rl = reference.merge_states(*f64(v, s, axis=1))
        rows.append(
            Row("merge_states", name, f"2x{shape}", _err(*f64(out), ro, *f64(lse), rl), tol, us, gbps)
        )

        if dtype == torch.bfloat16:
            rows.append(_fp8_row(va, sa, vb, sb, timed, f64))

        B = 64
        cu = torch.linspace(0, T, B + 1, device=dev).round().to(torch.int32)
        kv = torch.randint(0, 3, (B,), device=dev, dtype=torch.int32, generator=gen)
        cukv = torch.cumsum(torch.cat([kv.new_zeros(1), kv]), 0).to(torch.int32)
        empty = int(((cu[1:] - cu[:-1]) * (kv == 0)).sum())
        written = empty * H * (D * va.element_size() + 4)
        kv_np, cu_np, cukv_np = kv.cpu().numpy(), cu.cpu().numpy(), cukv.cpu().numpy()
        cases = (
            (
                "fixup_zero_kv_rows",
                lambda o, ls: zerokv.fixup_zero_kv_rows(o, ls, kv, cu),
                lambda o, ls: reference.fixup_zero_kv_rows(o, ls, kv_np, cu_np),
            ),
            (
                "mask_empty_context",
                lambda o, ls: zerokv.mask_empty_context(o, ls, cu, cukv),
                lambda o, ls: reference.mask_empty_context(o, ls, cu_np, cukv_np),
            ),
        )
        for op, run, ref in cases:
            o, ls = vb.clone(), sb.clone()
            ro, rl = ref(*f64(o, ls, n=T))
            run(o, ls)
            err = _err(*f64(o, n=T), ro, *f64(ls, n=T), rl)
            us, gbps = timed(lambda: run(o, ls), written)
            rows.append(Row(op, name, shape, err, 0.0, us, gbps))  # writes exact zeros and -inf
    return rows


def _fp8_row(va, sa, vb, sb, timed, f64) -> Row:
    """bf16 in, fp8 e4m3 out with a scale; the error is in fp8 steps (1 = one step of e4m3's
    3-bit mantissa at that magnitude, or 2^-9 near zero): correct rounding is within 1/2."""
    import torch

    import zerokv

    T, H, D = va.shape
    scale = torch.tensor([1 / 64], device=va.device)
    out = torch.full((T, H, D), float("nan"), device=va.device).to(torch.float8_e4m3fn)
    nbytes = 2 * va.numel() * va.element_size() + out.numel() + 2 * sa.numel() * 4
    us, gbps = timed(lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_scale=scale), nbytes)
    ro, _ = reference.merge_state(*f64(va, sa, vb, sb))
    expected = np.clip(ro * 64, -448, 448)
    (got,) = f64(out.float())
    if np.isnan(got).any() or np.isnan(expected).any():
        err = float("inf")
    else:
        err = float((np.abs(got - expected) / (np.abs(expected) / 8 + 2.0**-9)).max())
    return Row("merge_state", "bf16->fp8 steps", f"{T}x{H}x{D}", err, 1.0, us, gbps)


# --- without a GPU: the offline compile -------------------------------------------------------


def offline_compile(quiet: bool = False) -> tuple[str, bool]:
    """Compile every instantiation for OFFLINE_ARCHS (cached); (what to print, passed). On a
    terminal its progress is drawn on stderr unless ``quiet``; piped, one line per arch."""
    from .core import offline as _offline
    from .progress import Progress

    start = time.perf_counter()
    try:
        _offline.nvrtc_version()
    except _offline.NvrtcLibraryError as e:  # a broken install: nothing can compile here
        return f"FAILED: {e}", False
    except ImportError as e:  # no cuda-bindings: nothing on a GPU path can be checked here
        return f"FAILED: nothing checked on a GPU path: no CUDA GPU, and {e}", False
    total, cached, failed = 0, 0, []
    progress = Progress(quiet=quiet)
    size = sum(len(e) for e in _offline.selected().values())
    for arch in OFFLINE_ARCHS:
        arch_start, arch_total = time.perf_counter(), 0
        progress.start(arch, size)
        for _, results in _offline.compile_arch(arch, before=lambda stem, n: progress.stage(stem)):
            if isinstance(results, _offline.CompileError):
                failed.append(results.summary())
                continue
            progress.advance(len(results))
            arch_total += len(results)
            cached += sum(r.cached for r in results)
        progress.finish()
        total += arch_total
        if not quiet:
            print(
                f"  {arch}: {arch_total} of {size} instantiations, {time.perf_counter() - arch_start:.1f} s",
                flush=True,
            )
    took = time.perf_counter() - start
    line = (
        f"compiled {total} kernel instantiations for {', '.join(OFFLINE_ARCHS)} through NVRTC in {took:.2f} s"
        f" ({cached} from the cache)"
    )
    if failed:
        return line + "\nFAILED to compile:\n" + "\n".join(failed), False
    return line, True


def main(quiet: bool = False) -> int:
    """The self-check; ``quiet``: no progress lines while compiling without a GPU."""
    env, warnings = environment()
    print(env)
    print(versions.launcher_line())
    for w in warnings:
        print(w)
    ok = True
    t = time.perf_counter()
    rows = run_cpu()
    print(
        f"CPU path (numpy in) against attention over split keys and closed forms, {time.perf_counter() - t:.2f} s"
    )
    print(HEADER)
    print("\n".join(str(r) for r in rows))
    from .core import disk_cache as _cache

    try:
        gpu = gpu_available()
    except _cache.CacheDirError as e:  # one line that says what to do, not a traceback
        print(f"\nFAILED: {' '.join(str(e).removeprefix('zerokv: ').split())}")
        print("FAILED")
        return 1
    if gpu:
        from .core import device as _device

        major, minor = _device.capability(0)
        print(f"\nGPU: {_device.device_name(0)} (sm_{major}{minor}); GB/s: 1e9 bytes read + written")
        t = time.perf_counter()
        gpu_rows = run_gpu()
        print(HEADER)
        print("\n".join(str(r) for r in gpu_rows))
        print(f"(compile + run: {time.perf_counter() - t:.1f} s)")
        rows += gpu_rows
    else:
        from .core import offline as _offline

        size = sum(len(e) for e in _offline.selected().values()) * len(OFFLINE_ARCHS)
        print(f"\nno CUDA GPU found: compiling every kernel without one ({size} instantiations)", flush=True)
        line, passed = offline_compile(quiet)
        print(line)
        ok = ok and passed
    bad = [r for r in rows if not r.ok()]
    if bad:
        print("FAILED:\n" + "\n".join(str(r) for r in bad))
        ok = False
    print("ok" if ok else "FAILED")
    return 0 if ok else 1
