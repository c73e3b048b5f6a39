"""What a GPU run's outputs say, and whether zerokv's release goals are met: pytest's and
compute-sanitizer's lines read, the GPU tests each executor runs, the quick bench against the
last runs kept in ``bench/h200/``, and each goal judged with its value (``bench/h200.py`` runs
the commands and writes the files)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("env", "bench", "host", "sanitizer", "tests", "executors")
EXECUTORS = ("c", "python")
EXECUTOR_LABEL = {"c": "C executor", "python": "Python executor"}
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
# goals, x torch.mul(out=) of the same process
NEW_T_GOAL, OPTION_MARGIN, ALLOCATED_GOAL = 0.5, 0.05, 1.0
# profile_call's rows that are not an option, layout or adapter of the plain call, and the other ops
NOT_OPTIONS = ("public call", "public call, new T", "executor alone", "allocated outputs")
OTHER_OPS = ("merge_states", "fixup_zero_kv_rows", "mask_empty_context")


# --- parsing ----------------------------------------------------------------------------------

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


# --- the bench against the last runs ------------------------------------------------------------


def _rows(raw: list[dict]) -> list[Any]:
    from .common import Row

    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in r.items() if k in fields}) for r in raw]


def _spread(row: Any) -> float:
    """The relative spread of a row's interleaved replays."""
    lo_hi = (row.stats or {}).get("replay_spread_us")
    if not lo_hi or not row.us:
        return 0.0
    try:
        return (float(lo_hi[1]) - float(lo_hi[0])) / float(row.us)
    except (TypeError, ValueError, IndexError):
        return 0.0


def grid_ratios(raw: list[dict]) -> dict[tuple, tuple[float, float]]:
    """(dtype, T, H, D, layout) -> (zerokv / best baseline, spread of that ratio)."""
    from .report import merge_lines

    out = {}
    for x in merge_lines(_rows([r for r in raw if r.get("op") == "merge_state"])):
        if x["ratio"] is not None:
            out[(*x["key"], x["layout"])] = (x["ratio"], _spread(x["zerokv"]) + _spread(x["best"]))
    return out


def option_ratios(raw: list[dict]) -> dict[tuple, tuple[float, float]]:
    """(T, layout, option, empty, requests, offsets, scale_format) -> (zerokv option / zerokv plain
    merge of the same T and layout, spread of that ratio)."""
    rows = [r for r in _rows(raw) if r.op == "merge_options" and r.impl == "zerokv" and r.us]
    plain = {(r.T, r.params.get("layout")): r for r in rows if r.params.get("option") == "none"}
    out = {}
    for r in rows:
        p = r.params
        base = plain.get((r.T, p.get("layout")))
        if p.get("option") == "none" or base is None:
            continue
        key = (
            r.T,
            p.get("layout"),
            p.get("option"),
            p.get("empty"),
            p.get("requests"),
            p.get("offsets"),
            p.get("scale_format"),
        )
        out[key] = (r.us / base.us, _spread(r) + _spread(base))
    return out


def compare(
    new: dict[tuple, tuple[float, float]], last: dict[tuple, tuple[float, float]], floor: float
) -> dict[str, Any]:
    """Ratios of the keys both runs have: the worst of each, and the keys whose ratio grew by
    more than the noise (both runs' replay spreads, at least ``floor``)."""
    common = sorted(set(new) & set(last), key=str)
    if not common:
        return {"common": 0, "worst_new": None, "worst_last": None, "beyond_noise": []}
    beyond = []
    for k in common:
        (rn, sn), (rl, sl) = new[k], last[k]
        noise = max(floor, sn + sl)
        if rn - rl > noise:
            beyond.append({"key": list(k), "last": rl, "new": rn, "diff": rn - rl, "noise": noise})
    worst_new = max(common, key=lambda k: new[k][0])
    worst_last = max(common, key=lambda k: last[k][0])
    return {
        "common": len(common),
        "only_new": len(set(new) - set(last)),
        "worst_new": {"key": list(worst_new), "ratio": new[worst_new][0]},
        "worst_last": {"key": list(worst_last), "ratio": last[worst_last][0]},
        "worst_diff": new[worst_new][0] - last[worst_last][0],
        "max_diff": max(new[k][0] - last[k][0] for k in common),
        "min_diff": min(new[k][0] - last[k][0] for k in common),
        "noise_floor": floor,
        "beyond_noise": sorted(beyond, key=lambda b: -b["diff"]),
    }


def last_run_with(history: Path, op: str) -> tuple[Path | None, list[dict]]:
    """The newest bench JSON in ``history`` holding rows of ``op`` (file names carry the date)."""
    for path in sorted(history.glob("zerokv-bench-*.json"), reverse=True):
        try:
            rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError):
            continue
        if any(r.get("op") == op for r in rows):
            return path, rows
    return None, []


def compare_with_history(rows: list[dict], history: Path, floor: float) -> dict[str, Any]:
    out = {}
    for what, op, ratios in (
        ("grid", "merge_state", grid_ratios),
        ("options", "merge_options", option_ratios),
    ):
        path, last = last_run_with(history, op)
        got = compare(ratios(rows), ratios(last), floor) if path else {"common": 0}
        got["last_run"] = (
            path.relative_to(ROOT).as_posix()
            if path and path.is_relative_to(ROOT)
            else (str(path) if path else None)
        )
        out[what] = got
    return out


# --- the goals ----------------------------------------------------------------------------------


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
