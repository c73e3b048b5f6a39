"""The self-check behind ``python -m zerokv``: every op against the float64 reference.

Always: each op on the CPU path (numpy in, the reference semantics out). On a GPU: each op per
dtype on random data, with µs and GB/s, and an fp8-output merge. Without one: every kernel
instantiation compiled through NVRTC for sm_80 and sm_90 (the two fp8 conversions), the result
cached so that a second run compiles nothing.
"""

from __future__ import annotations

import sys
import time
from importlib import metadata
from typing import NamedTuple

import numpy as np

from . import __version__, reference

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
    from .core import disk_cache as _cache

    _cache.check_cupy_cache_dir()  # a cache directory that cannot be made: an error, not "no GPU"
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:  # no device or no driver
        return False


def _dist(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> tuple[str, list[str]]:
    """One line of versions (from package metadata: imports nothing), and warnings."""
    parts = [f"zerokv {__version__}", f"Python {sys.version.split()[0]}", f"numpy {np.__version__}"]
    cupys = [d for d in ("cupy-cuda12x", "cupy-cuda13x", "cupy") if _dist(d)]
    for d in [*cupys, "cuda-bindings", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc", "torch"]:
        if _dist(d):
            parts.append(f"{d} {_dist(d)}")
    warnings = []
    if len(cupys) > 1:
        warnings.append(
            f"WARNING: {' and '.join(cupys)} are all installed; they write the same `cupy` module. "
            f"Uninstall them all (pip uninstall -y {' '.join(cupys)}) and install one extra: "
            "zerokv[cuda12] or zerokv[cuda13]."
        )
    return ", ".join(parts), warnings


def _err(out, ref_out, lse, ref_lse) -> float:
    """The larger of the two ``reference.max_error`` (NaN and inf must sit where expected)."""
    return max(reference.max_error(out, ref_out), reference.max_error(lse, ref_lse))


# --- the CPU path -----------------------------------------------------------------------------


def _cases(rng: np.random.Generator, T: int, H: int, D: int):
    v = rng.standard_normal((2, T, H, D)).astype(np.float32)
    s = (rng.standard_normal((2, T, H)) * 3).astype(np.float32)
    s[0, :: max(1, T // 7)] = -np.inf  # some empty prefix rows ...
    v[0, :: max(1, T // 7)] = np.nan  # ... whose V is garbage that must not be read
    s[1, 3 % T] = np.inf  # FA2's empty marker
    kv_lens = np.array([0, 5, 0, 2], dtype=np.int32)
    cu_q = np.array([0, T // 4, T // 2, 3 * T // 4, T], dtype=np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    return v, s, kv_lens, cu_q, cu_kv


def run_cpu(T: int = 257, H: int = 4, D: int = 72) -> list[Row]:
    import zerokv

    rng = np.random.default_rng(0)
    v, s, kv_lens, cu_q, cu_kv = _cases(rng, T, H, D)
    shape, tol = f"{T}x{H}x{D}", 1e-5
    rows = []
    out, lse = zerokv.merge_state(v[0], s[0], v[1], s[1])
    ro, rl = reference.merge_state(v[0], s[0], v[1], s[1])
    rows.append(Row("merge_state", "float32", shape, _err(out, ro, lse, rl), tol))
    out, lse = zerokv.merge_states(v, s)
    ro, rl = reference.merge_states(v, s)
    rows.append(Row("merge_states", "float32", f"2x{shape}", _err(out, ro, lse, rl), tol))
    o, ls = v[1].copy(), s[1].copy()
    zerokv.fixup_zero_kv_rows(o, ls, kv_lens, cu_q)
    ro, rl = reference.fixup_zero_kv_rows(v[1], s[1], kv_lens, cu_q)
    rows.append(Row("fixup_zero_kv_rows", "float32", shape, _err(o, ro, ls, rl), tol))
    o, ls = v[1].copy(), s[1].copy()
    zerokv.mask_empty_context(o, ls, cu_q, cu_kv)
    ro, rl = reference.mask_empty_context(v[1], s[1], cu_q, cu_kv)
    rows.append(Row("mask_empty_context", "float32", shape, _err(o, ro, ls, rl), tol))
    return rows


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


def offline_compile() -> tuple[str, bool]:
    """Compile every instantiation for OFFLINE_ARCHS (cached); (what to print, passed)."""
    from .core import offline as _offline

    start = time.perf_counter()
    try:
        _offline.nvrtc_version()
    except _offline.NvrtcLibraryError as e:  # a broken install: nothing can compile here
        return f"FAILED: {e}", False
    except ImportError as e:  # no cuda-bindings: the CPU path alone is still usable
        return f"offline compile skipped: {e}", True
    total, cached, failed = 0, 0, []
    for arch in OFFLINE_ARCHS:
        for _, results in _offline.compile_arch(arch):
            if isinstance(results, _offline.CompileError):
                failed.append(results.summary())
                continue
            total += len(results)
            cached += sum(r.cached for r in results)
    took = time.perf_counter() - start
    line = (
        f"compiled {total} kernel instantiations for {', '.join(OFFLINE_ARCHS)} through NVRTC in {took:.2f} s"
        f" ({cached} from the cache)"
    )
    if failed:
        return line + "\nFAILED to compile:\n" + "\n".join(failed), False
    return line, True


def main() -> int:
    env, warnings = environment()
    print(env)
    for w in warnings:
        print(w)
    ok = True
    t = time.perf_counter()
    rows = run_cpu()
    print(f"CPU path (numpy in, the reference semantics), {time.perf_counter() - t:.2f} s")
    print(HEADER)
    print("\n".join(str(r) for r in rows))
    if gpu_available():
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
        print("\nno CUDA GPU found: compiling every kernel without one")
        line, passed = offline_compile()
        print(line)
        ok = ok and passed
    bad = [r for r in rows if not r.ok()]
    if bad:
        print("FAILED:\n" + "\n".join(str(r) for r in bad))
        ok = False
    print("ok" if ok else "FAILED")
    return 0 if ok else 1
