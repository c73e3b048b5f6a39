"""How the H200 script runs its commands: the run's settings, clock and budget, the
environment and kernel caches its children share, its log; a command in its own process group
from the repository root, its output captured, killed with its children at its step's cap or
at the budget's end; and where the CUDA tools are found. Every part runs through here, so that
no step can outlive the budget.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .h200_results import ROOT

HISTORY = ROOT / "bench" / "h200"
# seconds a step may take at most (and the budget's remainder), and what is kept back for writing
CAPS = {"probe": 90, "bench": 300, "build": 400, "host": 150, "memcheck": 240, "collect": 150, "pytest": 560}
RESERVE_S, MIN_STEP_S = 10.0, 20.0
LOG_CHARS = 1_500_000  # of one command's output in the log (its end)
TAIL_LINES = 40


@dataclass
class Run:
    """One invocation: where it writes, its clock, its mode."""

    out: Path
    work: Path
    cpu: bool
    budget_s: float
    parts: list[str]
    workers: int = 0
    rounds: int = 7
    noise: float = 0.02
    history: Path = HISTORY
    memcheck_test: bool = False  # pytest -m gpu keeps tests/test_sanitizer.py
    reuse: bool = True  # the executor a plain run loads takes its outcomes from pytest -m gpu
    started: float = field(default_factory=time.monotonic)
    background: dict[str, Any] = field(default_factory=dict)

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra or {})
        return env

    def shared_caches(self) -> dict[str, str]:
        """One kernel cache for the bench, host, memcheck and executor runs: each kernel compiles
        once per run (``pytest -m gpu`` keeps the suite's own temporary caches)."""
        return {
            "ZEROKV_CACHE_DIR": str(self.work / "cache" / "zerokv"),
            "CUPY_CACHE_DIR": str(self.work / "cache" / "cupy"),
            "TRITON_CACHE_DIR": str(self.work / "cache" / "triton"),
        }

    def log(self, text: str) -> None:
        with open(self.out / "h200.log", "a") as f:
            f.write(text)


def command(
    run: Run, label: str, argv: list[str], cap: str, extra_env: dict[str, str] | None = None
) -> tuple[dict, str]:
    """Run ``argv`` in its own process group from the repository root, its output captured;
    killed at the step's cap or the budget's end. Returns its record and its output."""
    rec: dict[str, Any] = {"label": label, "cmd": shlex.join(argv), "env": extra_env or {}}
    timeout = min(CAPS[cap], run.remaining() - RESERVE_S)
    if timeout < MIN_STEP_S:
        rec["status"] = f"not run: out of time ({run.budget_s:.0f} s budget spent)"
        print(f"h200: {label}: {rec['status']}", flush=True)
        return rec, ""
    print(f"h200: {label} ...", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=run.env(extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except OSError as e:
        rec["status"] = f"failed: {type(e).__name__}: {e}"
        run.log(f"\n$ {rec['cmd']}\n{rec['status']}\n")
        return rec, ""
    try:
        output, _ = proc.communicate(timeout=timeout)
        rec["status"] = "ran"
    except subprocess.TimeoutExpired:
        kill_group(proc)
        output, _ = proc.communicate()
        rec["status"] = f"timed out after {timeout:.0f} s"
    rec["rc"], rec["seconds"] = proc.returncode, round(time.monotonic() - start, 1)
    rec["tail"] = output.splitlines()[-TAIL_LINES:]
    envs = " ".join(f"{k}={v}" for k, v in (extra_env or {}).items())
    run.log(
        f"\n$ {envs} {rec['cmd']}\n{output[-LOG_CHARS:]}\n[{rec['status']}, exit {rec['rc']}, {rec['seconds']} s]\n"
    )
    print(f"h200: {label}: {rec['status']}, exit {rec['rc']}, {rec['seconds']} s", flush=True)
    return rec, output


def kill_group(proc: subprocess.Popen) -> None:
    """The process group this run started (a pytest's workers, a sanitizer's target)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def find_tool(name: str) -> str | None:
    """On PATH, else in the CUDA toolkit's bin (CUDA_HOME, or its default prefixes)."""
    found = shutil.which(name)
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    versioned = sorted(glob.glob(f"/usr/local/cuda-*/bin/{name}"), reverse=True)
    candidates = [f"{h}/bin/{name}" for h in homes if h] + versioned
    return next((c for c in candidates if os.access(c, os.X_OK)), None)
