"""compute-sanitizer memcheck over every op with valid inputs and with lying offsets: no kernel
touches a byte outside its tensors (DESIGN.md: offsets are trusted for meaning, never for
memory). The calls live in sanitize_ops.py, run in a subprocess under the sanitizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@pytest.mark.gpu
def test_every_op_under_memcheck_reports_no_error():
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH (it ships with the CUDA toolkit)")
    env = dict(os.environ)
    # this tree's zerokv and the test helpers; one allocation per tensor, so that an access
    # past a tensor falls outside every allocation instead of inside torch's cached blocks
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(TESTS), env.get("PYTHONPATH")) if p)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    memcheck = [sanitizer, "--tool", "memcheck", "--error-exitcode", "1"]
    cmd = [*memcheck, sys.executable, str(TESTS / "sanitize_ops.py")]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-60:])
    summary = [line.strip("= ") for line in output.splitlines() if "ERROR SUMMARY" in line]
    calls = [line for line in output.splitlines() if line.startswith("sanitize_ops:")]
    line = summary[-1] if summary else "no ERROR SUMMARY line"
    print(f"{line}; {calls[-1] if calls else 'no call count'}; {seconds:.0f} s under the sanitizer")
    assert summary, f"no ERROR SUMMARY in the sanitizer's output:\n{tail}"
    assert summary[-1] == "ERROR SUMMARY: 0 errors", f"{summary[-1]}:\n{tail}"
    assert proc.returncode == 0, f"exit status {proc.returncode} (3: a call raised):\n{tail}"
