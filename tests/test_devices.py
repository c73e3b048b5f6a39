"""Device selection without several GPUs: the checks and the context switch, unit-tested."""

from __future__ import annotations

import contextlib
import threading
import types

import numpy as np
import pytest
import torch

import zerokv
from zerokv.core import checks as _checks
from zerokv.core import compiler as _compiler
from zerokv.core import device as _device
from zerokv.core import kernels as _kernels
from zerokv.core import launch as _launch
from zerokv.core import plans as _plans
from zerokv.core import tensors as _tensors


class _OnDevice:
    """A DLPack producer that says its (host) memory is on CUDA device ``device``: enough to
    exercise the host-side checks without a GPU (nothing is ever launched with it)."""

    def __init__(self, array: np.ndarray, device: int) -> None:
        self.array, self.device = array, device

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return (2, self.device)


def _states(T=6, H=2, D=8):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((T, H, D), dtype=np.float32),
        rng.standard_normal((T, H), dtype=np.float32),
        rng.standard_normal((T, H, D), dtype=np.float32),
        rng.standard_normal((T, H), dtype=np.float32),
    )


def test_same_device_names_both_arguments_and_devices():
    a = _tensors.Tensor(None, 0, (1,), (1,), "float32", 0, False)
    b = _tensors.Tensor(None, 0, (1,), (1,), "float32", 1, False)
    with pytest.raises(ValueError, match=r"v_b is on cuda:1 but v_a is on cuda:0"):
        _checks.same_device([("v_a", a), ("v_b", b)])
    host = _tensors.Tensor(None, 0, (1,), (1,), "float32", -1, False)
    with pytest.raises(ValueError, match=r"out is on the CPU but v_a is on cuda:0"):
        _checks.same_device([("v_a", a), ("out", host)])


@pytest.mark.parametrize("which", ["v_b", "s_b", "out", "out_lse"])
def test_states_spread_over_two_devices_are_rejected_before_anything_is_written(monkeypatch, which):
    monkeypatch.setattr(_tensors, "_producer_stream", lambda x: 0)  # no CuPy stream lookup
    v_a, s_a, v_b, s_b = _states()
    out, out_lse = np.full_like(v_a, np.nan), np.full_like(s_a, np.nan)
    args = {"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b, "out": out, "out_lse": out_lse}
    wrapped = {k: _OnDevice(x, 1 if k == which else 0) for k, x in args.items()}
    with pytest.raises(ValueError, match=rf"{which} is on cuda:1 but v_a is on cuda:0"):
        zerokv.merge_state(
            wrapped["v_a"], wrapped["s_a"], wrapped["v_b"], wrapped["s_b"],
            out=wrapped["out"], out_lse=wrapped["out_lse"],
        )  # fmt: skip
    assert np.isnan(out).all() and np.isnan(out_lse).all()


def test_fixup_offsets_on_another_device_are_rejected(monkeypatch):
    monkeypatch.setattr(_tensors, "_producer_stream", lambda x: 0)
    out = _OnDevice(np.zeros((4, 2, 8), np.float32), 0)
    lse = _OnDevice(np.zeros((4, 2), np.float32), 0)
    cu = _OnDevice(np.array([0, 2, 4], np.int32), 1)
    kv = _OnDevice(np.array([0, 1], np.int32), 0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on cuda:1 but the tensors are on cuda:0"):
        zerokv.fixup_zero_kv_rows(out, lse, kv, cu)


class _FakeError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"FAKE_ERROR ({status})")
        self.status = status


class _FakeDriver:
    """What a Launcher uses of the driver: the current device, a device context manager, the
    launch call (its results scripted: 0 for success, an error status otherwise)."""

    def __init__(self, current: int, results: list[int]) -> None:
        self.current, self.results = current, results
        self.entered: list[int] = []
        self.launched_on: list[int] = []
        self.error = _FakeError
        self.cupy = types.SimpleNamespace(
            cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(free=lambda p: None))
        )

    def get_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def Device(self, i):  # noqa: N802  (CuPy's name)
        self.entered.append(i)
        before, self.current = self.current, i
        try:
            yield
        finally:
            self.current = before

    def launch(self, *args):
        self.launched_on.append(self.current)
        status = self.results.pop(0) if self.results else 0
        if status:
            raise _FakeError(status)


def _launcher(device: int, current: int, results: list[int]) -> _launch.Launcher:
    launcher = _launch.Launcher.__new__(_launch.Launcher)
    launcher.expr, launcher.device, launcher.handle, launcher.block = "k<float>", device, 1, 128
    launcher.pack_into, launcher.nbytes = (lambda buf, offset, *args: None), 8
    launcher.driver = _FakeDriver(current, results)
    return launcher


def test_launch_on_the_current_device_does_not_switch():
    launcher = _launcher(device=0, current=0, results=[])
    launcher(1, 123)
    assert launcher.driver.entered == [] and launcher.driver.launched_on == [0]


def test_launch_for_another_device_runs_in_its_context_and_restores_the_current_one():
    launcher = _launcher(device=1, current=0, results=[])
    launcher(1, 123)
    d = launcher.driver
    assert d.entered == [1] and d.launched_on == [1] and d.current == 0


def test_a_thread_without_a_context_gets_the_devices_primary_context():
    launcher = _launcher(device=0, current=0, results=[201, 0])  # CUDA_ERROR_INVALID_CONTEXT
    launcher(1, 123)
    assert launcher.driver.entered == [0] and launcher.driver.launched_on == [0, 0]


def test_a_failed_launch_raises_with_the_driver_error():
    launcher = _launcher(device=0, current=0, results=[700])
    with pytest.raises(RuntimeError, match=r"launching k<float> failed: FAKE_ERROR \(700\)"):
        launcher(1, 123)


def test_functions_are_built_once_per_device_under_concurrent_first_calls(monkeypatch):
    built: list[tuple] = []
    lock = threading.Lock()

    def fake_build(code, expr, device):
        with lock:
            built.append((expr, device))
        return _compiler.Loaded(None, 1000 + device)

    monkeypatch.setattr(_compiler, "_build", fake_build)
    monkeypatch.setattr(_compiler, "_functions", {})
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        assert _compiler.function(_kernels.MERGE_STATE, "k<x>", i % 2).ptr == 1000 + i % 2

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(built) == [("k<x>", 0), ("k<x>", 1)]


def test_torch_stream_is_read_for_the_tensors_device(monkeypatch):
    seen = []
    fake_c = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda d: seen.append(d) or 77)
    monkeypatch.setattr(torch, "_C", fake_c)
    assert _device.torch_stream(1) == 77 and seen == [1]


def test_clear_cache_forgets_plans_and_functions(monkeypatch):
    monkeypatch.setattr(_plans, "_plans", {("k",): object()})
    monkeypatch.setattr(_compiler, "_functions", {("merge", "k<x>", 0): object()})
    _plans.clear_cache()
    assert not _plans._plans and not _compiler._functions
