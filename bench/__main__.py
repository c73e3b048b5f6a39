"""Benchmarks of zerokv: GPU time and bandwidth beside baselines, host cost per call, compile time.

Run from the source tree (needs torch with CUDA and CuPy; Triton, FlashInfer, matplotlib and
tqdm are used when installed)::

    PYTHONPATH=. python -m bench                       # everything (a few minutes on an H200)
    PYTHONPATH=. python -m bench --quick               # a representative part (about a minute)
    PYTHONPATH=. python -m bench --only merge,host     # parts: merge, options, empty_rows, host, compile, cp
    PYTHONPATH=. python -m bench --quick --out DIR     # results elsewhere (default: bench/results)
    PYTHONPATH=. python -m bench --dry-run             # the whole pipeline on the CPU, synthetic times

Parts:

* merge: ``merge_state`` over T x H x D, bf16 and fp16, both LSE layouts, beside a CUDA merge
  in vLLM's design, a Triton merge, torch eager (and FlashInfer when importable), with
  zerokv / best baseline per shape; ``merge_states`` N = 2, 4, 8.
* options: each option of ``merge_state`` (``a_empty`` with 25 % and 50 % empty requests,
  ``sinks``, a row mask, vLLM's verbatim suffix, ``prefix_rows``, fp8 with ``out_scale``,
  per-group fp8 in both scale formats) beside the plain merge of the same tensors and beside
  fixup + merge; per-group fp8 beside a Triton merge of vLLM's design; the seed pipeline
  (fused ``a_empty`` against vLLM's mask + ``masked_fill_`` + merge). bf16, H = 128, D = 128;
  LSEs laid [T, H], and [H, T] too for the plain merge, ``a_empty`` and fixup + merge;
  ``a_empty`` with 256 requests too (past 64 its search is the binary one).
* empty_rows: ``fixup_zero_kv_rows`` and ``mask_empty_context`` at 0 to 32768 empty rows
  beside torch eager; an empty kernel launch.
* host: host µs per call of every op and adapter beside ``torch.mul(a, b, out=c)`` and the
  Triton merge: a new token count every call, the same call repeated, outputs allocated.
* compile: the first call of each op in a fresh process, cold and warm cache.
* cp: context-parallel merge on two GPUs (``bench/bench_cp.py``, when present).

GPU µs come from replaying a CUDA graph of many calls (no host cost inside), beside the
CUDA-event time of one call; the implementations of one shape are replayed in interleaved
rounds (a new order each round) and each keeps the median of its rounds, so that the drift of a
GPU's clocks over a run falls on all of them alike. Inputs rotate over sets that together exceed twice the L2, so
that large shapes come from memory; a graph of 50 calls on shapes of a few hundred kB stays in
L2 (as an engine's merge finds what the attention kernel just wrote). GB/s = 1e9 bytes read +
written per second; % of copy = against a torch ``copy_`` of 1 GiB in the same run. Each run
writes ``zerokv-bench-<date>-<mode>.json`` (environment and every row), ``.md`` (the tables
and targets printed at the end) and ``.png`` into ``--out``.

Writing a bench module: ``bench/bench_<name>.py`` is listed in ``PARTS`` below and provides::

    def tasks(b: common.Bench, part: str) -> list[common.Task]

``part`` is the name given to ``--only`` (one module may serve several); ``b.mode`` is "full",
"quick" or "dry" (the CPU, ``b.device`` is the CPU and ``b.timer`` a fake), so the module must
pick sizes for each mode and keep "dry" quick. Each ``Task(part, label, run)`` is one step of
the progress bar; ``run(b)`` returns ``common.Row`` records: ``op`` names the table and the PNG
panel, ``impl`` the column and the line (``"zerokv"`` is ours, anything else a baseline),
``params`` what identifies the configuration (rows with equal op, dtype, T, H, D and params
share a table line), ``stats`` how it was measured, ``us`` µs per call, ``bytes`` the bytes
floor (``b.row`` turns it into GB/s and % of copy; ``b.measure`` checks and times the
implementations of a shape, each over rotating ``common.Sets``). A task that raises becomes a "failed" row and the run goes on; a
task that cannot run here (too few GPUs) returns a row whose note starts with "skipped:".
The report reads the rows only: an op it does not know gets a generic table and PNG panel.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PACKAGE = __package__ or "bench"
PARTS = {
    "merge": "bench_merge",
    "options": "bench_options",
    "empty_rows": "bench_empty_rows",
    "host": "bench_host",
    "compile": "bench_compile",
    "cp": "bench_cp",
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def present(part: str) -> bool:
    return importlib.util.find_spec(f"{PACKAGE}.{PARTS[part]}") is not None


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1].split("\nWriting a bench module")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a representative part of each grid (about a minute)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output directory (default: bench/results)"
    )
    parser.add_argument(
        "--only", default=None, help=f"comma-separated parts (default: all of {','.join(PARTS)} present)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="the whole pipeline on the CPU: tiny shapes, synthetic times"
    )
    args = parser.parse_args(argv)
    if args.only is None:
        args.parts = [p for p in PARTS if present(p)]
        return args
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        parser.error(
            f"--only: unknown part(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(PARTS)}"
        )
    missing = [p for p in parts if not present(p)]
    if missing:
        parser.error(f"--only: {', '.join(f'bench/{PARTS[p]}.py' for p in missing)} not found")
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
    from .common import Bench
    from .timing import CudaTimer, FakeTimer

    if args.dry_run:
        return Bench(torch, torch.device("cpu"), FakeTimer(), l2_bytes=4096, mode="dry")
    dev = torch.device("cuda", torch.cuda.current_device())
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 50 * 2**20
    timer = CudaTimer(torch, budget_us=6000.0 if args.quick else 30000.0)
    return Bench(torch, dev, timer, l2_bytes=l2, mode="quick" if args.quick else "full")


def plan(b: Any, parts: list[str]) -> list[Any]:
    from .common import Task, copy_row

    tasks = [Task("setup", "copy bandwidth", lambda b: [copy_row(b)])]
    for part in parts:
        tasks += importlib.import_module(f"{PACKAGE}.{PARTS[part]}").tasks(b, part)
    return tasks


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import torch
    except ImportError:
        print("bench: torch is not installed; the benchmarks need torch (with CUDA) and CuPy.")
        return 1
    if not args.dry_run and (problem := gpu_problem(torch)):
        print(f"bench: {problem}: nothing measured. (--dry-run runs the pipeline on the CPU.)")
        return 0

    from . import plot, report, run_record, targets
    from .common import Row, free_memory
    from .progress import Progress

    torch.manual_seed(0)
    b = make_bench(torch, args)
    tasks = plan(b, args.parts)
    where = "the CPU (dry run)" if b.dry else torch.cuda.get_device_name(b.device)
    print(
        f"zerokv bench, {b.mode}, parts {','.join(args.parts)}, on {where}: {len(tasks)} tasks",
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

    judged = targets.evaluate(rows, big_bytes=0 if b.dry else 256e6)
    env = run_record.environment(b, {"quick": args.quick, "only": args.parts, "dry_run": args.dry_run})
    env["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"zerokv-bench-{datetime.datetime.now():%Y%m%d-%H%M%S}-{b.mode}"
    title = run_record.header(env)
    text = f"# {title}\n\n{report.summary(rows, judged)}"
    run_record.write_json(stem.with_suffix(".json"), env, rows, judged)
    stem.with_suffix(".md").write_text(text + "\n")
    png_note = plot.write_png(rows, stem.with_suffix(".png"), title)
    print(text)
    print()
    written = [stem.with_suffix(".json"), stem.with_suffix(".md")] + (
        [] if png_note else [stem.with_suffix(".png")]
    )
    print("wrote " + ", ".join(str(p) for p in written) + (f" ({png_note})" if png_note else ""))
    print(f"total {env['wall_s']:.0f} s")
    return 1 if any(r.note.startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
