"""``python -m zerokv`` checks something on the CPU: a broken reference (which the CPU path runs)
makes it exit non-zero; with neither a GPU nor NVRTC it fails in one line saying what to
install; without CuPy it makes no CuPy cache directory."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from zerokv import reference, selfcheck
from zerokv.__main__ import main
from zerokv.core import offline

REAL_MERGE = reference.merge_states


def _plus_inf_usable(v, s, *args, **kw):
    """An LSE of +inf counted as a usable state (of LSE 0)."""
    return REAL_MERGE(v, np.where(np.isposinf(s), 0.0, s), *args, **kw)


def _v_swapped(v, s, *args, **kw):
    """The inputs' V in the wrong order (for two inputs: a's and b's swapped)."""
    return REAL_MERGE(np.asarray(v)[::-1], s, *args, **kw)


def _empty_v_times_zero(v, s, *args, **kw):
    """An empty input's V multiplied by 0 instead of selected away: its NaN garbage shows."""
    out, lse = REAL_MERGE(v, s, *args, **kw)
    v, s = np.asarray(v, dtype=np.float64), np.asarray(s, dtype=np.float64)
    leaked = (np.isinf(s)[..., None] & ~np.isfinite(v)).any(axis=0)
    return np.where(leaked, np.nan, out), lse


def _base_ignored(v, s, lse_base="e", *args, **kw):
    """Every LSE read as natural logs."""
    return REAL_MERGE(v, s, "e", *args, **kw)


@pytest.fixture
def cpu_only(monkeypatch):
    """No GPU and an offline compile that passes: only the CPU rows decide."""
    monkeypatch.setattr(selfcheck, "gpu_available", lambda: False)
    monkeypatch.setattr(selfcheck, "offline_compile", lambda quiet=False: ("compiled (stand-in)", True))


def test_the_selfcheck_passes_with_the_real_reference(cpu_only, capsys):
    assert main([]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")


@pytest.mark.parametrize("broken", [_plus_inf_usable, _v_swapped, _empty_v_times_zero, _base_ignored])
def test_a_broken_reference_fails_the_selfcheck(broken, cpu_only, monkeypatch, capsys):
    monkeypatch.setattr(reference, "merge_states", broken)
    assert main([]) != 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "merge_state" in out.split("FAILED")[1], out


def test_a_broken_fixup_rule_fails_the_selfcheck(cpu_only, monkeypatch, capsys):
    monkeypatch.setattr(reference, "zero_kv_requests", lambda kv: np.asarray(kv) <= 1)
    assert main([]) != 0
    assert "fixup_zero_kv_rows" in capsys.readouterr().out.split("FAILED")[1]


def test_with_nothing_to_check_on_a_gpu_path_it_fails_saying_what_to_install(monkeypatch, capsys):
    def no_bindings():
        raise ImportError(f"compiling without a GPU needs cuda-bindings: {offline.install_hint()}")

    monkeypatch.setattr(selfcheck, "gpu_available", lambda: False)
    monkeypatch.setattr(offline, "nvrtc", no_bindings)
    assert main([]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAILED:")]
    assert len(failed) == 1 and "pip install" in failed[0], failed


def test_without_cupy_no_cupy_cache_directory_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cupy-cache"))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a)
    )
    assert selfcheck.gpu_available() is False
    assert list(tmp_path.iterdir()) == []
