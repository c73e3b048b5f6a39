"""The sanitizer, tests and executors parts of the H200 script: compute-sanitizer's memcheck
over every op under each executor, ``pytest -m gpu`` on the tree, and each executor on the GPU
tests of the merges, the empty-row ops, the adapters and CUDA-graph capture (the executor that
``pytest -m gpu`` ran on takes those tests' outcomes from that run).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from . import h200_outputs as outputs
from .h200_results import EXECUTORS, ROOT
from .h200_run import Run, command, find_tool

MEMCHECK_TEST = "tests/test_sanitizer.py::test_every_op_under_memcheck_reports_no_error"


def part_sanitizer(run: Run) -> dict[str, Any]:
    tool = find_tool("compute-sanitizer")
    if run.cpu:
        return {"status": "not run: no GPU", "tool": tool}
    if tool is None:
        return {"status": "not run: compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"}
    rec: dict[str, Any] = {"status": "ran", "tool": tool, "executors": {}}
    argv = [tool, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "tests/sanitize_ops.py"]
    for name in EXECUTORS:
        extra = {
            "ZEROKV_LAUNCHER": name,
            # one allocation per tensor, so that an access past a tensor falls outside every allocation
            "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
            **run.shared_caches(),
        }
        step, output = command(run, f"sanitizer: memcheck, ZEROKV_LAUNCHER={name}", argv, "memcheck", extra)
        step.update(outputs.memcheck_lines(output))
        rec["executors"][name] = step
    return rec


def _pytest_argv(run: Run, args: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *args]
    if run.workers and not run.cpu:
        argv += ["-n", str(run.workers)]
    return argv


def _pytest_record(step: dict[str, Any], output: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The run's summary line, its failures and its per-test outcomes counted; and the outcomes."""
    outcomes = outputs.pytest_outcomes(output)
    step["summary"] = outputs.pytest_summary(output)
    step["failures"] = outputs.pytest_failures(output)
    step["outcomes"] = {o: sum(v == o for v in outcomes.values()) for o in sorted(set(outcomes.values()))}
    return step, outcomes


def collect(run: Run, label: str, args: list[str], extra: dict[str, str] | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args]
    step, output = command(run, label, argv, "collect", extra)
    step.update(outputs.collected(output))
    return step


def gpu_test_ids(run: Run) -> list[str]:
    """Every GPU test's node id: those of this run's whole ``pytest -m gpu`` where it finished,
    else collected."""
    if "gpu_ids" not in run.background:
        step = collect(run, "tests: collect -m gpu", ["-m", "gpu"])
        run.background["gpu_ids"] = step.get("ids", [])
        run.background["gpu_collect"] = {k: v for k, v in step.items() if k != "ids"}
    return run.background["gpu_ids"]


def part_tests(run: Run) -> dict[str, Any]:
    args = ["-m", "gpu"]
    rec: dict[str, Any] = {"status": "ran"}
    if not run.memcheck_test:  # the sanitizer part runs its memcheck, once per executor
        args += ["--deselect", MEMCHECK_TEST]
        rec["deselected"] = {MEMCHECK_TEST: "the sanitizer part runs its memcheck per executor"}
    step, output = command(run, "tests: pytest -m gpu", _pytest_argv(run, args), "pytest")
    rec["pytest"], outcomes = _pytest_record(step, output)
    if step["summary"].get("line") and step.get("rc") in (0, 1):  # finished: every selected test has a line
        run.background["gpu_ids"] = sorted(outcomes)
        run.background["gpu_outcomes"] = outcomes
    rec["tests_seen"] = len(outcomes)
    rec["cpu"] = run.cpu
    return rec


def part_executors(run: Run) -> dict[str, Any]:
    ids = gpu_test_ids(run)
    args, groups = outputs.executor_selection(ids)
    rec: dict[str, Any] = {"status": "ran", "groups": groups, "executors": {}, "gpu_tests_known": len(ids)}
    rec["ids_from"] = run.background.get("gpu_collect") or "this run's pytest -m gpu"
    if not args:
        return {**rec, "status": "failed: none of the selected test files was collected"}
    outcomes = run.background.get("gpu_outcomes")
    launcher = run.background.get("launcher") or ["", ""]
    for name in EXECUTORS:
        if run.reuse and outcomes and launcher[0] == name:
            rec["executors"][name] = outputs.from_outcomes(outcomes, args, launcher)
            continue
        extra = {"ZEROKV_LAUNCHER": name, **run.shared_caches()}
        step, output = command(
            run,
            f"executors: ZEROKV_LAUNCHER={name} pytest",
            _pytest_argv(run, ["-m", "gpu", *args]),
            "pytest",
            extra,
        )
        rec["executors"][name], _ = _pytest_record(step, output)
    rec["cpu"] = run.cpu
    return rec
