"""Benchmarks of zerokv: bandwidth, host cost per call and compile time.

Run from the source tree (needs torch with CUDA, CuPy; Triton, matplotlib and tqdm are used
when installed)::

    PYTHONPATH=. python -m bench                      # the full grid (a few minutes on an H200)
    PYTHONPATH=. python -m bench --quick              # a small grid, well under 2 minutes
    PYTHONPATH=. python -m bench --only merge,host    # some parts: merge, fixup, mask, host, compile
    PYTHONPATH=. python -m bench --quick --out DIR    # results elsewhere (default: bench/results)
    PYTHONPATH=. python -m bench --dry-run            # the harness on the CPU: tiny shapes, fake times

What is measured (GPU µs: median of CUDA-event times over repetitions, inputs rotated over sets
that together exceed twice the L2 cache; GB/s = 1e9 bytes read + written per second; % of copy
= against a torch ``copy_`` of 1 GiB in the same run):

* merge: ``merge_state`` over T x H x D x dtype (bf16, fp16, fp32 partials -> bf16 output)
  against torch eager, a Triton merge and FlashInfer (when importable); ``merge_states`` N=2, 4.
* fixup, mask: ``fixup_zero_kv_rows`` / ``mask_empty_context`` with 0 to 32768 empty rows
  against torch eager; % of copy on bytes written; the 0-row case beside an empty kernel launch.
* host: host µs per call on tiny tensors against ``torch.mul(a, b, out=c)``; the engine adapters
  when importable; merge_state inside a captured CUDA graph.
* compile: first call of each op in a fresh process, cold (empty ``CUPY_CACHE_DIR``) and warm.

Writes ``zerokv-bench-<date>-<mode>.json`` (environment and every row), ``.png`` (% of copy
against bytes) and ``.md`` (the summary printed at the end, with the targets) into the output
directory. Without a GPU it says so and exits (use ``--dry-run`` to check the harness).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PARTS = ("merge", "fixup", "mask", "host", "compile")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a small grid (well under 2 minutes on an H200)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output directory (default: bench/results)"
    )
    parser.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to run (default: all of {','.join(PARTS)})",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the harness on the CPU with tiny shapes and synthetic times",
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        parser.error(
            f"--only: unknown part(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(PARTS)}"
        )
    args.parts = [p for p in PARTS if p in parts]
    return args


def gpu_problem(torch: Any) -> str | None:
    """Why the GPU benchmarks cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU found (torch.cuda.is_available() is False)"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU found by CuPy"
    except Exception as e:
        return f"CuPy cannot use the GPU ({type(e).__name__}: {e})"
    return None


def make_bench(torch: Any, args: argparse.Namespace) -> Any:
    from .common import Bench, CudaTimer, FakeTimer

    if args.dry_run:
        return Bench(torch, torch.device("cpu"), FakeTimer(), l2_bytes=4096, quick=args.quick, dry=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
    if not l2:
        import cupy

        l2 = int(cupy.cuda.runtime.getDeviceProperties(dev.index)["l2CacheSize"])
    timer = CudaTimer(
        torch, budget_s=0.1 if args.quick else 0.2, min_reps=10, max_reps=50 if args.quick else 100
    )
    return Bench(torch, dev, timer, l2_bytes=l2, quick=args.quick, dry=False)


def plan(b: Any, parts: list[str]) -> list[Any]:
    from . import bench_compile, bench_fixup, bench_host, bench_mask, bench_merge
    from .common import Task, copy_row, empty_launch_row

    modules = {"merge": bench_merge, "fixup": bench_fixup, "mask": bench_mask, "host": bench_host}
    modules["compile"] = bench_compile
    copy_bytes = 2**20 if b.dry else 2**30
    tasks = [
        Task("setup", "copy bandwidth", lambda b: [copy_row(b, copy_bytes)]),
        Task("setup", "empty kernel launch", lambda b: [empty_launch_row(b)]),
    ]
    for part in parts:
        tasks += modules[part].tasks(b.mode)
    return tasks


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import torch
    except ImportError:
        print("bench: torch is not installed; the benchmarks need torch (with CUDA) and CuPy.")
        return 1
    if not args.dry_run and (problem := gpu_problem(torch)):
        print(f"bench: {problem}: nothing measured. (--dry-run checks the harness on the CPU.)")
        return 0

    from . import plot, report, targets
    from .common import Row, free_memory
    from .progress import Progress

    torch.manual_seed(0)
    b = make_bench(torch, args)
    tasks = plan(b, args.parts)
    where = "the CPU (dry run)" if b.dry else torch.cuda.get_device_name(b.device)
    print(
        f"zerokv bench, {b.mode} grid, parts {','.join(args.parts)}, on {where}: {len(tasks)} tasks",
        file=sys.stderr,
    )
    rows: list[Row] = []
    progress = Progress(len(tasks))
    started = time.perf_counter()
    for task in tasks:
        progress.start(task.label)
        t = time.perf_counter()
        try:
            got = task.run(b)
        except Exception as e:  # keep going: one broken task must not lose the others' figures
            progress.write(traceback.format_exc())
            got = [
                Row(op=task.part, impl="error", note=f"failed: {task.label}: {type(e).__name__}: {e}"[:400])
            ]
        rows += got
        progress.done(task.label, got, time.perf_counter() - t)
        free_memory(b)
    progress.close()

    judged = targets.evaluate(rows, b.empty_launch_us)
    env = report.environment(b, {"quick": args.quick, "only": args.parts, "dry_run": args.dry_run})
    env["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.out / f"zerokv-bench-{stamp}-{b.mode}"
    header = (
        f"# zerokv bench ({b.mode}): {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, "
        f"CuPy {env.get('cupy')}, NVRTC {env.get('nvrtc')}, CUDA runtime {env.get('cuda_runtime')}, "
        f"Triton {env.get('triton')}, {env['date']}, commit {env.get('git_commit')}"
    )
    text = header + "\n\n" + report.summary(b, rows, judged)
    report.write_json(stem.with_suffix(".json"), env, rows, judged)
    png_note = plot.write_png(rows, stem.with_suffix(".png"), header.removeprefix("# "))
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)
    print()
    written = [stem.with_suffix(s) for s in (".json", ".md")] + (
        [] if png_note else [stem.with_suffix(".png")]
    )
    print("wrote " + ", ".join(str(p) for p in written) + (f" ({png_note})" if png_note else ""))
    print(f"total {env['wall_s']:.0f} s")
    return 1 if any(r.note.startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
