"""The self-check behind ``python -m zerokv``: every op against the float64 reference.

On a GPU: compile, run each op on random data, and print op, dtype, shape, max error, µs and
GB/s. Without one: say so, compile every kernel for sm_90 through NVRTC, run the CPU path.
"""

from __future__ import annotations

import time

import numpy as np

from . import _offline, reference


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _row(op, dtype, shape, err, us=None, gbps=None) -> str:
    us_s = f"{us:9.1f}" if us is not None else "        -"
    bw_s = f"{gbps:8.0f}" if gbps is not None else "       -"
    return f"{op:22s} {dtype:9s} {shape:22s} {err:10.2e} {us_s} {bw_s}"


HEADER = f"{'op':22s} {'dtype':9s} {'shape':22s} {'max error':>10s} {'µs':>9s} {'GB/s':>8s}"


def _cases(rng: np.random.Generator, T: int, H: int, D: int):
    v = rng.standard_normal((2, T, H, D)).astype(np.float32)
    s = (rng.standard_normal((2, T, H)) * 3).astype(np.float32)
    s[0, :: max(1, T // 7)] = -np.inf  # some empty prefix rows
    s[1, 3 % T] = np.inf  # FA2's empty marker
    v[0, :: max(1, T // 7)] = np.nan  # garbage that must not be read
    kv_lens = np.array([0, 5, 0, 2], dtype=np.int32)
    cu_q = np.array([0, T // 4, T // 2, 3 * T // 4, T], dtype=np.int32)
    return v, s, kv_lens, cu_q


def run_cpu(T: int = 257, H: int = 4, D: int = 72) -> list[str]:
    import zerokv

    rng = np.random.default_rng(0)
    v, s, kv_lens, cu_q = _cases(rng, T, H, D)
    rows = []
    out, lse = zerokv.merge_state(v[0], s[0], v[1], s[1])
    ro, rl = reference.merge_state(v[0], s[0], v[1], s[1])
    rows.append(_row("merge_state", "float32", f"{T}x{H}x{D}", _err(out, ro, lse, rl)))
    out, lse = zerokv.merge_states(v, s)
    ro, rl = reference.merge_states(v, s)
    rows.append(_row("merge_states", "float32", f"2x{T}x{H}x{D}", _err(out, ro, lse, rl)))
    o, l2 = v[1].copy(), s[1].copy()
    zerokv.fixup_zero_kv_rows(o, l2, kv_lens, cu_q)
    ro, rl = reference.fixup_zero_kv_rows(v[1], s[1], kv_lens, cu_q)
    rows.append(_row("fixup_zero_kv_rows", "float32", f"{T}x{H}x{D}", _err(o, ro, l2, rl)))
    return rows


def _err(out, ref_out, lse, ref_lse) -> float:
    """Max abs error, with NaN/inf required at the same places (else inf)."""
    worst = 0.0
    for a, b in ((np.asarray(out, np.float64), ref_out), (np.asarray(lse, np.float64), ref_lse)):
        same = (np.isnan(a) == np.isnan(b)).all() and (np.isinf(a) == np.isinf(b)).all()
        if not same or not (a[np.isinf(a)] == b[np.isinf(b)]).all():
            return float("inf")
        fin = np.isfinite(b)
        if fin.any():
            worst = max(worst, float(np.abs(a[fin] - b[fin]).max()))
    return worst


def run_gpu() -> list[str]:
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
        rows.append(_row("merge_state", name, shape, _err(*f64(out), ro, *f64(lse), rl), us, gbps))

        out.fill_(float("nan"))
        us, gbps = timed(lambda: zerokv.merge_states(v, s, out=out, out_lse=lse), nbytes)
        ro, rl = reference.merge_states(*f64(v, s, axis=1))
        rows.append(_row("merge_states", name, f"2x{shape}", _err(*f64(out), ro, *f64(lse), rl), us, gbps))

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
            rows.append(_row(op, name, shape, err, us, gbps))
    return rows


def main() -> int:
    if gpu_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        print(f"zerokv self-check on {props['name'].decode()} (GB/s: 1e9 bytes read + written)")
        t = time.perf_counter()
        rows = run_gpu()
        print(HEADER)
        print("\n".join(rows))
        print(f"(compile + run: {time.perf_counter() - t:.1f} s)")
    else:
        print(
            "zerokv self-check: no CUDA GPU found; compiling every kernel for sm_90 and running the CPU path"
        )
        t = time.perf_counter()
        try:
            compiled = _offline.compile_all("sm_90")
        except ImportError:
            print("(cuda-bindings not installed: offline compile skipped; pip install 'zerokv[nvrtc]')")
        else:
            print(
                f"compiled {len(compiled)} kernel instantiations for sm_90 in {time.perf_counter() - t:.2f} s"
            )
        rows = run_cpu()
        print(HEADER)
        print("\n".join(rows))
    bad = [r for r in rows if "inf" in r.split()[3] or float(r.split()[3]) > 5e-2]
    if bad:
        print("FAILED:\n" + "\n".join(bad))
        return 1
    print("ok")
    return 0
