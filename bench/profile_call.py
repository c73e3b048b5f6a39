"""Per-step host cost of one ``merge_state`` call, beside ``torch.mul(a, b, out=c)``.

Each step of the path timed alone on the same tensors (µs, median of interleaved rounds)::

    PYTHONPATH=. python3 -m bench.profile_call [--cpu]

read (facts), lookup (plan of the signature), check (the plan's cheap check), form + pack
(the cached form, the arguments packed by name, no launch), launch (``cuLaunchKernel``), and
the whole public call. ``--cpu``: CPU tensors routed down the GPU path with the launch left
out (the Python steps only; no GPU needed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_call")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, no launch (the Python steps)")
    parser.add_argument("-T", type=int, default=256)
    args = parser.parse_args(argv)
    import torch

    import zerokv
    from zerokv.core import facts, plans

    dev = "cpu" if args.cpu else "cuda"
    T, H, D = args.T, 16, 128
    va, vb, out = (torch.randn(T, H, D, device=dev).to(torch.bfloat16) for _ in range(3))
    sa, sb, ol = (torch.randn(T, H, device=dev) for _ in range(3))
    shape = (64, 64) if args.cpu else (T, H, D)  # on the CPU, a multiply that costs its call only
    a, b, c = torch.randn(shape, device=dev), torch.randn(shape, device=dev), torch.empty(shape, device=dev)
    if args.cpu:
        torch.set_num_threads(1)  # a small multiply without a thread pool's wake-up
        _route_cpu_down_the_gpu_path()
    objs = (va, sa, vb, sb, out, ol, None, None, None, None, None)
    zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=ol)
    f = facts.read_two(objs)
    if args.cpu:
        f.device = 0
    scalars = ("e", True, False, False, None, "float32", False)
    plan = plans.get((scalars, f.sig))
    f.prefix_rows, f.rows = T, T * H
    key = next(iter(plan.forms))  # (T, the other facts that chose the form)
    form, launcher, bind, _ = plan.forms[key]
    buf = bytearray(form.kernel.packer.size)
    steps = {
        "torch.mul(out=)": lambda: torch.mul(a, b, out=c),
        "read (facts)": lambda: facts.read_two(objs),
        "lookup (plan)": lambda: plans.get((scalars, f.sig)),
        "check (cheap)": lambda: plan.check(f),
        "form + pack": lambda: bind(buf, f, plan.forms[key][0], plan.consts),
        "merge_state (all)": lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=ol),
        "... a new T (all)": _new_t(zerokv.merge_state, dev),
        "... its slicing alone": _new_t(lambda *a, **k: None, dev),
    }
    if not args.cpu:
        stream = torch.cuda.current_stream().cuda_stream
        steps["launch"] = lambda: launcher.launch(form.grid, form.grid_y, stream, bind, f, form, plan.consts)
    got: dict[str, list[float]] = {k: [] for k in steps}
    n = 2000
    for _ in range(7):
        for k, fn in steps.items():
            got[k].append(timeit.timeit(fn, number=n) / n * 1e6)
        if not args.cpu:
            torch.cuda.synchronize()
    mul = statistics.median(got["torch.mul(out=)"])
    for k, v in got.items():
        us = statistics.median(v)
        print(f"{k:20s} {us:7.2f} µs  {us / mul:5.2f} x torch.mul")
    return 0


def _new_t(fn, dev: str):
    """One call per new T of slices of preallocated buffers (T over 1000 values, cycled, the
    forms of each T met before it is timed); the slicing is its own row (bench_host subtracts it)."""
    import itertools

    import torch

    n, H, D = 1000, 16, 128
    vs = [torch.randn(n, H, D, device=dev).to(torch.bfloat16) for _ in range(3)]
    ss = [torch.randn(n, H, device=dev) for _ in range(3)]
    Ts = itertools.cycle(range(1, n + 1))
    for T in range(1, n + 1):
        fn(vs[0][:T], ss[0][:T], vs[1][:T], ss[1][:T], out=vs[2][:T], out_lse=ss[2][:T])

    def call():
        T = next(Ts)
        fn(vs[0][:T], ss[0][:T], vs[1][:T], ss[1][:T], out=vs[2][:T], out_lse=ss[2][:T])

    return call


def _route_cpu_down_the_gpu_path() -> None:
    """CPU tensors read as if on device 0, launches packed but not made."""
    from zerokv.core import device, facts, plans

    class _NoLaunch:
        def __init__(self, kernel, targs, dev):
            self.buf = bytearray(kernel.packer.size)

        def launch(self, grid, grid_y, stream, bind, *records):
            bind(self.buf, *records)

    plans.launcher = _NoLaunch
    device.sm_count, device.l2_bytes, device.torch_stream = (
        (lambda d: 132),
        (lambda d: 50 << 20),
        (lambda d: 0),
    )
    for name in ("read_two", "read_n", "read_rows"):
        setattr(facts, name, _on_device(getattr(facts, name)))


def _on_device(read):
    def on_device(*a):
        f = read(*a)
        if f is not None:
            f.device = 0
        return f

    return on_device


if __name__ == "__main__":
    sys.exit(main())
