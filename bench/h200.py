"""Everything a GPU run of zerokv reports, in one command, as JSON: the GPU tests, the memory
checker over every op, both executors, the host table beside a compiled torch op, the
kernels' quick bench against the last figures, and a summary that judges the release goals.

    python -m bench.h200 --out DIR                     # every part, within --budget-s seconds
    python -m bench.h200 --out DIR --part tests        # some parts (the others in another run)
    python -m bench.h200 --cpu --out DIR               # what runs without a GPU
    python -m bench.h200 --assemble DIR1 DIR2 --out DIR   # one summary of runs of different parts

Parts, in the order they run (``env`` always runs):

* env: Python, torch, the GPU, the tools (nvcc, compute-sanitizer, ncu, ninja), which executor
  each ``ZEROKV_LAUNCHER`` loads, a fingerprint of the sources.
* bench: ``python -m bench --quick --only merge,options``; the merge grid's worst ratio to
  the best baseline and each option's ratio to the plain merge, against the last runs kept in
  ``bench/h200/`` (a difference beyond the replays' spread, at least ``--noise``, is a change).
* host: ``python -m bench.profile_call --json`` (every public call per executor beside
  ``torch.mul(out=)``), then ``python -m bench.compiled_op --time``: the vLLM-design merge built
  as a compiled torch op (nvcc, into a temporary directory, built while the other parts run) and
  the check-free launch floor beside ``merge_state`` with a new T every call, in one process;
  then ``python -m bench --quick --only host`` (the Triton merge, ``cp_merge``'s local part...).
* sanitizer: ``compute-sanitizer --tool memcheck`` over ``tests/sanitize_ops.py`` (every op with
  valid offsets and with offsets that lie) under each executor; the ``ERROR SUMMARY`` lines.
* tests: ``pytest -m gpu -v`` on the tree (``--workers`` processes with pytest-xdist; the
  memcheck test deselected unless ``--with-memcheck-test``: the sanitizer part runs that
  memcheck per executor).
* executors: ``ZEROKV_LAUNCHER=c`` and ``=python``, each on the GPU tests of the merges, the
  empty-row ops, the adapters and CUDA-graph capture. The executor that ``pytest -m gpu`` ran
  on (``ZEROKV_LAUNCHER`` unset) takes those tests' outcomes from that run, unless
  ``--rerun-default-executor``.

``--cpu`` (also taken when no GPU is found): the GPU tests collected and skipped, the host table
with CPU tensors and launches counted (``zerokv.testing``), the bench's dry run; the GPU parts
are marked "not run: no GPU". Every step fails soft: a missing tool, a failing or timed-out
command is recorded with its error and the run goes on; a step that no longer fits in the budget
is marked "not run: out of time" and the summary names the ``--part`` to run next.

Files under ``--out`` (seven at most): ``summary.json`` (the goals, each with its value and
verdict), ``parts.json`` (every step: command, exit status, seconds, output tail, parsed
results), ``h200.log`` (every command's whole output) and ``bench/`` (the merge bench's JSON,
Markdown and PNG, the host bench's JSON). Both JSON files are rewritten after each part.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import h200_results as results
from .h200_bench import part_bench, part_host, start_op_build
from .h200_env import part_env
from .h200_results import PARTS
from .h200_run import HISTORY, Run, kill_group
from .h200_tests import part_executors, part_sanitizer, part_tests

# --- the summary ------------------------------------------------------------------------------


def write(out: Path, record: dict[str, Any]) -> dict[str, Any]:
    parts = record["parts"]
    checks = results.evaluate(parts)
    left = results.leftover(parts)
    summary = {
        "date": record.get("date"),
        "mode": record.get("mode"),
        "gpu": (parts.get("env", {}).get("python") or {}).get("gpu"),
        "sources": parts.get("env", {}).get("sources"),
        "verdict": results.verdict(checks),
        "checks": checks,
        "parts": {k: v.get("status") for k, v in parts.items()},
        "next": f"python -m bench.h200 --out DIR --part {','.join(left)}" if left else None,
        "wall_s": record.get("wall_s"),
    }
    (out / "parts.json").write_text(json.dumps(results.clean(record), indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(results.clean(summary), indent=1) + "\n")
    return summary


def print_summary(summary: dict[str, Any], out: Path) -> None:
    print(f"\nh200: {summary['verdict']} ({summary.get('gpu') or 'no GPU'}; {out})")
    for c in summary["checks"]:
        value = c["value"]
        if isinstance(value, dict):
            value = {
                k: v for k, v in value.items() if k not in ("options", "notes") and v not in (None, [], {})
            }
        print(f"  [{c['status']}] {c['name']} ({c['goal']}): {json.dumps(results.clean(value))[:300]}")
    if summary.get("next"):
        print(f"  next: {summary['next']}")


# --- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.h200",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="where the JSON, the log and the bench's files go"
    )
    parser.add_argument(
        "--part", default=",".join(PARTS[1:]), help=f"comma-separated, of {','.join(PARTS[1:])}"
    )
    parser.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="what runs without a GPU")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (GPU: 570)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="pytest-xdist processes for the GPU tests (GPU: 6 when installed; 0: one process)",
    )
    parser.add_argument(
        "--rounds", type=int, default=7, help="interleaved rounds of the host tables (>= 5 for figures)"
    )
    parser.add_argument(
        "--noise", type=float, default=0.02, help="the least ratio change counted beyond noise"
    )
    parser.add_argument(
        "--history", type=Path, default=HISTORY, help="the last runs' bench JSON (default: bench/h200)"
    )
    parser.add_argument(
        "--with-memcheck-test",
        action="store_true",
        help="pytest -m gpu keeps tests/test_sanitizer.py (the sanitizer part runs its memcheck per executor)",
    )
    parser.add_argument(
        "--rerun-default-executor",
        action="store_true",
        help="run the executors part's tests for the executor pytest -m gpu ran on too",
    )
    parser.add_argument(
        "--assemble", type=Path, nargs="+", metavar="DIR", help="runs' --out directories to summarise as one"
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        parser.error(f"--part: unknown {', '.join(bad)}; choose from {', '.join(PARTS[1:])}")
    args.parts = [p for p in PARTS if p in parts or p == "env"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.assemble:
        summary = write(args.out, results.assemble(args.assemble))
        print_summary(summary, args.out)
        return 0
    (args.out / "h200.log").write_text("")
    work = Path(tempfile.mkdtemp(prefix="zerokv-h200-"))  # outside the source tree
    budget = args.budget_s if args.budget_s is not None else (3600.0 if args.cpu else 570.0)
    run = Run(
        out=args.out,
        work=work,
        cpu=args.cpu,
        budget_s=budget,
        parts=args.parts,
        rounds=args.rounds,
        noise=args.noise,
        history=args.history,
        memcheck_test=args.with_memcheck_test,
        reuse=not args.rerun_default_executor,
    )
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record: dict[str, Any] = {"date": date, "args": {k: str(v) for k, v in vars(args).items()}, "parts": {}}
    try:
        record["parts"]["env"] = env = part_env(run, gpu_wanted=not args.cpu)
        run.cpu = args.cpu or not env["gpu"]
        xdist = bool((env.get("python") or {}).get("xdist"))
        run.workers = (args.workers if args.workers is not None else 6) if xdist and not run.cpu else 0
        record["mode"] = "cpu" if run.cpu else "gpu"
        record["workers"] = run.workers
        if "host" in run.parts and not run.cpu:
            start_op_build(run)
        steps = {
            "bench": part_bench,
            "host": part_host,
            "sanitizer": part_sanitizer,
            "tests": part_tests,
            "executors": part_executors,
        }
        for name in run.parts[1:]:
            try:
                record["parts"][name] = steps[name](run)
            except Exception as e:  # one broken part must not lose the others
                record["parts"][name] = {"status": f"failed: {type(e).__name__}: {e}"[:600]}
                run.log(f"\n[{name} failed]\n{_traceback()}\n")
            record["wall_s"] = round(time.monotonic() - run.started, 1)
            write(args.out, record)
    finally:
        bg = run.background.get("build") or {}
        if "proc" in bg:  # the host part did not wait for it
            kill_group(bg["proc"])
        shutil.rmtree(work, ignore_errors=True)
    record["wall_s"] = round(time.monotonic() - run.started, 1)
    summary = write(args.out, record)
    print_summary(summary, args.out)
    return 0


def _traceback() -> str:
    import traceback

    return traceback.format_exc()


if __name__ == "__main__":
    sys.exit(main())
