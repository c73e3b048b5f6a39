"""Everything a GPU run of zerokv reports, in one command, as JSON: the GPU tests, the memory
checker over every op, both executors, the host table beside a compiled torch op, the
kernels' quick bench against the last figures, and a summary that judges the release goals.

    python -m bench.h200 --out DIR                     # every part, within --budget-s seconds
    python -m bench.h200 --out DIR --part tests        # some parts (the others in another run)
    python -m bench.h200 --cpu --out DIR               # what runs without a GPU
    python -m bench.h200 --assemble DIR1 DIR2 --out DIR   # one summary of runs of different parts

Parts, in the order they run (``env`` always runs):

* env: Python, torch, the GPU, the tools (nvcc, compute-sanitizer, ncu, ninja), which executor
  each ``ZEROKV_LAUNCHER`` loads, a fingerprint of the sources.
* bench: ``python -m bench --quick --only merge,options``; the merge grid's worst ratio to
  the best baseline and each option's ratio to the plain merge, against the last runs kept in
  ``bench/h200/`` (a difference beyond the replays' spread, at least ``--noise``, is a change).
* host: ``python -m bench.profile_call --json`` (every public call per executor beside
  ``torch.mul(out=)``), then ``python -m bench.compiled_op --time``: the vLLM-design merge built
  as a compiled torch op (nvcc, into a temporary directory, built while the other parts run) and
  the check-free launch floor beside ``merge_state`` with a new T every call, in one process;
  then ``python -m bench --quick --only host`` (the Triton merge, ``cp_merge``'s local part...).
* sanitizer: ``compute-sanitizer --tool memcheck`` over ``tests/sanitize_ops.py`` (every op with
  valid offsets and with offsets that lie) under each executor; the ``ERROR SUMMARY`` lines.
* tests: ``pytest -m gpu -v`` on the tree (``--workers`` processes with pytest-xdist; the
  memcheck test deselected unless ``--with-memcheck-test``: the sanitizer part runs that
  memcheck per executor).
* executors: ``ZEROKV_LAUNCHER=c`` and ``=python``, each on the GPU tests of the merges, the
  empty-row ops, the adapters and CUDA-graph capture. The executor that ``pytest -m gpu`` ran
  on (``ZEROKV_LAUNCHER`` unset) takes those tests' outcomes from that run, unless
  ``--rerun-default-executor``.

``--cpu`` (also taken when no GPU is found): the GPU tests collected and skipped, the host table
with CPU tensors and launches counted (``zerokv.testing``), the bench's dry run; the GPU parts
are marked "not run: no GPU". Every step fails soft: a missing tool, a failing or timed-out
command is recorded with its error and the run goes on; a step that no longer fits in the budget
is marked "not run: out of time" and the summary names the ``--part`` to run next.

Files under ``--out`` (seven at most): ``summary.json`` (the goals, each with its value and
verdict), ``parts.json`` (every step: command, exit status, seconds, output tail, parsed
results), ``h200.log`` (every command's whole output) and ``bench/`` (the merge bench's JSON,
Markdown and PNG, the host bench's JSON). Both JSON files are rewritten after each part.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import h200_results as results
from .h200_results import EXECUTORS, PARTS, ROOT

HISTORY = ROOT / "bench" / "h200"
MEMCHECK_TEST = "tests/test_sanitizer.py::test_every_op_under_memcheck_reports_no_error"
BENCH_PARTS = "merge,options"
# seconds a step may take at most (and the budget's remainder), and what is kept back for writing
CAPS = {"probe": 90, "bench": 300, "build": 400, "host": 150, "memcheck": 240, "collect": 150, "pytest": 560}
RESERVE_S, MIN_STEP_S = 10.0, 20.0
LOG_CHARS = 1_500_000  # of one command's output in the log (its end)
TAIL_LINES = 40


# --- commands ---------------------------------------------------------------------------------


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
        _kill(proc)
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


def _kill(proc: subprocess.Popen) -> None:
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


# --- parts ------------------------------------------------------------------------------------

ENV_PROBE = r"""
import json, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                    gpus=torch.cuda.device_count(), gpu_memory_bytes=p.total_memory)
        import cupy
        info["cupy_devices"] = cupy.cuda.runtime.getDeviceCount()
except Exception as e:
    info["gpu_error"] = f"{type(e).__name__}: {e}"
try:
    import zerokv
    info["launcher"] = list(zerokv.launcher())  # what a run without ZEROKV_LAUNCHER gets
except Exception as e:
    info["launcher_error"] = f"{type(e).__name__}: {e}"
for name in ("zerokv", "cupy", "triton", "xdist", "pytest", "ninja"):
    try:
        info[name] = getattr(__import__(name), "__version__", "present")
    except Exception:
        info[name] = None
print(json.dumps(info))
"""

LAUNCHER_PROBE = "import zerokv; print(zerokv.launcher())"


def part_env(run: Run, gpu_wanted: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"status": "ran"}
    step, output = command(run, "env: versions and the GPU", [sys.executable, "-c", ENV_PROBE], "probe")
    info = _last_json(output) or {}
    rec["probe"], rec["python"] = {k: step[k] for k in step if k != "tail"}, info
    run.background["launcher"] = info.get("launcher")
    gpu = bool(info.get("cuda_available")) and (info.get("cupy_devices") or 0) >= 1
    rec["gpu"] = gpu
    if gpu_wanted and not gpu:
        rec["cpu_mode"] = (
            f"no GPU found ({info.get('gpu_error') or 'torch sees no CUDA device'}): the CPU mode"
        )
    tools = {}
    for name, flag in (
        ("nvcc", "--version"),
        ("compute-sanitizer", "--version"),
        ("ncu", "--version"),
        ("ninja", "--version"),
        ("nvidia-smi", "-L"),
    ):
        path = find_tool(name)
        tools[name] = {"path": path}
        if path:
            try:
                got = subprocess.run([path, flag], capture_output=True, text=True, timeout=60)
                tools[name]["version"] = (got.stdout + got.stderr).strip().splitlines()[-3:]
            except (OSError, subprocess.SubprocessError) as e:
                tools[name]["error"] = f"{type(e).__name__}: {e}"
    rec["tools"] = tools
    rec["launchers"] = {}
    for name in EXECUTORS:
        step, output = command(
            run,
            f"env: ZEROKV_LAUNCHER={name}",
            [sys.executable, "-c", LAUNCHER_PROBE],
            "probe",
            {"ZEROKV_LAUNCHER": name},
        )
        lines = output.strip().splitlines()
        rec["launchers"][name] = (
            lines[-1] if step.get("rc") == 0 and lines else step.get("tail") or step["status"]
        )
    rec["sources"] = fingerprint()
    rec["git"] = _git_describe()
    return rec


def fingerprint() -> dict[str, Any]:
    """sha256 over the library's, kernels', tests' and bench's source files (path and bytes): names
    the tree measured where no git metadata came along."""
    h, n = hashlib.sha256(), 0
    for top in ("zerokv", "kernels_cu", "tests", "bench"):
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if (
                not path.is_file()
                or "__pycache__" in rel
                or rel.startswith(("bench/h200/", "bench/results/"))
            ):
                continue
            if path.suffix in (".pyc", ".so", ".o"):
                continue
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
            n += 1
    return {"sha256": h.hexdigest(), "files": n}


def _git_describe() -> str | None:
    if not (ROOT / ".git").exists():
        return None
    try:
        got = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=20,
        )
        return got.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _last_json(output: str) -> Any:
    for line in reversed(output.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


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
        _kill(proc)
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
        rec["comparison"] = results.compare_with_history(data["rows"], run.history, run.noise)
    rec["dry"] = run.cpu
    return rec


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
        step.update(results.memcheck_lines(output))
        rec["executors"][name] = step
    return rec


def _pytest_argv(run: Run, args: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *args]
    if run.workers and not run.cpu:
        argv += ["-n", str(run.workers)]
    return argv


def _pytest_record(step: dict[str, Any], output: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The run's summary line, its failures and its per-test outcomes counted; and the outcomes."""
    outcomes = results.pytest_outcomes(output)
    step["summary"] = results.pytest_summary(output)
    step["failures"] = results.pytest_failures(output)
    step["outcomes"] = {o: sum(v == o for v in outcomes.values()) for o in sorted(set(outcomes.values()))}
    return step, outcomes


def collect(run: Run, label: str, args: list[str], extra: dict[str, str] | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args]
    step, output = command(run, label, argv, "collect", extra)
    step.update(results.collected(output))
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
    args, groups = results.executor_selection(ids)
    rec: dict[str, Any] = {"status": "ran", "groups": groups, "executors": {}, "gpu_tests_known": len(ids)}
    rec["ids_from"] = run.background.get("gpu_collect") or "this run's pytest -m gpu"
    if not args:
        return {**rec, "status": "failed: none of the selected test files was collected"}
    outcomes = run.background.get("gpu_outcomes")
    launcher = run.background.get("launcher") or ["", ""]
    for name in EXECUTORS:
        if run.reuse and outcomes and launcher[0] == name:
            rec["executors"][name] = results.from_outcomes(outcomes, args, launcher)
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


def write(out: Path, record: dict[str, Any]) -> dict[str, Any]:
    parts = record["parts"]
    checks = results.evaluate(parts)
    left = results.leftover(parts)
    summary = {
        "date": record.get("date"),
        "mode": record.get("mode"),
        "gpu": (parts.get("env", {}).get("python") or {}).get("gpu"),
        "sources": parts.get("env", {}).get("sources"),
        "verdict": results.verdict(checks),
        "checks": checks,
        "parts": {k: v.get("status") for k, v in parts.items()},
        "next": f"python -m bench.h200 --out DIR --part {','.join(left)}" if left else None,
        "wall_s": record.get("wall_s"),
    }
    (out / "parts.json").write_text(json.dumps(results.clean(record), indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(results.clean(summary), indent=1) + "\n")
    return summary


def print_summary(summary: dict[str, Any], out: Path) -> None:
    print(f"\nh200: {summary['verdict']} ({summary.get('gpu') or 'no GPU'}; {out})")
    for c in summary["checks"]:
        value = c["value"]
        if isinstance(value, dict):
            value = {
                k: v for k, v in value.items() if k not in ("options", "notes") and v not in (None, [], {})
            }
        print(f"  [{c['status']}] {c['name']} ({c['goal']}): {json.dumps(results.clean(value))[:300]}")
    if summary.get("next"):
        print(f"  next: {summary['next']}")


# --- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.h200",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="where the JSON, the log and the bench's files go"
    )
    parser.add_argument(
        "--part", default=",".join(PARTS[1:]), help=f"comma-separated, of {','.join(PARTS[1:])}"
    )
    parser.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="what runs without a GPU")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (GPU: 570)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="pytest-xdist processes for the GPU tests (GPU: 6 when installed; 0: one process)",
    )
    parser.add_argument(
        "--rounds", type=int, default=7, help="interleaved rounds of the host tables (>= 5 for figures)"
    )
    parser.add_argument(
        "--noise", type=float, default=0.02, help="the least ratio change counted beyond noise"
    )
    parser.add_argument(
        "--history", type=Path, default=HISTORY, help="the last runs' bench JSON (default: bench/h200)"
    )
    parser.add_argument(
        "--with-memcheck-test",
        action="store_true",
        help="pytest -m gpu keeps tests/test_sanitizer.py (the sanitizer part runs its memcheck per executor)",
    )
    parser.add_argument(
        "--rerun-default-executor",
        action="store_true",
        help="run the executors part's tests for the executor pytest -m gpu ran on too",
    )
    parser.add_argument(
        "--assemble", type=Path, nargs="+", metavar="DIR", help="runs' --out directories to summarise as one"
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        parser.error(f"--part: unknown {', '.join(bad)}; choose from {', '.join(PARTS[1:])}")
    args.parts = [p for p in PARTS if p in parts or p == "env"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.assemble:
        summary = write(args.out, results.assemble(args.assemble))
        print_summary(summary, args.out)
        return 0
    (args.out / "h200.log").write_text("")
    work = Path(tempfile.mkdtemp(prefix="zerokv-h200-"))  # outside the source tree
    budget = args.budget_s if args.budget_s is not None else (3600.0 if args.cpu else 570.0)
    run = Run(
        out=args.out,
        work=work,
        cpu=args.cpu,
        budget_s=budget,
        parts=args.parts,
        rounds=args.rounds,
        noise=args.noise,
        history=args.history,
        memcheck_test=args.with_memcheck_test,
        reuse=not args.rerun_default_executor,
    )
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record: dict[str, Any] = {"date": date, "args": {k: str(v) for k, v in vars(args).items()}, "parts": {}}
    try:
        record["parts"]["env"] = env = part_env(run, gpu_wanted=not args.cpu)
        run.cpu = args.cpu or not env["gpu"]
        xdist = bool((env.get("python") or {}).get("xdist"))
        run.workers = (args.workers if args.workers is not None else 6) if xdist and not run.cpu else 0
        record["mode"] = "cpu" if run.cpu else "gpu"
        record["workers"] = run.workers
        if "host" in run.parts and not run.cpu:
            start_op_build(run)
        steps = {
            "bench": part_bench,
            "host": part_host,
            "sanitizer": part_sanitizer,
            "tests": part_tests,
            "executors": part_executors,
        }
        for name in run.parts[1:]:
            try:
                record["parts"][name] = steps[name](run)
            except Exception as e:  # one broken part must not lose the others
                record["parts"][name] = {"status": f"failed: {type(e).__name__}: {e}"[:600]}
                run.log(f"\n[{name} failed]\n{_traceback()}\n")
            record["wall_s"] = round(time.monotonic() - run.started, 1)
            write(args.out, record)
    finally:
        bg = run.background.get("build") or {}
        if "proc" in bg:  # the host part did not wait for it
            _kill(bg["proc"])
        shutil.rmtree(work, ignore_errors=True)
    record["wall_s"] = round(time.monotonic() - run.started, 1)
    summary = write(args.out, record)
    print_summary(summary, args.out)
    return 0


def _traceback() -> str:
    import traceback

    return traceback.format_exc()


if __name__ == "__main__":
    sys.exit(main())
