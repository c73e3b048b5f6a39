"""GPU time of zerokv's kernels, this tree beside another, the runs alternated in one session.

    PYTHONPATH=. python3 -m bench.ab --other DIR [--rounds 2] [--parts merge,options] --out FILE

``DIR`` holds another ``zerokv/`` and ``kernels_cu/`` (a branch's tree, e.g. ``git worktree``
or ``git archive``). Each round runs ``python -m bench --quick --only PARTS`` on this tree, then
on ``DIR`` (this tree's ``bench/`` both times, the package of each tree), from a directory
outside both so that each process imports its own ``zerokv``. ``FILE`` (JSON): every zerokv row's
µs per tree and run, the ratio of the medians (other / this), each tree's own spread between its
runs, and the rows whose ratio leaves that spread. ``--dry-run``: the bench's synthetic times,
on the CPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``python args`` importing ``tree``'s zerokv (and this tree's bench), from a directory
    outside both trees."""
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{ROOT}")
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)


def _run(tree: Path, parts: str, out: str, dry: bool) -> tuple[int, str]:
    p = _python(
        tree, "-m", "bench", "--quick", "--only", parts, "--out", out, *(["--dry-run"] if dry else [])
    )
    return p.returncode, (p.stdout + p.stderr)[-2000:]


def _package(tree: Path) -> str:
    return _python(tree, "-c", "import zerokv; print(zerokv.__file__)").stdout.strip()


def _rows(out: str) -> dict[str, float]:
    rows = {}
    for f in glob.glob(os.path.join(out, "*.json")):
        for r in json.loads(Path(f).read_text())["rows"]:
            if r["impl"] == "zerokv":
                rows[json.dumps([r["op"], r["dtype"], r["T"], r["H"], r["D"], r["params"]])] = r["us"]
    return rows


def _spread(runs: list[float]) -> float:
    return max(runs) / min(runs) - 1 if len(runs) > 1 and min(runs) > 0 else 0.0


def compare(times: dict[str, dict[str, list[float]]]) -> dict:
    """``times``: row -> tree ("this", "other") -> µs per run. The ratios and what leaves noise."""
    rows, ratios, spreads = {}, [], []
    for k, v in times.items():
        if not v.get("this") or not v.get("other"):
            continue
        ratio = statistics.median(v["other"]) / statistics.median(v["this"])
        noise = max(_spread(v["this"]), _spread(v["other"]))
        rows[k] = {**v, "ratio": ratio, "noise": noise}
        ratios.append(ratio)
        spreads.append(_spread(v["this"]))
    beyond = {k: r for k, r in rows.items() if abs(r["ratio"] - 1) > max(r["noise"], 0.002)}
    return {
        "rows": rows,
        "n": len(rows),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "this_spread_median": statistics.median(spreads) if spreads else None,
        "beyond_noise": dict(sorted(beyond.items(), key=lambda kv: kv[1]["ratio"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab")
    parser.add_argument("--other", required=True, help="a tree with zerokv/ and kernels_cu/")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="merge,options")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="synthetic times, on the CPU")
    args = parser.parse_args(argv)
    trees = {"this": ROOT, "other": Path(args.other).resolve()}
    packages = {name: _package(tree) for name, tree in trees.items()}
    if packages["this"] == packages["other"]:
        print(f"bench.ab: both trees import the same zerokv ({packages['this']})", file=sys.stderr)
    times: dict[str, dict[str, list[float]]] = {}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in trees.items():
                out, t0 = os.path.join(tmp, f"{name}-{r}"), time.time()
                rc, tail = _run(tree, args.parts, out, args.dry_run)
                runs.append(
                    {"tree": name, "round": r, "rc": rc, "s": round(time.time() - t0, 1), "tail": tail}
                )
                print(f"bench.ab: {name} round {r}: exit {rc}, {time.time() - t0:.0f} s", flush=True)
                for k, us in _rows(out).items():
                    times.setdefault(k, {}).setdefault(name, []).append(us)
    result = {"packages": packages, "runs": runs, **compare(times)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"bench.ab: {result['n']} rows, median other / this {result['median_ratio']}")
    for k, v in result["beyond_noise"].items():
        print(f"  {v['ratio']:.3f}  {k}")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
