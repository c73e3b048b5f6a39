"""Kernels built ahead of time: ``compile --out DIR`` on a machine without a GPU, served by
``ZEROKV_KERNEL_DIR=DIR`` with no NVRTC work (on the GPU: a fresh process, its first call eager,
or ``precompile`` then a CUDA graph captured and replayed); every entry that does not match
this zerokv is refused with one warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerokv.__main__ import main
from zerokv.core import cexec
from zerokv.core import compiler as _compiler
from zerokv.core import device as _device
from zerokv.core import disk_cache as _cache
from zerokv.core import kernels as _kernels
from zerokv.core import offline as _offline
from zerokv.core import prebuilt as _prebuilt
from zerokv.core import sources as _sources

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")  # NVRTC: cuda-bindings, else CuPy's bindings

ROOT = Path(__file__).resolve().parent.parent
# one empty-rows instantiation pair: small enough to compile in a second or two
FEW = ["--ops", "fixup_zero_kv_rows", "--dtypes", "float32"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_cache, "_warned", set())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A kernel directory for sm_90 built by the CLI (as an image build would)."""
    out = tmp_path_factory.mktemp("kernels")
    assert main(["compile", "--arch", "sm_90", *FEW, "--out", str(out)]) == 0
    return out


def _entry(built: Path) -> tuple[str, str, list[str]]:
    code = _sources.source("empty_rows")
    return code, "sm_90", _offline.options("sm_90")


def test_compile_out_writes_a_record_and_its_binary(built):
    launcher = cexec.file_name(False)  # the compiled executor, built beside the kernels where it builds
    built_launcher = [launcher, launcher + ".sha256"] if cexec.load()[0] is not None else []
    assert sorted(p.name for p in built.iterdir()) == sorted(
        ["empty_rows-sm_90.cubin", "empty_rows-sm_90.json"] + built_launcher
    )
    meta = json.loads((built / "empty_rows-sm_90.json").read_text())
    cubin = (built / "empty_rows-sm_90.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF"  # a real cubin, not a placeholder
    assert meta["cubin_sha256"] == _prebuilt.sha256(cubin)
    assert meta["source_sha256"] == _prebuilt.sha256(_sources.source("empty_rows"))
    assert meta["nvrtc"] == list(_offline.nvrtc_version())
    assert meta["options"] == _offline.options("sm_90")
    rule = [e.split("<")[1].rstrip(">").split(", ")[2] for e in meta["expressions"]]  # the emptiness rule
    assert meta["expressions"] and set(meta["expressions"]) <= set(_kernels.EMPTY_ROWS.expressions)
    assert all("<float," in e for e in meta["expressions"]), meta["expressions"]  # --dtypes float32 only
    assert len(meta["lowered"]) == len(meta["expressions"]) and set(rule) == {str(_kernels.RULE_KV_LENS_ZERO)}
    assert all(name.startswith("_Z") for name in meta["lowered"])  # NVRTC's lowered (mangled) names
    assert oct((built / "empty_rows-sm_90.cubin").stat().st_mode & 0o777) == "0o644"  # readable by all


def test_a_matching_entry_is_read(built):
    code, arch, opts = _entry(built)
    entry = _prebuilt._read(built, "empty_rows", arch, code, opts)
    meta = json.loads((built / "empty_rows-sm_90.json").read_text())
    assert entry is not None and entry["names"] == dict(
        zip(meta["expressions"], meta["lowered"], strict=True)
    )


def _copy(built: Path, tmp_path: Path) -> Path:
    d = tmp_path / "copy"
    d.mkdir()
    for p in built.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    return d


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda d: (d / "empty_rows-sm_90.cubin").write_bytes(
                (d / "empty_rows-sm_90.cubin").read_bytes()[:999]
            ),
            "truncated or corrupt",
        ),
        (
            lambda d: (d / "empty_rows-sm_90.cubin").write_bytes(b"\x7fELF" + os.urandom(64)),
            "truncated or corrupt",
        ),
        (lambda d: (d / "empty_rows-sm_90.cubin").unlink(), "cannot be read"),
        (
            lambda d: (d / "empty_rows-sm_90.json").write_text('{"format": 1, "stem": "empty_r'),
            "not a zerokv kernel record",
        ),
        (lambda d: (d / "empty_rows-sm_90.json").write_bytes(os.urandom(200)), "not a zerokv kernel record"),
        (
            lambda d: (d / "empty_rows-sm_90.json").write_text('["a", "foreign", "file"]'),
            "not a zerokv kernel record",
        ),
    ],
    ids=[
        "truncated-cubin",
        "corrupt-cubin",
        "missing-cubin",
        "truncated-record",
        "random-record",
        "foreign-record",
    ],
)
def test_a_damaged_entry_is_refused_with_one_warning(built, tmp_path, damage, message):
    d = _copy(built, tmp_path)
    damage(d)
    code, arch, opts = _entry(built)
    with pytest.warns(RuntimeWarning, match=message) as record:
        assert _prebuilt._read(d, "empty_rows", arch, code, opts) is None
        assert _prebuilt._read(d, "empty_rows", arch, code, opts) is None
    assert len(record) == 1 and "compiling instead" in str(record[0].message)


@pytest.mark.parametrize("what", ["source", "options", "nvrtc"])
def test_an_entry_of_another_build_is_refused_with_one_warning(built, tmp_path, monkeypatch, what):
    d = _copy(built, tmp_path)
    code, arch, opts = _entry(built)
    if what == "source":
        code += "\n// edited\n"
    elif what == "options":
        opts = [*opts, "-lineinfo"]
    else:
        major, minor = _offline.nvrtc_version()
        monkeypatch.setattr(_prebuilt, "_runtime_nvrtc", lambda: (major, minor + 1))
    with pytest.warns(RuntimeWarning, match="compiling instead") as record:
        assert _prebuilt._read(d, "empty_rows", arch, code, opts) is None
        assert _prebuilt._read(d, "empty_rows", arch, code, opts) is None
    assert len(record) == 1


def test_the_runtime_nvrtc_version_is_the_offline_one():
    """The key's toolkit part: CuPy's NVRTC (run time) and cuda-bindings' (offline) agree here."""
    assert _prebuilt._runtime_nvrtc() == _offline.nvrtc_version()


def test_without_the_variable_nothing_is_looked_up(monkeypatch, built):
    monkeypatch.delenv(_prebuilt.ENV, raising=False)
    assert _prebuilt.load("empty_rows", _sources.source("empty_rows"), "x", 0, (9, 0)) is None
    monkeypatch.setenv(_prebuilt.ENV, str(built))
    probe = _kernels.Kernel(stem="probe", name="k", instances=((1,),), block=32, params=(), code="x")
    assert _compiler._load_prebuilt(probe, "k<1>", 0) is None  # kernels with their own code: never


def test_archs_a_gpu_runs():
    assert _prebuilt.archs_for((9, 0)) == ("sm_90", "sm_90a", "sm_90f")


def test_concurrent_builds_into_one_directory_both_succeed(tmp_path):
    """Two processes writing the same kernel directory at once: both exit 0, the entry is whole."""
    out = tmp_path / "kernels"
    cmd = [
        sys.executable,
        "-m",
        "zerokv",
        "compile",
        "--arch",
        "sm_89",
        *FEW,
        "--out",
        str(out),
        "--no-cache",
    ]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    code = _sources.source("empty_rows")
    assert _prebuilt._read(out, "empty_rows", "sm_89", code, _offline.options("sm_89")) is not None
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


# --- on the GPU: a fresh process loads them with zero NVRTC compiles --------------------------

CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("always")
    record = warnings.catch_warnings(record=True)
    caught = record.__enter__()
    import torch
    from cupy_backends.cuda.libs import nvrtc
    calls = []
    real = nvrtc.compileProgram
    def counting(*args):
        calls.append(1)
        return real(*args)
    nvrtc.compileProgram = counting   # CuPy's compiler calls it through the module: every NVRTC compile
    import zerokv
    from zerokv import reference
    from zerokv.core import compiler, prebuilt
    capture = sys.argv[1] == "capture"
    T, H, D = 37, 4, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    out = torch.full((T, H, D), float("nan"), device="cuda")
    lse = torch.randn(T, H, device="cuda", generator=g)
    kv_lens = torch.tensor([0, 5, 0, 2], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 9, 20, 30, 37], dtype=torch.int32, device="cuda")
    before = out.clone(), lse.clone()
    if capture:  # an engine's start: precompile (from the directory), then capture and replay
        n = zerokv.precompile(dtypes=("float32",), ops=("fixup_zero_kv_rows",))
        assert n >= 1 and prebuilt.loaded == n, (n, prebuilt.loaded)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            zerokv.fixup_zero_kv_rows(out, lse, kv_lens, cu)
        out.copy_(before[0]); lse.copy_(before[1])
        graph.replay()
    else:
        zerokv.fixup_zero_kv_rows(out, lse, kv_lens, cu)
    torch.cuda.synchronize()
    want_out, want_lse = reference.fixup_zero_kv_rows(before[0].cpu().numpy(), before[1].cpu().numpy(),
                                                        kv_lens.cpu().numpy(), cu.cpu().numpy())
    import numpy as np
    ok = bool(np.array_equal(out.cpu().numpy(), want_out, equal_nan=True)
              and np.array_equal(lse.cpu().numpy(), want_lse, equal_nan=True))
    print(json.dumps({"nvrtc_compiles": len(calls), "modules_built": compiler._modules_built,
                      "from_dir": prebuilt.loaded, "correct": ok,
                      "zerokv_warnings": [str(w.message) for w in caught if "zerokv" in str(w.message)]}))
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "capture"])
def test_a_fresh_process_loads_the_directory_with_no_compile(tmp_path, mode):
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    out = tmp_path / "kernels"
    assert main(["compile", "--arch", arch, *FEW, "--out", str(out)]) == 0
    env = dict(os.environ, ZEROKV_KERNEL_DIR=str(out), CUPY_CACHE_DIR=str(tmp_path / "empty-cupy-cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["correct"] and got["from_dir"] >= 1 and got["zerokv_warnings"] == [], got
    assert (got["nvrtc_compiles"], got["modules_built"]) == (0, 0), got


# --- the run-time hook, with a stand-in for the driver (CPU) ----------------------------------


class _FakeModule:
    loads: list[bytes] = []

    def load(self, cubin):
        _FakeModule.loads.append(cubin)

    def get_function(self, name):
        import types

        return types.SimpleNamespace(ptr=0x1000 + len(name))


@pytest.fixture
def fake_gpu(monkeypatch, built):
    """compiler.function() on a pretend sm_90 device: module loads recorded, compiles refused."""
    import contextlib
    import types

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            function=types.SimpleNamespace(Module=_FakeModule), Device=lambda d: contextlib.nullcontext()
        )
    )
    monkeypatch.setattr(_device, "import_cupy", lambda: fake)
    monkeypatch.setattr(_device, "capability", lambda d: (9, 0))
    monkeypatch.setattr(_device, "check_device", lambda d: None)
    compiled = []
    monkeypatch.setattr(
        _compiler, "_build", lambda code, expr, dev: compiled.append(expr) or _compiler.Loaded(None, 7)
    )
    monkeypatch.setattr(_compiler, "_functions", {})
    monkeypatch.setattr(_prebuilt, "_modules", {})
    monkeypatch.setattr(_FakeModule, "loads", [])
    monkeypatch.setenv(_prebuilt.ENV, str(built))
    return compiled


def test_the_runtime_serves_a_built_instantiation_from_the_directory(fake_gpu, built):
    meta = json.loads((built / "empty_rows-sm_90.json").read_text())
    before = _prebuilt.loaded
    for expr in meta["expressions"]:
        fn = _compiler.function(_kernels.EMPTY_ROWS, expr, 0)
        assert fn.ptr == 0x1000 + len(meta["lowered"][meta["expressions"].index(expr)])
    assert fake_gpu == []  # nothing compiled
    assert _FakeModule.loads == [(built / "empty_rows-sm_90.cubin").read_bytes()]  # one module load
    assert _prebuilt.loaded - before == len(meta["expressions"])


def test_an_instantiation_not_built_compiles_with_one_warning(fake_gpu, built):
    meta = json.loads((built / "empty_rows-sm_90.json").read_text())
    missing = [e for e in _kernels.EMPTY_ROWS.expressions if e not in meta["expressions"]][:2]
    with pytest.warns(RuntimeWarning, match="was not built into it") as record:
        for expr in missing:
            assert _compiler.function(_kernels.EMPTY_ROWS, expr, 0).ptr == 7
    assert fake_gpu == missing and len(record) == 1


def test_another_arch_compiles_with_one_warning(fake_gpu, monkeypatch):
    monkeypatch.setattr(_device, "capability", lambda d: (8, 6))
    exprs = _kernels.EMPTY_ROWS.expressions[:2]
    with pytest.warns(RuntimeWarning, match="no usable binaries of empty_rows for sm_86") as record:
        for expr in exprs:
            _compiler.function(_kernels.EMPTY_ROWS, expr, 0)
    assert fake_gpu == exprs and len(record) == 1 and _FakeModule.loads == []
