"""What the H200 script's commands print, read: pytest's summary line, per-test outcomes,
failures and collected node ids; compute-sanitizer's ``ERROR SUMMARY`` lines; and the GPU
tests each executor runs, selected from what was collected or counted from a run's per-test
outcomes. Pure text in, records out: the goals judge these records (``h200_results``).
"""

from __future__ import annotations

import re
from typing import Any

# the GPU tests each executor runs, by what they cover (files, or node ids outside those files)
EXECUTOR_TESTS = {
    "merges": ("tests/test_merge.py", "tests/test_merge_options.py", "tests/test_fp8.py"),
    "empty-row ops": ("tests/test_empty_rows.py", "tests/test_lying_offsets.py"),
    "adapters": ("tests/test_compat.py", "tests/test_flashinfer_adapter.py", "tests/test_torch_ops.py"),
    "CUDA-graph capture": (
        "tests/test_precompile.py::test_precompile_then_cuda_graph_capture_compiles_nothing",
        "tests/test_cp_merge.py::test_a2a_kernels_in_a_cuda_graph",
    ),
}


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?|rerun)\b")
_OUTCOME = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
_ONE = re.compile(rf"^(\S+::.*?) ({_OUTCOME})\b")  # -v, one process: "tests/x.py::t[a b] PASSED [ 5%]"
_XDIST = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_OUTCOME}) (\S+::.*?)\s*$")  # -v, pytest-xdist


def pytest_summary(output: str) -> dict[str, Any]:
    """The final summary line of a pytest run and its counts."""
    for line in reversed(output.strip().splitlines()):
        text = line.strip().strip("=").strip()
        if re.search(r"\bin \d+(\.\d+)?s\b", text) and (_COUNT.search(text) or "no tests ran" in text):
            counts = {}
            for n, word in _COUNT.findall(text):
                word = {"error": "errors", "warning": "warnings"}.get(word, word)
                counts[word] = int(n)
            return {"line": text, **counts}
    return {"line": None}


def pytest_outcomes(output: str) -> dict[str, str]:
    """Node id -> outcome from ``-v``'s lines (the last one of a test: a teardown error wins):
    which tests ran, also in a run killed before its summary."""
    got = {}
    for line in output.splitlines():
        if m := _ONE.match(line):
            got[m.group(1)] = m.group(2)
        elif m := _XDIST.match(line):
            got[m.group(2)] = m.group(1)
    return got


def pytest_failures(output: str, keep: int = 60) -> list[str]:
    """The ``FAILED``/``ERROR`` lines of ``-rfE``'s short summary."""
    return [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))][:keep]


def collected(output: str) -> dict[str, Any]:
    """``--collect-only -q``: the node ids and the count line."""
    ids = [
        line.strip()
        for line in output.splitlines()
        if "::" in line and not line.startswith(("ERROR", "FAILED"))
    ]
    m = re.search(r"(\d+)(?:/(\d+))? tests? collected", output)
    return {"count": int(m.group(1)) if m else len(ids), "ids": ids}


def memcheck_lines(output: str) -> dict[str, Any]:
    """``ERROR SUMMARY`` lines of compute-sanitizer and the calls line of sanitize_ops.py."""
    summaries = [line.strip("= ").strip() for line in output.splitlines() if "ERROR SUMMARY" in line]
    calls = [line.strip() for line in output.splitlines() if line.startswith("sanitize_ops:")]
    raised = [line.strip() for line in output.splitlines() if line.strip().startswith("raised:")]
    return {"error_summary": summaries, "calls": calls[-1] if calls else None, "raised": raised[:40]}


def selects(target: str, node: str) -> bool:
    """Whether a pytest argument (a file or a node id) selects the test ``node``."""
    return node == target or node.startswith((target + "::", target + "["))


def executor_selection(ids: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The arguments that select each group's tests, kept where the collection has them."""
    args, groups = [], {}
    for group, targets in EXECUTOR_TESTS.items():
        kept = [t for t in targets if any(selects(t, i) for i in ids)]
        args += kept
        groups[group] = {"selected": kept, "missing": [t for t in targets if t not in kept]}
    graph = [i for i in ids if "graph" in i.lower() and any(selects(a, i) for a in args)]
    groups["CUDA-graph capture"]["tests"] = graph
    return args, groups


def from_outcomes(outcomes: dict[str, str], args: list[str], launcher: list[str]) -> dict[str, Any]:
    """An executor's record made from ``pytest -m gpu``'s per-test outcomes, where that run's
    executor (ZEROKV_LAUNCHER unset) was this one: the selected tests' outcomes counted."""
    mine = {i: o for i, o in outcomes.items() if any(selects(a, i) for a in args)}
    words = {
        "PASSED": "passed",
        "FAILED": "failed",
        "SKIPPED": "skipped",
        "ERROR": "errors",
        "XFAIL": "xfailed",
        "XPASS": "xpassed",
    }
    counts = {w: sum(o == k for o in mine.values()) for k, w in words.items()}
    line = (
        ", ".join(f"{n} {w}" for w, n in counts.items() if n) + " (per-test outcomes of the tests part's run)"
    )
    bad = sorted(i for i, o in mine.items() if o in ("FAILED", "ERROR"))
    return {
        "status": "ran",
        "from": f"the tests part's pytest -m gpu, whose executor was {launcher[0]} ({launcher[1]})",
        "rc": 1 if bad else 0,
        "summary": {"line": line, **{w: n for w, n in counts.items() if n}},
        "failures": bad[:60],
    }
