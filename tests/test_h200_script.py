"""bench/h200.py, the one command of a GPU run, on the CPU: its CPU mode end to end (every part
that runs without a GPU, the GPU parts marked as not run), the readers of pytest's and
compute-sanitizer's output on hand-written outputs, the comparison with the last runs and the
goals on tables whose verdicts are known, and its steps failing soft."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import h200, h200_bench, h200_run, h200_tests
from bench import h200_history as history
from bench import h200_outputs as outputs
from bench import h200_results as results

REPO = Path(__file__).resolve().parent.parent


# --- the CPU mode, end to end -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One ``python -m bench.h200 --cpu`` (one round of the host tables: the CPU mode checks the
    pipeline, not figures)."""
    out = tmp_path_factory.mktemp("h200")
    env = {k: v for k, v in os.environ.items() if k != "ZEROKV_LAUNCHER"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.h200", "--cpu", "--out", str(out), "--rounds", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads((out / "parts.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    return out, parts, summary, proc.stdout


def test_cpu_mode_writes_its_files_and_marks_the_gpu_parts_not_run(cpu_run):
    out, parts, summary, stdout = cpu_run
    assert parts["mode"] == "cpu" and summary["mode"] == "cpu"
    status = {name: p["status"] for name, p in parts["parts"].items()}
    assert status == {
        "env": "ran",
        "bench": "ran",
        "host": "ran",
        "sanitizer": "not run: no GPU",
        "tests": "ran",
        "executors": "ran",
    }
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    bench_files = [w for w in written if w.startswith("bench/")]
    assert {"summary.json", "parts.json", "h200.log"} <= set(written)
    assert len(written) <= 8  # what one GPU run may bring back
    assert {Path(w).suffix for w in bench_files} >= {".json", ".md"}
    host_bench = parts["parts"]["host"]["bench_host"]["files"]
    assert [Path(f).suffix for f in host_bench] == [".json"]
    assert sorted(parts["parts"]["bench"]["files"] + host_bench) == bench_files
    by_name = {c["name"]: c for c in summary["checks"]}
    assert len(by_name) == len(summary["checks"])
    for name in ("pytest -m gpu", "memcheck, ZEROKV_LAUNCHER=c", "memcheck, ZEROKV_LAUNCHER=python"):
        assert by_name[name]["status"].startswith("not run: no GPU") and by_name[name]["pass"] is None
    for c in summary["checks"]:
        assert c["pass"] is None, c  # nothing is judged on CPU figures
        assert c["status"].startswith(("not run", "not judged", "information")), c
    assert summary["verdict"].startswith("nothing judged")
    assert summary["next"] is None  # every part ran or cannot run here
    log = (out / "h200.log").read_text()
    for step in (
        "bench.profile_call",
        "bench.compiled_op --time",
        "-m pytest -v -rfE",
        "-m bench --dry-run --only merge,options",
        "-m bench --dry-run --only host",
    ):
        assert step in log, step
    assert "h200: nothing judged" in stdout


def test_cpu_mode_runs_the_gpu_tests_collected_and_skipped(cpu_run):
    _, parts, _, _ = cpu_run
    tests = parts["parts"]["tests"]
    run = tests["pytest"]
    assert run["rc"] == 0
    summary = run["summary"]
    # the summary line and the per-test lines are two records of one run: they agree
    assert summary["skipped"] == run["outcomes"]["SKIPPED"] == tests["tests_seen"] > 1000
    assert "passed" not in summary and "failed" not in summary
    assert "--deselect " + h200_tests.MEMCHECK_TEST in run["cmd"]
    assert summary["deselected"] >= 1


def test_cpu_mode_runs_each_executors_selection(cpu_run):
    _, parts, _, _ = cpu_run
    ex = parts["parts"]["executors"]
    env = parts["parts"]["env"]
    for group, got in ex["groups"].items():
        assert got["missing"] == [], group
    graph = ex["groups"]["CUDA-graph capture"]["tests"]
    assert "tests/test_merge.py::test_cuda_graph_capture_and_replay" in graph
    assert any(t.startswith("tests/test_empty_rows.py::test_cuda_graph_capture_and_replay") for t in graph)
    default = env["python"]["launcher"][0]
    records = ex["executors"]
    assert set(records) == {"c", "python"}
    for name, rec in records.items():
        assert rec["rc"] == 0, rec
        if name == default:  # counted from pytest -m gpu's lines
            assert "from" in rec and "cmd" not in rec
        else:  # its own pytest process, ZEROKV_LAUNCHER set
            assert rec["env"]["ZEROKV_LAUNCHER"] == name and "tests/test_merge.py" in rec["cmd"]
    # two pytest processes, or one process's lines counted: the same selection skipped
    skipped = {name: rec["summary"]["skipped"] for name, rec in records.items()}
    assert skipped["c"] == skipped["python"] > 1000
    assert skipped["c"] < parts["parts"]["tests"]["tests_seen"]


def test_cpu_mode_host_tables_and_their_checks(cpu_run):
    _, parts, summary, _ = cpu_run
    host = parts["parts"]["host"]
    table = host["profile_call"]["table"]
    assert table["cpu"] is True
    rows = {r["step"]: r for r in table["rows"]}
    mul = rows["torch.mul(out=)"]["us"]
    assert rows["torch.mul(out=)"]["x_mul"] == 1.0
    for r in rows.values():
        assert r["x_mul"] == pytest.approx(r["us"] / mul) and r["us"] > 0
    checks = {c["name"]: c for c in summary["checks"]}
    executors = parts["parts"]["env"]["launchers"]
    if executors["c"].startswith("('c'"):  # the compiled executor builds here: its rows exist
        got = checks["host, C executor: merge_state, new T"]
        assert got["value"] == rows["public call, new T, C executor"]["x_mul"]
        assert got["status"].startswith("not judged: CPU figures")
        options = checks["host, C executor: every option, layout and adapter"]["value"]["options"]
        assert options["a_empty"] == rows["a_empty, C executor"]["x_mul"]
        assert "public call" not in options and "merge_states (N = 3)" not in options
    beside = host["beside"]["table"]
    assert beside["notes"] == {
        "vLLM-design compiled op": "not run: no GPU",
        "launch floor": "not run: no GPU",
    }
    assert [r["step"] for r in beside["rows"]][0] == "torch.mul(out=)"
    assert host["vllm_op_build"]["status"].startswith("not run: no GPU")


def test_cpu_mode_bench_is_the_dry_run_against_the_history(cpu_run):
    _, parts, summary, _ = cpu_run
    bench = parts["parts"]["bench"]
    assert bench["rc"] == 0 and bench["environment"]["args"]["dry_run"] is True
    comp = bench["comparison"]
    assert comp["grid"]["last_run"].startswith("bench/h200/zerokv-bench-")
    assert comp["options"]["last_run"].startswith("bench/h200/zerokv-bench-")
    checks = {c["name"]: c for c in summary["checks"]}
    assert checks["bench: grid"]["status"] == "not judged: dry run (synthetic times)"


# --- reading pytest's and compute-sanitizer's output ---------------------------------------------

ONE_PROCESS = """\
tests/test_a.py::test_ok[a b] PASSED                                           [ 20%]
tests/test_a.py::test_ok[c] PASSED                                             [ 40%]
tests/test_a.py::test_fail FAILED                                              [ 60%]
tests/test_a.py::test_skip SKIPPED (no)                                        [ 80%]
tests/test_a.py::test_err PASSED                                               [100%]
tests/test_a.py::test_err ERROR                                                [100%]
=========================== short test summary info ============================
FAILED tests/test_a.py::test_fail - assert 0
ERROR tests/test_a.py::test_err - RuntimeError: teardown
=============== 1 failed, 3 passed, 1 skipped, 1 error in 0.02s ================
"""

XDIST = """\
2 workers [5 items]
tests/test_a.py::test_ok[a b] \n\
tests/test_a.py::test_fail \n\
[gw0] [ 20%] PASSED tests/test_a.py::test_ok[a b] \n\
[gw0] [ 40%] PASSED tests/test_a.py::test_ok[c] \n\
[gw0] [ 60%] PASSED tests/test_a.py::test_err \n\
[gw1] [ 80%] FAILED tests/test_a.py::test_fail \n\
[gw1] [100%] SKIPPED tests/test_a.py::test_skip \n\
[gw0] [100%] ERROR tests/test_a.py::test_err \n\
"""

WANT = {
    "tests/test_a.py::test_ok[a b]": "PASSED",
    "tests/test_a.py::test_ok[c]": "PASSED",
    "tests/test_a.py::test_fail": "FAILED",
    "tests/test_a.py::test_skip": "SKIPPED",
    "tests/test_a.py::test_err": "ERROR",  # passed, then its teardown failed
}


@pytest.mark.parametrize("output", [ONE_PROCESS, XDIST], ids=["one process", "xdist"])
def test_per_test_outcomes_of_verbose_output(output):
    assert outputs.pytest_outcomes(output) == WANT


@pytest.mark.parametrize(
    "line, want",
    [
        ("=== 1 failed, 2039 passed, 2 skipped, 2783 deselected, 3 warnings in 312.45s (0:05:12) ===",
         {"failed": 1, "passed": 2039, "skipped": 2, "deselected": 2783, "warnings": 3}),
        ("2041 skipped, 2783 deselected in 3.41s", {"skipped": 2041, "deselected": 2783}),
        ("====== 1 error in 0.50s ======", {"errors": 1}),
        ("=== no tests ran in 0.01s ===", {}),
    ],
)  # fmt: skip
def test_the_summary_line_and_its_counts(line, want):
    got = outputs.pytest_summary(f"some output\n{line}\n\n")
    assert got == {"line": line.strip("= "), **want}


def test_a_killed_run_has_no_summary_line():
    assert outputs.pytest_summary(XDIST) == {"line": None}
    assert outputs.pytest_failures(ONE_PROCESS) == [
        "FAILED tests/test_a.py::test_fail - assert 0",
        "ERROR tests/test_a.py::test_err - RuntimeError: teardown",
    ]


def test_memcheck_lines():
    output = (
        "========= COMPUTE-SANITIZER\n"
        "Traceback (most recent call last):\n"
        "sanitize_ops: 812 calls, 1 raised\n"
        "  raised: merge_state out x: ValueError: v_a\n"
        "========= Invalid __global__ read of size 4 bytes\n"
        "========= ERROR SUMMARY: 3 errors\n"
    )
    assert outputs.memcheck_lines(output) == {
        "error_summary": ["ERROR SUMMARY: 3 errors"],
        "calls": "sanitize_ops: 812 calls, 1 raised",
        "raised": ["raised: merge_state out x: ValueError: v_a"],
    }


def test_an_executors_record_from_the_whole_runs_outcomes():
    outcomes = {**WANT, "tests/test_b.py::test_x[1]": "PASSED", "tests/test_c.py::test_y": "FAILED"}
    rec = outputs.from_outcomes(outcomes, ["tests/test_a.py", "tests/test_b.py::test_x"], ["c", "compiled"])
    assert rec["summary"] == {
        "line": "3 passed, 1 failed, 1 skipped, 1 errors (per-test outcomes of the tests part's run)",
        "passed": 3,
        "failed": 1,
        "skipped": 1,
        "errors": 1,
    }
    assert rec["rc"] == 1 and rec["failures"] == ["tests/test_a.py::test_err", "tests/test_a.py::test_fail"]


# --- the bench against the last runs ------------------------------------------------------------


def _row(op, impl, us, spread=0.0, T=256, H=128, D=128, dtype="bf16", **params):
    return {"op": op, "impl": impl, "dtype": dtype, "T": T, "H": H, "D": D, "us": us, "params": params,
            "stats": {"replay_spread_us": [us - spread / 2, us + spread / 2]}}  # fmt: skip


def test_grid_ratio_is_zerokv_over_the_best_baseline_of_the_shape():
    rows = [
        _row("merge_state", "zerokv", 9.0, spread=0.09, layout="TH"),
        _row("merge_state", "zerokv", 9.9, layout="HT"),
        _row("merge_state", "vLLM-design CUDA", 10.0, spread=0.2, layout="HT"),
        _row("merge_state", "Triton", 12.0, layout="TH"),
        _row("merge_state", "zerokv", 5.0, T=1, layout="TH"),  # no baseline: no ratio
    ]
    got = history.grid_ratios(rows)
    assert set(got) == {("bf16", 256, 128, 128, "TH"), ("bf16", 256, 128, 128, "HT")}
    assert got[("bf16", 256, 128, 128, "TH")] == pytest.approx((0.9, 0.01 + 0.02))
    assert got[("bf16", 256, 128, 128, "HT")] == pytest.approx((0.99, 0.02))


def test_option_ratio_is_over_the_plain_merge_of_the_same_T_and_layout():
    rows = [
        _row("merge_options", "zerokv", 10.0, option="none", layout="TH"),
        _row("merge_options", "zerokv", 12.0, option="a_empty", empty=0.25, layout="TH"),
        _row("merge_options", "zerokv", 20.0, option="none", layout="HT"),
        _row("merge_options", "zerokv", 21.0, spread=2.1, option="a_empty", empty=0.25, layout="HT"),
        _row("merge_options", "zerokv fixup + merge", 30.0, option="a_empty", empty=0.25, layout="TH"),
        _row("merge_options", "zerokv", 8.0, T=512, option="sinks", layout="TH"),  # no plain row
    ]
    got = history.option_ratios(rows)
    assert got == {
        (256, "TH", "a_empty", 0.25, None, None, None): pytest.approx((1.2, 0.0)),
        (256, "HT", "a_empty", 0.25, None, None, None): pytest.approx((1.05, 0.1)),
    }


def test_compare_counts_a_change_only_beyond_the_noise():
    last = {"a": (1.00, 0.01), "b": (1.00, 0.0), "c": (1.10, 0.0), "d": (0.95, 0.05), "old": (0.5, 0.0)}
    new = {"a": (1.05, 0.01), "b": (1.015, 0.0), "c": (1.00, 0.0), "d": (1.03, 0.05), "new": (2.0, 0.0)}
    got = history.compare(new, last, floor=0.02)
    assert got["common"] == 4 and got["only_new"] == 1
    # a: +0.05 beyond max(0.02, 0.02); b: +0.015 within the floor; c: faster; d: +0.08 within 0.1
    assert [b["key"] for b in got["beyond_noise"]] == [["a"]]
    assert got["beyond_noise"][0]["noise"] == pytest.approx(0.02)
    assert got["worst_new"] == {"key": ["a"], "ratio": 1.05}
    assert got["worst_last"] == {"key": ["c"], "ratio": 1.10}
    assert got["max_diff"] == pytest.approx(0.08) and got["min_diff"] == pytest.approx(-0.10)
    assert history.compare({"x": (1.0, 0.0)}, last, 0.02)["common"] == 0


def test_the_last_runs_are_found_in_the_history():
    path, rows = history.last_run_with(REPO / "bench" / "h200", "merge_options")
    assert path is not None and any(r["op"] == "merge_options" for r in rows)
    newer = [p for p in (REPO / "bench" / "h200").glob("zerokv-bench-*.json") if p.name > path.name]
    for p in newer:  # none newer holds option rows
        assert all(r.get("op") != "merge_options" for r in json.loads(p.read_text())["rows"])


# --- the goals ----------------------------------------------------------------------------------


def _host(rows, beside=None, cpu=False):
    table = {"cpu": cpu, "rows": [{"step": k, "x_mul": v, "us": v} for k, v in rows.items()]}
    part = {"status": "ran", "profile_call": {"status": "ran", "table": table}}
    part["beside"] = {"status": "ran", "table": {"rows": [{"step": k, "x_mul": v} for k, v in (beside or {}).items()], "notes": {}}}  # fmt: skip
    return part


def test_host_goals_on_a_table_whose_verdicts_are_known():
    c = ", C executor"
    rows = {
        "torch.mul(out=)": 1.0,
        f"public call{c}": 0.40,
        f"public call, new T{c}": 0.45,
        f"executor alone{c}": 0.10,
        f"a_empty{c}": 0.45,  # plain + 0.05: met
        f"sinks{c}": 0.46,  # over
        f"[H, T] LSE{c}": 0.41,
        f"allocated outputs{c}": 1.2,  # over 1.0
        f"merge_states (N = 3){c}": 3.0,  # another op: not an option
        f"fixup_zero_kv_rows{c}": 3.0,
    }
    beside = {
        "torch.mul(out=)": 1.0,
        "merge_state, new T, C executor": 0.45,
        "vLLM-design compiled op, new T": 0.4,
    }
    checks = {x["name"]: x for x in results.host_checks(_host(rows, beside))}
    assert checks["host, C executor: merge_state, new T"]["status"] == "pass"
    opt = checks["host, C executor: every option, layout and adapter"]
    assert opt["status"] == "fail" and opt["value"]["over"] == {"sinks": 0.46}
    assert set(opt["value"]["options"]) == {"a_empty", "sinks", "[H, T] LSE"}
    assert checks["host, C executor: allocated outputs"]["status"] == "fail"
    shown = checks["host: vLLM-design compiled op beside merge_state (same process)"]
    assert shown["status"] == "pass" and shown["value"]["vllm_op_new_t"] == 0.4
    python = checks["host, Python executor: merge_state, new T"]
    assert python["pass"] is None and python["status"] == "information: the Python executor"


def test_host_goals_fail_without_the_c_executors_rows():
    rows = {"torch.mul(out=)": 1.0, "public call, new T, Python executor": 0.9}
    checks = {x["name"]: x for x in results.host_checks(_host(rows))}
    got = checks["host, C executor: merge_state, new T"]
    assert got["status"] == "fail: no 'public call, new T, C executor' row" and got["pass"] is False
    assert checks["host: vLLM-design compiled op beside merge_state (same process)"]["pass"] is False


def test_host_goals_on_cpu_figures_are_not_judged():
    rows = {"torch.mul(out=)": 1.0, "public call, C executor": 0.1, "public call, new T, C executor": 0.1}
    checks = results.host_checks(_host(rows, cpu=True))
    assert all(x["pass"] is None and x["status"].startswith("not judged") for x in checks)


def _gpu_parts(memcheck_summary="ERROR SUMMARY: 0 errors", failed=0):
    line = f"{failed} failed, 2000 passed in 300.0s" if failed else "2000 passed in 300.0s"
    pytest_rec = {"status": "ran", "rc": 1 if failed else 0, "summary": outputs.pytest_summary(line)}
    return {
        "tests": {"status": "ran", "pytest": pytest_rec},
        "sanitizer": {
            "status": "ran",
            "executors": {
                n: {"status": "ran", "rc": 0, "error_summary": [memcheck_summary], "calls": "x"}
                for n in ("c", "python")
            },
        },
        "executors": {"status": "ran", "executors": {n: pytest_rec for n in ("c", "python")}},
    }


def test_gpu_test_and_memcheck_goals():
    checks = {c["name"]: c for c in results.evaluate(_gpu_parts())}
    for name in ("pytest -m gpu", "memcheck, ZEROKV_LAUNCHER=c", "executor python: merges, empty-row ops, adapters, CUDA graphs"):  # fmt: skip
        assert checks[name]["status"] == "pass", checks[name]
    checks = {c["name"]: c for c in results.evaluate(_gpu_parts("ERROR SUMMARY: 2 errors", failed=1))}
    assert checks["pytest -m gpu"]["status"] == "fail"
    assert checks["memcheck, ZEROKV_LAUNCHER=c"]["status"] == "fail"
    assert checks["executor c: merges, empty-row ops, adapters, CUDA graphs"]["status"] == "fail"
    assert checks["bench: grid"]["status"] == "not run: part not selected"
    assert results.verdict(list(checks.values())).startswith("5 of ")


def test_a_pytest_run_killed_at_its_limit():
    killed = {"status": "timed out after 500 s", "rc": -9, "summary": {"line": None}}
    parts = {"tests": {"status": "ran", "pytest": {**killed, "outcomes": {"PASSED": 900, "SKIPPED": 3}}}}
    check = results.evaluate(parts)[0]
    assert check["status"].startswith("not finished: timed out after 500 s") and check["pass"] is None
    parts["tests"]["pytest"]["outcomes"]["FAILED"] = 2
    check = results.evaluate(parts)[0]
    assert check["status"] == "fail: timed out after 500 s, 2 failed by then" and check["pass"] is False
    assert results.leftover(parts) == ["bench", "host", "sanitizer", "tests", "executors"]


def test_assemble_keeps_the_part_that_ran(tmp_path):
    first, second = tmp_path / "one", tmp_path / "two"
    for d, parts in (
        (first, {"env": {"status": "ran"}, "host": {"status": "ran", "x": 1}, "tests": {"status": "not run: out of time (570 s budget spent)"}}),
        (second, {"env": {"status": "ran"}, "tests": {"status": "ran", "y": 2}, "host": {"status": "failed: boom"}}),
    ):  # fmt: skip
        d.mkdir()
        (d / "parts.json").write_text(json.dumps({"date": "d", "parts": parts}))
    got = results.assemble([first, second])["parts"]
    assert got["host"]["x"] == 1 and got["host"]["from"] == str(first)
    assert got["tests"]["y"] == 2 and got["tests"]["from"] == str(second)
    assert got["env"]["from"] == str(second)
    assert results.leftover(got) == ["bench", "sanitizer", "executors"]
    got["host"]["beside"] = {"status": "timed out after 150 s"}
    assert "host" in results.leftover(got)


def test_assemble_command_writes_one_summary(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "parts.json").write_text(json.dumps({"date": "d", "parts": _gpu_parts()}))
    out = tmp_path / "all"
    assert h200.main(["--assemble", str(run_dir), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {c["name"]: c["status"] for c in summary["checks"]}["pytest -m gpu"] == "pass"
    assert summary["next"] == "python -m bench.h200 --out DIR --part bench,host"


# --- steps fail soft ----------------------------------------------------------------------------


def _run(tmp_path, budget=60.0, cpu=False):
    return h200_run.Run(out=tmp_path, work=tmp_path, cpu=cpu, budget_s=budget, parts=list(results.PARTS))


def test_a_missing_program_is_recorded(tmp_path):
    rec, output = h200_run.command(_run(tmp_path), "x", [str(tmp_path / "no-such-program")], "probe")
    assert rec["status"].startswith("failed: FileNotFoundError") and output == ""


def test_a_step_past_its_cap_is_killed_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setitem(h200_run.CAPS, "probe", 2)
    monkeypatch.setattr(h200_run, "MIN_STEP_S", 1.0)
    pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)"
    )
    start = time.monotonic()
    rec, output = h200_run.command(_run(tmp_path), "sleeper", [sys.executable, "-c", code], "probe")
    assert time.monotonic() - start < 30
    assert rec["status"] == "timed out after 2 s" and "started" in output
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild went with its process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail("the step's child process outlived it")


def test_a_step_that_no_longer_fits_is_not_started(tmp_path):
    rec, _ = h200_run.command(_run(tmp_path, budget=5.0), "late", [sys.executable, "-c", "pass"], "probe")
    assert rec["status"] == "not run: out of time (5 s budget spent)"
    assert results.leftover({"host": {"status": "ran", "profile_call": rec}}) == [
        "bench", "host", "sanitizer", "tests", "executors",
    ]  # fmt: skip


def test_the_sanitizer_part_reads_each_executors_error_summary(tmp_path, monkeypatch):
    """The GPU path of the sanitizer part with a stand-in for compute-sanitizer on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "compute-sanitizer"
    tool.write_text(
        "#!/bin/sh\n"
        'echo "========= COMPUTE-SANITIZER"\n'
        'echo "sanitize_ops: 7 calls, 0 raised"\n'
        'echo "launcher=$ZEROKV_LAUNCHER caching=$PYTORCH_NO_CUDA_MEMORY_CACHING args=$*"\n'
        'echo "========= ERROR SUMMARY: 0 errors"\n'
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = _run(tmp_path)
    rec = h200_tests.part_sanitizer(run)
    assert rec["tool"] == str(tool)
    for name in ("c", "python"):
        step = rec["executors"][name]
        assert (
            step["error_summary"] == ["ERROR SUMMARY: 0 errors"]
            and step["calls"] == "sanitize_ops: 7 calls, 0 raised"
        )
        assert f"launcher={name} caching=1 args=--tool memcheck --error-exitcode 1" in "\n".join(step["tail"])
        assert step["tail"][-2].endswith("tests/sanitize_ops.py")
    checks = {c["name"]: c for c in results.evaluate({"sanitizer": rec})}
    assert checks["memcheck, ZEROKV_LAUNCHER=python"]["status"] == "pass"


def test_the_background_build_is_waited_for_and_read(tmp_path):
    run = _run(tmp_path, budget=300.0)
    result = tmp_path / "op.json"
    code = f"import json, time; time.sleep(0.5); json.dump({{'library': '/x/op.so', 'build_s': 0.5}}, open({str(result)!r}, 'w'))"  # fmt: skip
    (tmp_path / "vllm-op.log").write_text("building\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    run.background["build"] = {"proc": proc, "argv": ["build"], "result": result, "start": time.monotonic()}
    rec = h200_bench.wait_op_build(run)
    assert rec["status"] == "ran" and rec["rc"] == 0
    assert rec["library"] == "/x/op.so" and rec["tail"] == ["building"]


def test_pytest_runs_in_workers_only_on_a_gpu(tmp_path):
    run = _run(tmp_path)
    run.workers = 6
    assert h200_tests._pytest_argv(run, ["-m", "gpu"])[-2:] == ["-n", "6"]
    run.cpu = True
    assert "-n" not in h200_tests._pytest_argv(run, ["-m", "gpu"])
