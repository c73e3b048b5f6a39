"""Device selection without several GPUs: the checks and the context switch, unit-tested."""

from __future__ import annotations

import contextlib
import threading
import types

import numpy as np
import pytest
import torch

import zerokv
from zerokv import _checks, _runtime, _tensors


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


class _FakeCupy:
    """What Launch uses of CuPy: the current device and a device context manager."""

    def __init__(self, current: int) -> None:
        self.current = current
        self.entered: list[int] = []
        runtime = types.SimpleNamespace(getDevice=lambda: self.current, free=lambda ptr: None)

        @contextlib.contextmanager
        def device(i):
            self.entered.append(i)
            before, self.current = self.current, i
            try:
                yield
            finally:
                self.current = before

        self.cuda = types.SimpleNamespace(runtime=runtime, Device=device)


class _FakeDriver:
    def __init__(self, cupy: _FakeCupy, results: list[int]) -> None:
        self.cupy, self.results, self.launched_on = cupy, results, []
        self.get_device = cupy.cuda.runtime.getDevice

    def launch(self, *args):
        self.launched_on.append(self.cupy.current)
        return self.results.pop(0) if self.results else 0

    def error_name(self, code):
        return "FAKE_ERROR"


def _launch(monkeypatch, device: int, current: int, results: list[int]):
    cupy = _FakeCupy(current)
    monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)
    prepared = _runtime.Launch.__new__(_runtime.Launch)
    prepared.expr, prepared.device, prepared.extra = "k<float>", device, None
    prepared.head = ()
    prepared.driver = _FakeDriver(cupy, results)
    return prepared, cupy


def test_launch_on_the_current_device_does_not_switch(monkeypatch):
    prepared, cupy = _launch(monkeypatch, device=0, current=0, results=[])
    prepared(123)
    assert cupy.entered == [] and prepared.driver.launched_on == [0]


def test_launch_for_another_device_runs_in_its_context_and_restores_the_current_one(monkeypatch):
    prepared, cupy = _launch(monkeypatch, device=1, current=0, results=[])
    prepared(123)
    assert cupy.entered == [1] and prepared.driver.launched_on == [1] and cupy.current == 0


def test_a_thread_without_a_context_gets_the_devices_primary_context(monkeypatch):
    prepared, cupy = _launch(monkeypatch, device=0, current=0, results=[201, 0])  # INVALID_CONTEXT
    prepared(123)
    assert cupy.entered == [0] and prepared.driver.launched_on == [0, 0]


def test_a_failed_launch_raises_with_the_driver_error(monkeypatch):
    prepared, _ = _launch(monkeypatch, device=0, current=0, results=[700])
    with pytest.raises(RuntimeError, match="FAKE_ERROR"):
        prepared(123)


def test_functions_are_built_once_per_device_under_concurrent_first_calls(monkeypatch):
    built: list[tuple] = []
    lock = threading.Lock()

    def fake_build(stem, expr, device):
        with lock:
            built.append((stem, expr, device))
        return _runtime.Loaded(None, 1000 + device)

    monkeypatch.setattr(_runtime, "_build", fake_build)
    monkeypatch.setattr(_runtime, "_functions", {})
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        assert _runtime.function("merge", "k<x>", i % 2).ptr == 1000 + i % 2

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(built) == [("merge", "k<x>", 0), ("merge", "k<x>", 1)]


def test_torch_stream_is_read_for_the_tensors_device(monkeypatch):
    seen = []
    fake_c = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda d: seen.append(d) or 77)
    monkeypatch.setattr(torch, "_C", fake_c)
    t = _tensors.Tensor(None, 0, (1,), (1,), "float32", 1, True)
    assert _runtime.stream_for(t) == 77 and seen == [1]


def test_clear_cache_also_forgets_remembered_launches(monkeypatch):
    monkeypatch.setattr(_runtime, "launches", _runtime.LaunchCache())
    _runtime.launches.remember(("k",), object())
    _runtime.clear_cache()
    assert not _runtime.launches
