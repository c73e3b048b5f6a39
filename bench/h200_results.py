"""Whether a GPU run meets zerokv's release goals: each goal judged on the parts' records with
its value (pass, fail, or why it was not judged), the verdict over all of them, the parts to
run next, and one record assembled from runs of different parts. The commands are run by
``bench/h200.py`` and its part modules; what they print is read by ``h200_outputs``, the bench
against the last runs by ``h200_history``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("env", "bench", "host", "sanitizer", "tests", "executors")
EXECUTORS = ("c", "python")
EXECUTOR_LABEL = {"c": "C executor", "python": "Python executor"}
# goals, x torch.mul(out=) of the same process
NEW_T_GOAL, OPTION_MARGIN, ALLOCATED_GOAL = 0.5, 0.05, 1.0
# profile_call's rows that are not an option, layout or adapter of the plain call, and the other ops
NOT_OPTIONS = ("public call", "public call, new T", "executor alone", "allocated outputs")
OTHER_OPS = ("merge_states", "fixup_zero_kv_rows", "mask_empty_context")


def _check(name: str, goal: str, value: Any, ok: bool, status: str | None = None) -> dict[str, Any]:
    """A goal's record. ``status``: None to judge by ``ok``, else what stands for the verdict
    ("fail: why", "not run: why", "not judged: why", "information: why")."""
    if status is None:
        status = "pass" if ok else "fail"
    verdict = ok if status in ("pass", "fail") else (False if status.startswith("fail") else None)
    return {"name": name, "goal": goal, "value": value, "pass": verdict, "status": status}


def _not_run(part: dict[str, Any] | None, why_cpu: str) -> str | None:
    """Why a part's checks cannot be judged, or None."""
    if part is None:
        return "not run: part not selected"
    status = part.get("status", "")
    if status != "ran":
        return status if status.startswith(("not run", "failed")) else f"not run: {status}"
    if part.get("cpu") or part.get("dry"):
        return why_cpu
    return None


def _executor_checks(x: dict[str, float], ex: str, judge: str | None) -> list[dict[str, Any]]:
    """One executor's rows of profile_call (``x``: step -> x torch.mul) against the goals;
    ``judge``: None to judge, else the status that stands for the verdicts."""
    name = EXECUTOR_LABEL[ex]
    suffix = f", {name}"
    plain, new_t, alloc = (
        x.get(f"{s}{suffix}") for s in ("public call", "public call, new T", "allocated outputs")
    )
    options = {
        k[: -len(suffix)]: v
        for k, v in x.items()
        if k.endswith(suffix) and k[: -len(suffix)] not in NOT_OPTIONS and not k.startswith(OTHER_OPS)
    }
    over = {k: v for k, v in options.items() if plain is not None and v > plain + OPTION_MARGIN}
    worst = max(options, key=options.get) if options else None
    both = plain is not None and options
    option_value = {"plain": plain, "worst": worst, "over": over, "options": options} if both else None

    def one(title: str, goal: str, value: Any, ok: bool, row: str) -> dict[str, Any]:
        status = judge if value is not None else (judge or f"fail: no '{row}{suffix}' row")
        return _check(f"host, {name}: {title}", goal, value, ok, status)

    return [
        one("merge_state, new T", f"<= {NEW_T_GOAL} x torch.mul(out=)", new_t,
            new_t is not None and new_t <= NEW_T_GOAL, "public call, new T"),
        one("every option, layout and adapter", f"<= plain + {OPTION_MARGIN} x", option_value,
            option_value is not None and not over, "public call"),
        one("allocated outputs", f"<= {ALLOCATED_GOAL} x torch.mul(out=)", alloc,
            alloc is not None and alloc <= ALLOCATED_GOAL, "allocated outputs"),
    ]  # fmt: skip


def host_rows(part: dict[str, Any] | None, which: str) -> dict[str, float]:
    table = ((part or {}).get(which) or {}).get("table") or {}
    return {r["step"]: r["x_mul"] for r in table.get("rows", [])}


def host_checks(part: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The host table's goals, judged on the C executor's rows (the Python executor's beside
    them, for information), and the compiled op beside ``merge_state``."""
    cpu = (part or {}).get("profile_call", {}).get("table", {}).get("cpu")
    if part is not None and part.get("status") == "ran" and cpu:
        part = {**part, "cpu": True}
    why = _not_run(part, "not judged: CPU figures (CPU tensors, launches counted)")
    x = host_rows(part, "profile_call")
    out = []
    for ex in EXECUTORS:
        out += _executor_checks(x, ex, why if ex == "c" else (why or "information: the Python executor"))
    beside = host_rows(part, "beside")
    op = beside.get("vLLM-design compiled op, new T")
    ours = beside.get("merge_state, new T, C executor")
    notes = ((part or {}).get("beside", {}).get("table") or {}).get("notes", {})
    value = {
        "vllm_op_new_t": op,
        "merge_state_new_t_c": ours,
        "vllm_op_same_tensors": beside.get("vLLM-design compiled op"),
        "floor_new_t": beside.get("launch floor (no check), new T"),
        "notes": notes,
    }
    status = why or (None if op is not None else f"fail: {notes.get('vLLM-design compiled op', 'no row')}")
    out.append(
        _check(
            "host: vLLM-design compiled op beside merge_state (same process)",
            "shown",
            value,
            op is not None,
            status,
        )
    )
    return out


def evaluate(parts: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal: its value, and pass / fail / why it was not judged."""
    out = []
    tests = parts.get("tests")
    why = _not_run(tests, "not run: no GPU (collected and skipped only)")
    out.append(_pytest_check("pytest -m gpu", (tests or {}).get("pytest", {}), why))

    san = parts.get("sanitizer")
    why = _not_run(san, "not run: no GPU")
    for name in EXECUTORS:
        step = (san or {}).get("executors", {}).get(name, {})
        lines = step.get("error_summary") or []
        ok = bool(lines) and all(line == "ERROR SUMMARY: 0 errors" for line in lines) and step.get("rc") == 0
        value = (
            {"error_summary": lines, "calls": step.get("calls"), "raised": step.get("raised")}
            if step
            else None
        )
        out.append(
            _check(
                f"memcheck, ZEROKV_LAUNCHER={name}",
                "ERROR SUMMARY: 0 errors, no call raised",
                value,
                ok,
                why or (None if step.get("status") == "ran" else step.get("status", "not run")),
            )
        )

    ex = parts.get("executors")
    why = _not_run(ex, "not run: no GPU (collected and skipped only)")
    for name in EXECUTORS:
        step = (ex or {}).get("executors", {}).get(name, {})
        title = f"executor {name}: merges, empty-row ops, adapters, CUDA graphs"
        out.append(_pytest_check(title, step, why))

    out += host_checks(parts.get("host"))

    bench = parts.get("bench")
    why = _not_run(bench, "not judged: dry run (synthetic times)")
    comp = (bench or {}).get("comparison", {})
    for what, goal in (
        ("grid", "worst ratio to the best baseline within the noise of the last run"),
        ("options", "each option's ratio to the plain merge within the noise of the last run"),
    ):
        c = comp.get(what, {})
        value = {
            k: c.get(k)
            for k in (
                "last_run",
                "common",
                "worst_new",
                "worst_last",
                "worst_diff",
                "max_diff",
                "noise_floor",
            )
        }
        value["beyond_noise"] = (c.get("beyond_noise") or [])[:10]
        status = why or (None if c.get("common") else "fail: no shape in common with the last run")
        out.append(
            _check(f"bench: {what}", goal, value, bool(c.get("common")) and not c.get("beyond_noise"), status)
        )
    return out


def _pytest_check(name: str, step: dict[str, Any], why: str | None) -> dict[str, Any]:
    """A pytest run's goal: it finished with tests passed and none failed or in error. A run
    killed at its time limit fails if it had failed a test by then, else is not finished."""
    s = step.get("summary", {})
    ok = step.get("rc") == 0 and not s.get("failed") and not s.get("errors") and s.get("passed", 0) > 0
    status = why or (None if step.get("status", "not run") == "ran" else step.get("status", "not run"))
    if status and status.startswith("timed out"):
        done = step.get("outcomes", {})
        bad = done.get("FAILED", 0) + done.get("ERROR", 0)
        status = f"fail: {status}, {bad} failed by then" if bad else f"not finished: {status} ({done})"
    return _check(name, "no failure, no error", s.get("line") or step.get("status"), ok, status)


def verdict(checks: list[dict[str, Any]]) -> str:
    failed = [c["name"] for c in checks if c["status"] == "fail" or c["status"].startswith("fail:")]
    open_ = [
        c["name"] for c in checks if c["pass"] is None and not c["status"].startswith(("fail", "information"))
    ]
    judged = [c for c in checks if c["pass"] is not None]
    if failed:
        return f"{len(failed)} of {len(checks)} goals failing, {len(open_)} not judged"
    if not judged:
        return f"nothing judged: {len(open_)} goals not run or not judged"
    if open_:
        return f"{len(judged)} goals met, {len(open_)} not judged"
    return "every goal met"


def leftover(parts: dict[str, Any]) -> list[str]:
    """Parts (or their steps) that ran out of time or were not selected: the next run's --part."""
    out = []
    for name in PARTS[1:]:
        if name not in parts or any(
            s.startswith(("not run: out of time", "timed out")) for s in _statuses(parts[name])
        ):
            out.append(name)
    return out


def _statuses(x: Any) -> list[str]:
    """Every ``status`` in a part's record, its steps' too."""
    if isinstance(x, list):
        return [s for v in x for s in _statuses(v)]
    if not isinstance(x, dict):
        return []
    own = [x["status"]] if isinstance(x.get("status"), str) else []
    return own + [s for k, v in x.items() if k != "status" for s in _statuses(v)]


def clean(x: Any) -> Any:
    """JSON without NaN or Infinity (strings instead), tuples as lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def assemble(dirs: list[Path]) -> dict[str, Any]:
    """One record of several runs' parts: a part that ran wins over one that did not, a later
    directory over an earlier one."""
    record: dict[str, Any] = {"mode": "assembled", "from": [str(d) for d in dirs], "parts": {}}
    for d in dirs:
        got = json.loads((d / "parts.json").read_text())
        record.setdefault("date", got.get("date"))
        for name, part in got["parts"].items():
            old = record["parts"].get(name)
            if old is None or part.get("status") == "ran" or old.get("status") != "ran":
                record["parts"][name] = {**part, "from": str(d)}
    return record
