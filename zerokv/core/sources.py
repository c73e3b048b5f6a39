"""Kernel sources as NVRTC compiles them: ``kernels_cu/<stem>.cu`` with its ``#include "x.cuh"``
lines replaced by the header text and the block sizes of its kernels defined on top, so the
code handed to NVRTC (and hashed by CuPy's disk cache) covers every byte."""

from __future__ import annotations

import re
from pathlib import Path

from . import kernels as _kernels
from .kernels import Kernel

# Options shared by the run-time (CuPy) and the offline (cuda-bindings) compiles. CuPy adds
# -arch for the device and -ftz=true itself.
NVRTC_OPTIONS = ("--std=c++17",)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """``kernels_cu`` inside an installed wheel, or beside the package in a source tree."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"zerokv: kernel sources (kernels_cu/) not found near {here}")


def source(stem: str, directory: Path | None = None) -> str:
    """The full text of ``<stem>.cu``: block sizes defined, every local header inlined once."""
    directory = directory or kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (directory / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    head = f"// zerokv: {stem}.cu with headers inlined\n" + _kernels.block_defines(stem)
    return head + expand(f"{stem}.cu")


def kernel_source(kernel: Kernel) -> str:
    """What NVRTC compiles for ``kernel``: its stem's source, or its own ``code``."""
    if kernel.code is not None:
        return _kernels.block_defines(kernel.stem, (kernel,)) + kernel.code
    return source(kernel.stem)


def nvrtc_options(arch: str) -> list[str]:
    """NVRTC's options for ``arch``, the offline build's and the kernel directory's key.
    ``-ftz=true``: CuPy always adds it, so the offline build matches the run-time one."""
    return [f"-arch={arch}", "-ftz=true", *NVRTC_OPTIONS]
