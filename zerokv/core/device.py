"""Devices and streams: CuPy imported on first need, device properties (queried once), the
capability floor, and the current stream of torch or CuPy on a device."""

from __future__ import annotations

import sys
from functools import cache
from typing import Any

from . import disk_cache as _cache
from .cupy_packages import check_single_cupy

MIN_CAPABILITY = (8, 0)


def import_cupy() -> Any:
    check_single_cupy()  # cupy-cuda12x and cupy-cuda13x both installed: a clear error
    _cache.check_cupy_cache_dir()  # a cache directory that cannot be created: a clear error
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "zerokv needs CuPy for GPU tensors: pip install 'zerokv[cuda12]' or 'zerokv[cuda13]'"
        ) from e
    return cupy


@cache
def properties(device: int) -> dict[str, Any]:
    """CUDA's device properties (queried once per device: a slow call)."""
    return import_cupy().cuda.runtime.getDeviceProperties(device)


def device_name(device: int) -> str:
    name = properties(device)["name"]
    return name.decode() if isinstance(name, bytes) else name


def capability(device: int) -> tuple[int, int]:
    props = properties(device)
    return int(props["major"]), int(props["minor"])


def check_device(device: int) -> None:
    """A clear error for GPUs older than sm_80, before anything is compiled for them."""
    cap = capability(device)
    if cap < MIN_CAPABILITY:
        name = device_name(device)
        raise RuntimeError(
            f"zerokv: cuda:{device} ({name}) has compute capability {cap[0]}.{cap[1]}; "
            "zerokv needs 8.0 or newer (A100, A10/L4, L40, H100/H200, B200, RTX 30xx and later)"
        )


def torch_stream(device: int) -> int:
    """Raw handle of torch's current stream on ``device`` (~0.1 µs: what Triton and Inductor use)."""
    return sys.modules["torch"]._C._cuda_getCurrentRawStream(device)


def cupy_stream(device: int) -> int:
    cupy = import_cupy()
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr


@cache
def l2_bytes(device: int) -> int:
    return int(properties(device)["l2CacheSize"])


@cache
def sm_count(device: int) -> int:
    return int(properties(device)["multiProcessorCount"])
