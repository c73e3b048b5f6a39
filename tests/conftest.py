"""Shared fixtures: the GPU marker's skip, no skip for any other test, per-dtype tolerances
(derived in ``tolerances.py``), NaN-aware comparison, worker threads whose failures surface."""

from __future__ import annotations

import threading

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


import torch  # noqa: E402  (a test requirement: without it the suite fails, never skips)
from oracles import f64  # noqa: E402, F401  (the one float64 copy, for the tests that import it here)
from tolerances import tolerance  # noqa: E402


def _gpu_probe() -> tuple[bool, str | None]:
    """``(zerokv launches here, why a run that needs it cannot)``. A GPU is required when torch
    sees a CUDA device or ``ZEROKV_REQUIRE_GPU=1`` (``=0``: the GPU tests skip, by request): then
    a zerokv that cannot launch is a broken install, never a run of skipped GPU tests."""
    import os

    wanted = os.environ.get("ZEROKV_REQUIRE_GPU", "")
    required = wanted == "1" or (wanted != "0" and torch.cuda.is_available())
    if not required and not torch.cuda.is_available():
        return False, None
    import zerokv

    ok, reason = zerokv.can_run()
    if ok or not required:
        return ok, None
    why = "ZEROKV_REQUIRE_GPU=1" if wanted == "1" else "torch sees a CUDA device"
    return False, (
        f"zerokv cannot launch ({reason}) but {why}: the GPU tests would skip; "
        "fix the install, or set ZEROKV_REQUIRE_GPU=0 to run the CPU tests alone"
    )


HAS_GPU, GPU_BROKEN = _gpu_probe()
GPUS = torch.cuda.device_count() if HAS_GPU else 0


def pytest_configure(config):
    if GPU_BROKEN is not None:  # before any test is collected: one line, no test run
        raise pytest.UsageError(GPU_BROKEN)


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test without the ``gpu`` marker that skips (a missing package, a skip left in) fails: a
    broken install must not look green."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" not in item.keywords and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"a CPU test skipped ({reason}): CPU tests never skip; install the `test` extra"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module that skips as a whole (``importorskip`` at import) fails the same way."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped at import ({report.longrepr}): CPU tests never skip"


DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOL = {dtype: tolerance(dtype) for dtype in DTYPES}  # output dtype -> (atol, rtol), one rounding

_RUNNING = {"cpu_test": False}  # whether the test now running is a CPU test (no ``gpu`` marker)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _RUNNING["cpu_test"] = "gpu" not in item.keywords
    try:
        yield
    finally:
        _RUNNING["cpu_test"] = False


def assert_close(
    actual, expected: np.ndarray, dtype, what: str = "", roundings: int = 1, arithmetic: str | None = None
) -> None:
    """NaN and +-inf at exactly the same places; finite values within the bound of ``roundings``
    output roundings to ``dtype`` plus the error of the ``arithmetic`` that computed them
    (``tolerances.py``): by default float64 in a CPU test (only the CPU path runs there), float32
    in a GPU test (a kernel); "float32" where a CPU test's values went through float32 steps."""
    if arithmetic is None:
        on_gpu = getattr(getattr(actual, "device", None), "type", "cpu") != "cpu"
        arithmetic = "float64" if _RUNNING["cpu_test"] and not on_gpu else "float32"
    a = f64(actual)
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
    atol, rtol = tolerance(dtype, roundings, arithmetic)
    np.testing.assert_allclose(a[fin], e[fin], atol=atol, rtol=rtol, err_msg=f"{what} ({arithmetic})")


def run_threads(target, args_list) -> list:
    """Run ``target(*args)`` in one thread per entry of ``args_list``; return the results in
    order. An exception in any worker (an assert too) is re-raised here, in the test, with the
    first failing worker's traceback: pytest alone only warns about a thread's exception."""
    results: list = [None] * len(args_list)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def run(i, args):
        try:
            results[i] = target(*args)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the test
            with lock:
                errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        i, first = min(errors, key=lambda x: x[0])
        raise AssertionError(
            f"{len(errors)} of {len(threads)} workers failed; worker {i}: {first!r}"
        ) from first
    return results


# --- launches recorded, not made: CPU tensors down the GPU path -----------------------------
from zerokv.core import device as _device  # noqa: E402
from zerokv.core import facts as _facts  # noqa: E402
from zerokv.core import launch as _launch  # noqa: E402
from zerokv.core import plans as _plans  # noqa: E402


class _Recorder:
    """Stands for a Launcher: records (kernel, instantiation, grid, arguments by name)."""

    def __init__(self, kernel, targs, log):
        self.kernel, self.targs, self.log = kernel, targs, log

    def launch_values(self, grid, grid_y, stream, values):
        """What the launch would launch: the values packed as a launch packs them, read back."""
        self.kernel.packer.pack_into(_launch._arena.buf, 0, *values)
        values = self.kernel.packer.unpack_from(_launch._arena.buf)
        args = dict(zip((n for n, _ in self.kernel.params), values, strict=True))
        self.log.append((self.kernel.name, self.targs, grid if grid_y == 1 else (grid, grid_y), args))


@pytest.fixture
def recorded(monkeypatch):
    """Every launch of the ops goes to the returned list; host tensors take the GPU path."""
    log: list[tuple] = []
    _plans.clear_cache()
    monkeypatch.setattr(_plans, "launcher", lambda kernel, targs, device: _Recorder(kernel, targs, log))
    monkeypatch.setattr(_device, "sm_count", lambda device: 132)
    monkeypatch.setattr(_device, "l2_bytes", lambda device: 50 << 20)
    monkeypatch.setattr(_device, "torch_stream", lambda device: 0)
    monkeypatch.setattr(_device, "cupy_stream", lambda device: 0)
    monkeypatch.setattr(_facts, "of", _on_device(_facts.of))
    yield log
    _plans.clear_cache()


def _on_device(facts_of):
    def on_device(*args):
        f = facts_of(*args)
        f.device = 0
        return f

    return on_device


@pytest.fixture(autouse=True)
def _poisoned_allocations(request, monkeypatch):
    """On a GPU, every output zerokv allocates itself starts as NaN (all bytes 0xFF: NaN in
    float32, bfloat16, float16 and fp8 e4m3), so an element a kernel leaves unwritten shows."""
    if "gpu" not in request.keywords:
        yield
        return
    from zerokv.core import merge_plans, plans

    allocator = merge_plans._allocator

    def poisoning(plan, lse):
        alloc = allocator(plan, lse)

        def poisoned(shape, like):  # no ``direct``: the compiled executor calls it too
            x, ptr = alloc(shape, like)
            if hasattr(x, "view") and getattr(x, "is_cuda", False):
                x.view(torch.uint8).fill_(0xFF)
            return x, ptr

        return poisoned

    monkeypatch.setattr(merge_plans, "_allocator", poisoning)
    plans.clear_plans()  # the plans kept hold their allocators: made again, poisoning
    yield
    plans.clear_plans()
