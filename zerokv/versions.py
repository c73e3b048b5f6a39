"""The versions of zerokv and of what it runs on, read from package metadata: imports neither
torch nor CuPy, so it answers where either is broken (``python -m zerokv --version``, the
self-check's first line)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import metadata

from . import __version__

CUPY = ("cupy-cuda12x", "cupy-cuda13x", "cupy")
NVRTC = ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc")


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(installed: Callable[[str], str | None] = installed) -> tuple[str, list[str]]:
    """One line of versions, and warnings (both CuPy packages, no CuPy, no NVRTC wheel);
    ``installed``: a distribution's version or None."""
    parts = [f"zerokv {__version__}", f"Python {sys.version.split()[0]}"]
    cupys = [d for d in CUPY if installed(d)]
    for d in ["numpy", *cupys, "cuda-bindings", *NVRTC, "torch"]:
        if installed(d):
            parts.append(f"{d} {installed(d)}")
    warnings = []
    if len(cupys) > 1:
        warnings.append(
            f"WARNING: {' and '.join(cupys)} are all installed; they write the same `cupy` module. "
            f"Uninstall them all (pip uninstall -y {' '.join(cupys)}) and install one extra: "
            "zerokv[cuda12] or zerokv[cuda13]."
        )
    if not cupys:
        warnings.append(
            "CuPy is not installed: pip install 'zerokv[cuda13]' (CUDA 13 driver) or 'zerokv[cuda12]'"
        )
    if not any(installed(d) for d in NVRTC):
        warnings.append(
            "no NVRTC wheel is installed (nvidia-cuda-nvrtc for CUDA 13, nvidia-cuda-nvrtc-cu12 for "
            "CUDA 12): install the extra of your driver's CUDA major again, zerokv[cuda13] or zerokv[cuda12]"
        )
    return ", ".join(parts), warnings


def launcher_line() -> str:
    """Which executor runs the calls in this process, and why (``zerokv.launcher()``)."""
    from .core import executor

    try:
        name, why = executor.choose()
    except (RuntimeError, ValueError) as e:
        return f"launcher: none ({e})"
    return f"launcher: {name} ({why})"


def report() -> str:
    """``zerokv X.Y.Z`` on the first line, then the versions of what it runs on, the launcher
    and warnings."""
    line, warnings = environment()
    rest = line.removeprefix(f"zerokv {__version__}, ")
    return "\n".join([f"zerokv {__version__}", rest, launcher_line(), *warnings])
