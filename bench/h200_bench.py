"""The bench and host parts of the H200 script: ``python -m bench --quick`` (the merge grid and
the options, compared with the last runs; the host rows), ``python -m bench.profile_call``, and
``python -m bench.compiled_op``, whose vLLM-design torch op is built with nvcc in the background
while the other parts run, then timed beside zerokv's calls and the launch floor.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import h200_history as history
from .h200_results import ROOT
from .h200_run import CAPS, LOG_CHARS, RESERVE_S, TAIL_LINES, Run, command, find_tool, kill_group

BENCH_PARTS = "merge,options"


def start_op_build(run: Run) -> None:
    """The compiled torch op, built in the background while the other parts run."""
    nvcc = find_tool("nvcc")
    if nvcc is None:
        run.background["build"] = {"status": "not run: nvcc not found"}
        return
    directory, result = run.work / "vllm-op", run.work / "vllm-op.json"
    argv = [sys.executable, "-m", "bench.compiled_op", "--build", str(directory), "--json", str(result)]
    # nvcc, and this Python's scripts (ninja, when pip installed it), on the build's PATH
    path = [str(Path(nvcc).parent), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    extra = {"PATH": os.pathsep.join(path)}
    home = cuda_home(nvcc)
    if home:
        extra["CUDA_HOME"] = home
    with open(run.work / "vllm-op.log", "w") as log:  # the child writes to its own copy
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=run.env(extra), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    run.background["build"] = {"proc": proc, "argv": argv, "result": result, "start": time.monotonic()}


def cuda_home(nvcc: str) -> str | None:
    """The toolkit root whose headers the extension compiles against."""
    for root in (
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        str(Path(nvcc).resolve().parent.parent),
        "/usr/local/cuda",
    ):
        if root and (Path(root) / "include" / "cuda_runtime.h").exists():
            return root
    return None


def wait_op_build(run: Run) -> dict[str, Any]:
    bg = run.background.get("build") or {"status": "not run: the host part did not start it"}
    if "proc" not in bg:
        return bg
    proc = bg["proc"]
    timeout = max(
        0.0, min(CAPS["build"] - (time.monotonic() - bg["start"]), run.remaining() - RESERVE_S - 60)
    )
    rec: dict[str, Any] = {"cmd": shlex.join(bg["argv"])}
    try:
        proc.wait(timeout=timeout)
        rec["status"] = "ran"
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        rec["status"] = f"timed out after {time.monotonic() - bg['start']:.0f} s"
    output = (run.work / "vllm-op.log").read_text(errors="replace")
    run.log(f"\n$ {rec['cmd']}\n{output[-LOG_CHARS:]}\n[{rec['status']}, exit {proc.returncode}]\n")
    rec["rc"], rec["tail"] = proc.returncode, output.splitlines()[-TAIL_LINES:]
    if proc.returncode == 0 and bg["result"].exists():
        rec.update(json.loads(bg["result"].read_text()))
    run.background["build"] = rec
    return rec


def part_host(run: Run) -> dict[str, Any]:
    rec: dict[str, Any] = {"status": "ran"}
    table = run.work / "profile_call.json"
    argv = [sys.executable, "-m", "bench.profile_call", "--json", str(table), "--rounds", str(run.rounds)]
    step, _ = command(
        run, "host: profile_call", argv + (["--cpu"] if run.cpu else []), "host", run.shared_caches()
    )
    rec["profile_call"] = step
    if step.get("rc") == 0 and table.exists():
        step["table"] = json.loads(table.read_text())
    build = {"status": "not run: no GPU (the op is a CUDA extension)"} if run.cpu else wait_op_build(run)
    rec["vllm_op_build"] = build
    beside = run.work / "beside.json"
    argv = [
        sys.executable,
        "-m",
        "bench.compiled_op",
        "--time",
        "--json",
        str(beside),
        "--rounds",
        str(run.rounds),
    ]
    if build.get("library"):
        argv += ["--library", build["library"]]
    step, _ = command(
        run,
        "host: compiled op and floor beside",
        argv + (["--cpu"] if run.cpu else []),
        "host",
        run.shared_caches(),
    )
    rec["beside"] = step
    if step.get("rc") == 0 and beside.exists():
        step["table"] = json.loads(beside.read_text())
    # the bench's host rows: the Triton merge, inference mode, cp_merge's local part, the floor
    # (one round in quick mode), after the build so that no compile runs beside the timing
    rec["bench_host"], _ = run_bench(run, "host", (".json",))
    return rec


def run_bench(run: Run, only: str, keep: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``python -m bench --quick --only ONLY`` (``--dry-run`` on the CPU) into the work
    directory; its files with the suffixes ``keep`` copied to ``--out``/bench. Returns the step's
    record and the bench's JSON."""
    work = run.work / f"bench-{only.replace(',', '-')}"
    mode = "--dry-run" if run.cpu else "--quick"
    argv = [sys.executable, "-m", "bench", mode, "--only", only, "--out", str(work)]
    rec, _ = command(run, f"bench: {mode} --only {only}", argv, "bench", run.shared_caches())
    found = sorted(work.glob("zerokv-bench-*.json"))
    if not found:
        rec["error"] = "the bench wrote no JSON"
        return rec, None
    (run.out / "bench").mkdir(exist_ok=True)
    rec["files"] = []
    for path in sorted(work.glob(f"{found[-1].stem}.*")):
        if path.suffix in keep:
            shutil.copy2(path, run.out / "bench" / path.name)
            rec["files"].append(f"bench/{path.name}")
    data = json.loads(found[-1].read_text())
    rec["targets"], rec["environment"] = data["targets"], data["environment"]
    return rec, data


def part_bench(run: Run) -> dict[str, Any]:
    rec, data = run_bench(run, BENCH_PARTS, (".json", ".md", ".png"))
    if data is not None:
        rec["comparison"] = history.compare_with_history(data["rows"], run.history, run.noise)
    rec["dry"] = run.cpu
    return rec
