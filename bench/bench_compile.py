"""Compile time of the kernels (``--only compile``): the first call of each op in a fresh
process with its own ``CUPY_CACHE_DIR``: cold (empty cache: NVRTC compile, load, first launch)
and warm (a new process on the cache the cold one filled); "engine" = the bf16 vector path of
each op, "all" = every instantiation through ``zerokv.precompile`` (full runs only). The child
process is this module::

    python -m bench.bench_compile --compile-child engine|all [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from .common import Bench, Row, Task  # nothing that imports zerokv: the compile child times that
from .host_cases import D, H

ROOT = Path(__file__).resolve().parent.parent  # holds the bench package
COMPILE_TIMEOUT_S = 300


def child(which: str, cache_dir: str, dry: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = cache_dir
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([str(ROOT)] if str(ROOT) not in paths else []))
    cmd = [sys.executable, "-m", "bench.bench_compile", "--compile-child", which] + (["--cpu"] if dry else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited with {proc.returncode}: {proc.stderr.strip()[-600:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    result["cache_files"] = sum(len(files) for _, _, files in os.walk(cache_dir))
    return result


def compile_rows(kind: str, which: str, result: dict[str, Any]) -> list[Row]:
    rows = [
        Row(op="compile", impl=kind, us=s * 1e6, params={"set": which, "item": item})
        for item, s in result["items"].items()
    ]
    extra = {k: v for k, v in result.items() if k not in ("items", "total_s", "set")}
    rows.append(
        Row(op="compile", impl=kind, us=result["total_s"] * 1e6, params={"set": which, "item": "total"})
    )
    rows[-1].stats = extra
    return rows


def run_compile(which: str, b: Bench) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="zerokv-bench-cache-") as cache:
        cold = child(which, cache, b.dry)
        warm = child(which, cache, b.dry)
    return compile_rows("cold", which, cold) + compile_rows("warm", which, warm)


def compile_child(which: str, cpu: bool) -> dict[str, Any]:
    """In a fresh process: tensors made and torch's CUDA context up before ``import zerokv``;
    the clock starts after that import, as an engine sees it."""
    import torch

    dev = torch.device("cpu" if cpu else "cuda")

    def sync() -> None:
        if not cpu:
            torch.cuda.synchronize()

    T, bf = 4, torch.bfloat16
    va, vb, out = (torch.randn(T, H, D, device=dev, dtype=bf) for _ in range(3))
    sa, sb, lse = (torch.randn(T, H, device=dev) for _ in range(3))
    v, s = torch.randn(2, T, H, D, device=dev, dtype=bf), torch.randn(2, T, H, device=dev)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=dev)
    kv = torch.tensor([0, 3], dtype=torch.int32, device=dev)
    cu_kv = torch.tensor([0, 0, 3], dtype=torch.int32, device=dev)
    sync()

    t = time.perf_counter()
    import zerokv

    result: dict[str, Any] = {"set": which, "import_s": time.perf_counter() - t, "items": {}}
    result["cupy_imported_by_import"] = "cupy" in sys.modules
    t0 = time.perf_counter()
    if which == "engine":
        ops = [
            ("merge_state bf16", lambda: zerokv.merge_state(va, sa, vb, sb, out=out, out_lse=lse)),
            ("merge_states bf16", lambda: zerokv.merge_states(v, s, out=out, out_lse=lse)),
            ("fixup_zero_kv_rows bf16", lambda: zerokv.fixup_zero_kv_rows(out, lse, kv, cu)),
            ("mask_empty_context bf16", lambda: zerokv.mask_empty_context(out, lse, cu, cu_kv)),
        ]
        for name, fn in ops:
            t = time.perf_counter()
            fn()
            sync()
            result["items"][name] = time.perf_counter() - t
    elif not cpu:
        count = 0
        for op in ("merge_state", "merge_states", "fixup_zero_kv_rows", "mask_empty_context", "cp_merge"):
            t = time.perf_counter()
            try:
                n = zerokv.precompile(ops=[op])  # every dtype: compiles and loads each instantiation
            except Exception as e:  # an op this version does not have, or a failed compile
                result.setdefault("errors", {})[op] = f"{type(e).__name__}: {e}"[:300]
                continue
            result["items"][f"{op} ({n} instantiations)"] = time.perf_counter() - t
            count += n
        result["instantiations"] = count
    result["total_s"] = time.perf_counter() - t0
    return result


# --- tasks ------------------------------------------------------------------------------------


def tasks(b: Bench, part: str) -> list[Task]:
    sets = ["engine"] if b.mode != "full" else ["engine", "all"]
    return [Task(part, f"compile: {w} set, cold + warm", partial(run_compile, w)) for w in sets]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_compile")
    parser.add_argument("--compile-child", choices=("engine", "all"), required=True)
    parser.add_argument("--cpu", action="store_true", help="the CPU path (checks the pipeline only)")
    args = parser.parse_args(argv)
    print(json.dumps(compile_child(args.compile_child, args.cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
