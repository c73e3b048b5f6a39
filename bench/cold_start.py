"""Cold start of N worker processes sharing one kernel cache.

N processes start at once, each imports zerokv and runs ``precompile(dtypes=...)`` on a GPU
(round-robin over the visible GPUs) then one merge; seconds from process start to done, per
process. Three rounds: an empty ``CUPY_CACHE_DIR`` shared by all, the same directory again
(warm), and a kernel directory built by ``python -m zerokv compile --out`` (``ZEROKV_KERNEL_DIR``,
an empty CuPy cache). Every process must succeed.

    PYTHONPATH=. python bench/cold_start.py --workers 8 --dtypes bfloat16 --out DIR   (writes cold_start.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import sys, time
start = float(sys.argv[1])
import torch
import zerokv
device = int(sys.argv[2])
torch.cuda.set_device(device)
n = zerokv.precompile(dtypes=tuple(sys.argv[3].split(",")), device=device)
v = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
s = torch.randn(64, 8, device="cuda")
zerokv.merge_state(v, s, v, s)
torch.cuda.synchronize()
print(f"{time.time() - start:.3f} {n}")
"""


def round_(name: str, workers: int, dtypes: str, env: dict[str, str]) -> dict:
    import torch

    gpus = max(torch.cuda.device_count(), 1)
    start = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, repr(start), str(i % gpus), dtypes],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(workers)
    ]
    seconds, loaded, failures = [], [], []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode:
            failures.append(err.strip().splitlines()[-1:] or [f"exit {p.returncode}"])
            continue
        s, n = out.split()
        seconds.append(float(s))
        loaded.append(int(n))
    row = {
        "round": name,
        "workers": workers,
        "succeeded": len(seconds),
        "failures": failures,
        "median_s": statistics.median(seconds) if seconds else None,
        "slowest_s": max(seconds) if seconds else None,
        "fastest_s": min(seconds) if seconds else None,
        "instantiations": loaded[:1],
    }
    print(
        f"{name:40s} {row['succeeded']}/{workers} ok  median {row['median_s']} s  slowest {row['slowest_s']} s",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    import torch

    major, minor = torch.cuda.get_device_capability()
    root = Path(tempfile.mkdtemp(prefix="zerokv-cold-"))
    base = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
        ),
    )
    base.pop("ZEROKV_KERNEL_DIR", None)
    shared = dict(base, CUPY_CACHE_DIR=str(root / "cupy-shared"))
    rows = [
        round_("empty shared CUPY_CACHE_DIR", args.workers, args.dtypes, shared),
        round_("the same CUPY_CACHE_DIR, warm", args.workers, args.dtypes, shared),
    ]
    kernels = root / "kernels"
    t = time.time()
    subprocess.run(
        [sys.executable, "-m", "zerokv", "compile", "--arch", f"sm_{major}{minor}", "--dtypes", args.dtypes,
         "--out", str(kernels)],
        env=dict(base, ZEROKV_CACHE_DIR=str(root / "zerokv-cache")), check=True, capture_output=True,
    )  # fmt: skip
    build_s = time.time() - t
    image = dict(base, CUPY_CACHE_DIR=str(root / "cupy-empty"), ZEROKV_KERNEL_DIR=str(kernels))
    rows.append(round_("ZEROKV_KERNEL_DIR (image build)", args.workers, args.dtypes, image))
    meta = {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "cpus": os.cpu_count(),
            "dtypes": args.dtypes, "image_build_s": round(build_s, 2)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_start.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
