"""Which of CuPy's two packages are installed (package metadata only: nothing imported), and the
one error for both at once (they overwrite one ``cupy`` module)."""

from __future__ import annotations

from importlib import metadata

CUPY_PACKAGES = ("cupy-cuda12x", "cupy-cuda13x")
_checked: list[str] = []


TWO_CUPY = (
    "both cupy-cuda12x and cupy-cuda13x are installed; they overwrite one `cupy` module: "
    "pip uninstall -y cupy-cuda12x cupy-cuda13x, then pip install 'zerokv[cuda12]' or 'zerokv[cuda13]'"
)


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` is installed (package metadata only, no import)."""
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def installed_cupy_packages() -> list[str]:
    """Which of CuPy's CUDA 12 and CUDA 13 packages are installed (metadata only, no import)."""
    return [dist for dist in CUPY_PACKAGES if installed(dist)]


def check_single_cupy() -> None:
    """RuntimeError when both CuPy packages are installed (checked once per process, before the
    first ``import cupy`` of zerokv)."""
    if _checked:
        return
    if len(installed_cupy_packages()) > 1:
        raise RuntimeError(f"zerokv: {TWO_CUPY}")
    _checked.append("ok")
