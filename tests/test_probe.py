"""``zerokv.can_run``: one line for every obstacle, never an exception, never a compile; and
both CuPy packages installed is a clear error at the first GPU call."""

from __future__ import annotations

import types

import pytest

import zerokv
from zerokv.core import compiler, device, probe


class _FakeRuntime:
    CUDARuntimeError = RuntimeError

    def __init__(self, count=1, hip=False, fail=None):
        self.count, self.is_hip, self.fail = count, hip, fail

    def getDeviceCount(self):
        if self.fail:
            raise RuntimeError(self.fail)
        return self.count

    def getDevice(self):
        return 0


def _fake_cupy(monkeypatch, capability=(9, 0), name="NVIDIA H200", **kw):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_FakeRuntime(**kw)))
    monkeypatch.setattr(device, "import_cupy", lambda: fake)
    monkeypatch.setattr(device, "capability", lambda d: capability)
    monkeypatch.setattr(device, "device_name", lambda d: name)
    real = probe.importlib.util.find_spec  # CuPy "installed"; every other module as it is
    monkeypatch.setattr(
        probe.importlib.util, "find_spec", lambda n, *a: object() if n == "cupy" else real(n, *a)
    )
    monkeypatch.setattr(probe, "installed_cupy_packages", lambda: ["cupy-cuda13x"])
    monkeypatch.setattr(probe, "driver_devices", lambda: (1, ""))  # the driver sees a GPU
    return fake


@pytest.fixture(autouse=True)
def no_compile(monkeypatch):
    """A probe compiles nothing: any NVRTC compile or module build fails the test."""
    built = compiler._modules_built
    monkeypatch.setattr(compiler, "_build", lambda *a: pytest.fail("can_run compiled"))
    yield
    assert compiler._modules_built == built


def test_exported():
    assert zerokv.can_run is probe.can_run and "can_run" in zerokv.__all__


@pytest.mark.parametrize("device", [None, 0, "cuda:0", "cuda", 5])
def test_here_it_says_why_in_one_line(device):
    ok, why = zerokv.can_run(device)
    import torch

    assert why and "\n" not in why
    if torch.cuda.is_available():  # a GPU here (no skip: CPU tests never skip): device 5 is past it
        exists = device != 5 or torch.cuda.device_count() > 5
        assert ok is exists, why
        if not exists:
            assert "does not exist" in why, why
        return
    assert ok is False
    assert any(w in why for w in ("no usable CUDA GPU", "no CUDA GPU", "CuPy is not installed")), why


@pytest.mark.parametrize("device", ["cpu", -1, True, 1.5, object(), "cuda:x"])
def test_a_bad_device_argument_is_a_reason_not_an_exception(monkeypatch, device):
    _fake_cupy(monkeypatch)
    ok, why = zerokv.can_run(device)
    assert ok is False and ("not a CUDA device" in why or "negative" in why), why


def test_a_device_that_does_not_exist(monkeypatch):
    _fake_cupy(monkeypatch, count=2)
    assert zerokv.can_run(2) == (False, "cuda:2 does not exist (2 CUDA devices)")


def test_an_older_gpu_names_its_capability_and_the_fallback(monkeypatch):
    _fake_cupy(monkeypatch, capability=(7, 0), name="Tesla V100-SXM2-16GB")
    ok, why = zerokv.can_run(0)
    assert ok is False
    assert "Tesla V100" in why and "7.0" in why and "8.0 or newer" in why and "engine's own kernels" in why


def test_a_supported_gpu(monkeypatch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    _fake_cupy(monkeypatch, capability=(9, 0))
    ok, why = zerokv.can_run("cuda:0")
    assert ok is True and "sm_90" in why and "NVIDIA H200" in why and "NVRTC" in why


def test_no_nvrtc(monkeypatch):
    from cupy_backends.cuda.libs import nvrtc

    _fake_cupy(monkeypatch)

    def missing():
        raise RuntimeError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "getVersion", missing)
    ok, why = zerokv.can_run(0)
    assert ok is False and "NVRTC cannot be loaded" in why and "libnvrtc" in why


def test_rocm_cupy(monkeypatch):
    _fake_cupy(monkeypatch, hip=True)
    ok, why = zerokv.can_run()
    assert ok is False and "ROCm" in why and "AMD" in why


def test_no_driver(monkeypatch):
    _fake_cupy(monkeypatch, fail="cudaErrorInsufficientDriver: CUDA driver version is insufficient")
    assert zerokv.can_run(0) == (
        False,
        "no usable CUDA GPU (cudaErrorInsufficientDriver: CUDA driver version is insufficient)",
    )


def test_no_cupy(monkeypatch):
    monkeypatch.setattr(probe, "installed_cupy_packages", lambda: [])
    monkeypatch.setattr(probe.importlib.util, "find_spec", lambda n, *a: None if n == "cupy" else object())
    ok, why = zerokv.can_run()
    assert ok is False and "CuPy is not installed" in why and "zerokv[cuda13]" in why


def test_both_cupy_packages(monkeypatch):
    monkeypatch.setattr(probe, "installed_cupy_packages", lambda: ["cupy-cuda12x", "cupy-cuda13x"])
    ok, why = zerokv.can_run()
    assert ok is False and "both cupy-cuda12x and cupy-cuda13x" in why and "pip uninstall" in why


def test_both_cupy_packages_is_an_error_at_the_first_gpu_call(monkeypatch):
    from zerokv.core import cupy_packages

    real = cupy_packages.metadata.version
    monkeypatch.setattr(
        cupy_packages.metadata, "version", lambda d: "14.2.0" if d.startswith("cupy-cuda") else real(d)
    )
    monkeypatch.setattr(cupy_packages, "_checked", [])
    with pytest.raises(RuntimeError, match="both cupy-cuda12x and cupy-cuda13x are installed"):
        device.import_cupy()  # where every GPU call, precompile and can_run reach CuPy


def test_it_never_raises(monkeypatch):
    def broken():
        raise OSError("metadata unreadable")

    monkeypatch.setattr(probe, "installed_cupy_packages", broken)
    ok, why = zerokv.can_run()
    assert ok is False and "OSError: metadata unreadable" in why
