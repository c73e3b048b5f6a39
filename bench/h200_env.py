"""The env part of the H200 script, which always runs: Python, torch and the GPU, the tools
(nvcc, compute-sanitizer, ncu, ninja, nvidia-smi), which executor each ``ZEROKV_LAUNCHER``
loads, a fingerprint of the sources and the git description. Its GPU finding decides whether
the other parts run in the CPU mode.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from typing import Any

from .h200_results import EXECUTORS, ROOT
from .h200_run import Run, command, find_tool

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
