"""What identifies a run and the file that keeps it: the environment (GPU, driver and library
versions, date, commit and the run's options), the one-line header that names the run in its
Markdown and PNG, and the JSON of the environment, every row and every target. Apart from the
tables because it reads the machine, not the rows.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zerokv import versions

from .common import Row
from .targets import Target

ROOT = Path(__file__).resolve().parent.parent


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()  # fmt: skip
        if out:
            return out.splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    words = Path("/proc/driver/nvidia/version").read_text().split()  # "... Kernel Module  580.82.07 ..."
    return next(w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit())


def _nvrtc_version() -> str | None:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def environment(b: Any, args: dict[str, Any]) -> dict[str, Any]:
    """GPU, driver and library versions, date, commit and the options of the run."""
    torch = b.torch
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": b.mode,
        "args": args,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "l2_bytes": b.l2_bytes,
        "copy_gbps": b.copy_gbps,
    }
    env["numpy"] = _try(lambda: __import__("numpy").__version__)
    env["zerokv"] = _try(lambda: __import__("zerokv").__version__)
    env["git_commit"] = _try(
        lambda: (
            subprocess.run(
                # "-dirty": the measured tree is not the commit named
                ["git", "describe", "--always", "--dirty", "--abbrev=7"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    )
    env["triton"] = _try(lambda: __import__("triton").__version__)
    env["flashinfer"] = _try(lambda: __import__("flashinfer").__version__)
    # from metadata: importing CuPy creates its kernel cache directory, which a dry run must not
    env["cupy"] = _try(lambda: next(v for d in versions.CUPY if (v := versions.installed(d))))
    env["nvrtc"] = _try(_nvrtc_version)
    if b.dry:
        env["gpu"] = "none (dry run: CPU, synthetic times)"
        return env
    import cupy

    props = torch.cuda.get_device_properties(b.device)
    env["gpu"] = props.name
    env["compute_capability"] = f"{props.major}.{props.minor}"
    env["sm_count"] = props.multi_processor_count
    env["gpu_memory_bytes"] = props.total_memory
    env["driver"] = _try(_driver_version)
    env["cuda_driver_api"] = _try(cupy.cuda.runtime.driverGetVersion)
    env["cuda_runtime"] = _try(cupy.cuda.runtime.runtimeGetVersion)
    env["nvrtc"] = env["nvrtc"] or _try(lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion())))
    return env


def header(env: dict[str, Any]) -> str:
    keys = ("driver", "torch", "cupy", "nvrtc", "cuda_runtime", "triton", "flashinfer")
    names = ("driver", "torch", "CuPy", "NVRTC", "CUDA runtime", "Triton", "FlashInfer")
    versions = ", ".join(f"{n} {env.get(k)}" for n, k in zip(names, keys, strict=True) if env.get(k))
    return f"zerokv bench ({env['mode']}): {env.get('gpu')}, {versions}, {env['date']}, commit {env.get('git_commit')}"


def _clean(x: Any) -> Any:
    """JSON without NaN/Infinity literals: non-finite floats become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, env: dict[str, Any], rows: list[Row], targets: list[Target]) -> None:
    doc = {"environment": env, "rows": [asdict(r) for r in rows], "targets": [asdict(t) for t in targets]}
    path.write_text(json.dumps(_clean(doc), indent=1) + "\n")
