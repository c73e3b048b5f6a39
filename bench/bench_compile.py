"""Compile time: each figure from a fresh process (bench/compile_child.py) with its own
``CUPY_CACHE_DIR``.

* cold: an empty cache directory: NVRTC compile + load + first launch of each op;
* warm: a new process on the cache the cold run filled: disk-cache load + first launch.

Two sets: "engine" (the first call of each op on its bf16 vector path, what an engine uses) and
"all" (compile + load of every registered instantiation, no launch). Times run from after
``import zerokv`` to the end of the last first call, synchronised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from .common import Bench, Row, Task

TOTAL = "total"
TIMEOUT_S = 300
ROOT = Path(__file__).resolve().parent.parent  # holds the bench package


def child(mode: str, cache_dir: str, dry: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = cache_dir
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        paths.append(str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "bench.compile_child", mode] + (["--cpu"] if dry else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited with {proc.returncode}: {proc.stderr.strip()[-600:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    result["cache_files"] = sum(len(files) for _, _, files in os.walk(cache_dir))
    return result


def rows_of(kind: str, which: str, result: dict[str, Any]) -> list[Row]:
    rows = [
        Row(op="compile", impl=kind, us=s * 1e6, params={"set": which, "item": item})
        for item, s in result["items"].items()
    ]
    extra = {k: v for k, v in result.items() if k not in ("items", "total_s", "mode")}
    rows.append(
        Row(
            op="compile", impl=kind, us=result["total_s"] * 1e6, params={"set": which, "item": TOTAL, **extra}
        )
    )
    return rows


def run(which: str, b: Bench) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="zerokv-bench-cache-") as cache:
        cold = child(which, cache, b.dry)
        warm = child(which, cache, b.dry)
    return rows_of("cold", which, cold) + rows_of("warm", which, warm)


def tasks(mode: str) -> list[Task]:
    return [
        Task("compile", "compile: engine set, cold + warm", partial(run, "engine")),
        Task("compile", "compile: every instantiation, cold + warm", partial(run, "all")),
    ]
