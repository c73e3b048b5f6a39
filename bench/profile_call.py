"""Per-step host cost of one ``merge_state`` call, beside ``torch.mul(a, b, out=c)``.

Each step of the path timed alone on the same tensors (µs, median of interleaved rounds)::

    PYTHONPATH=. python3 -m bench.profile_call [--cpu]

lookup (the generated calls of the call's scalars), the signature's generated call (read,
cheap check, form, pack, launch) and the same without its launch, the whole public call, a
new T, the facts record and plan lookup that a call of another signature pays, the tensor
attribute reads alone, and the launch alone (``cuLaunchKernel``). ``--cpu``: CPU tensors routed down the GPU path with the launch left
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
    from zerokv.core import facts, forms, plans

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
    scalars = ("e", True, False, False, None, "float32", False)
    (call,) = plans.recent[scalars]  # the signature's generated call
    steps = {
        "torch.mul(out=)": lambda: torch.mul(a, b, out=c),
        "lookup (recent calls)": lambda: plans.recent.get(scalars),
        "generated call": lambda: call(objs, None),
        "merge_state (all)": lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=ol),
        "... a new T (all)": _new_t(zerokv.merge_state, dev),
        "... its slicing alone": _new_t(lambda *a, **k: None, dev),
        "facts + plan (a miss)": lambda: plans.get((scalars, facts.read_two(objs).sig)),
        "30 attribute reads": lambda: _reads(objs[:6]),
    }
    if not args.cpu:
        form, launcher, _, _ = next(iter(call.__globals__["FORMS"].values()))
        stream = torch.cuda.current_stream().cuda_stream
        grid, grid_y = forms.launch_grid(form, T)
        steps["launch alone (packed)"] = lambda: launcher.fire(grid, grid_y, stream)
    got: dict[str, list[float]] = {k: [] for k in steps}
    n = 2000
    for _ in range(7):
        for k, fn in steps.items():
            got[k].append(timeit.timeit(fn, number=n) / n * 1e6)
        if not args.cpu:
            torch.cuda.synchronize()
    launch = type(next(iter(call.__globals__["FORMS"].values()))[1])
    fire, launch.fire = launch.fire, lambda self, grid, grid_y, stream: None
    try:  # the generated call with its launch left out: reads, checks, form, pack
        got["generated call, no launch"] = [
            timeit.timeit(lambda: call(objs, None), number=n) / n * 1e6 for _ in range(7)
        ]
    finally:
        launch.fire = fire
    mul = statistics.median(got["torch.mul(out=)"])
    for k, v in got.items():
        us = statistics.median(v)
        print(f"{k:26s} {us:7.2f} µs  {us / mul:5.2f} x torch.mul")
    return 0


def _reads(tensors: tuple) -> None:
    """What any Python launch reads of six tensors: pointer, shape, strides, dtype, device."""
    for t in tensors:
        t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()


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

        def fire(self, grid, grid_y, stream):
            pass

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
