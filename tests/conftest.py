"""Shared fixtures: the GPU marker's skip, per-dtype tolerances, NaN-aware comparison."""

from __future__ import annotations

import numpy as np
import pytest


# --- caches: every cache a test (or a process it starts) fills is a temporary directory --------
# Set at import, before any test imports CuPy (whose cache backend reads CUPY_CACHE_DIR once);
# a variable the caller set is kept. The directory is removed when the session ends.
def _temporary_caches() -> str:
    import atexit
    import os
    import shutil
    import sys
    import tempfile

    root = tempfile.mkdtemp(prefix="zerokv-tests-")
    atexit.register(shutil.rmtree, root, True)
    for var, sub in (
        ("ZEROKV_CACHE_DIR", "zerokv"),
        ("CUPY_CACHE_DIR", "cupy"),
        ("XDG_CACHE_HOME", "xdg-cache"),
        ("TRITON_CACHE_DIR", "triton"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("MPLCONFIGDIR", "matplotlib"),
        ("RUSTUP_HOME", "rustup"),  # the wheel build's tools probe rustup, which writes its settings
    ):
        os.environ.setdefault(var, os.path.join(root, sub))
    compiler = sys.modules.get("cupy.cuda.compiler")  # CuPy imported already: point it there too
    if compiler is not None and hasattr(compiler, "_set_kernel_cache_backend"):
        from cupy.cuda._compiler_cache import DiskKernelCacheBackend

        compiler._set_kernel_cache_backend(DiskKernelCacheBackend(os.environ["CUPY_CACHE_DIR"]))
    return root


TEST_CACHE_ROOT = _temporary_caches()


torch = pytest.importorskip("torch")


def _has_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()
GPUS = torch.cuda.device_count() if HAS_GPU else 0


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    skip_two = pytest.mark.skip(reason=f"needs two CUDA GPUs ({GPUS} found)")
    for item in items:
        if "multigpu" in item.keywords:  # -m gpu selects the two-GPU tests too
            item.add_marker(pytest.mark.gpu)
        if "multigpu" in item.keywords and GPUS < 2:
            item.add_marker(skip_two)
        elif "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


# output dtype -> (atol, rtol) against the float64 reference
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def f64(x) -> np.ndarray:
    return x.detach().double().cpu().numpy()


def assert_close(actual, expected: np.ndarray, dtype, what: str = "") -> None:
    """NaN and +-inf at exactly the same places; finite values within the dtype's tolerance."""
    a = f64(actual) if hasattr(actual, "detach") else np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert (nan_a == nan_e).all(), f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} (first few)"
    inf_e = np.isinf(e)
    assert (np.isinf(a) == inf_e).all(), (
        f"{what}: inf mismatch at {np.argwhere(np.isinf(a) != inf_e)[:5].tolist()}"
    )
    assert (a[inf_e] == e[inf_e]).all(), f"{what}: inf sign mismatch"
    fin = np.isfinite(e)
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(a[fin], e[fin], atol=atol, rtol=rtol, err_msg=what)
