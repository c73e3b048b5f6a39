"""``python -m zerokv``: --version, ``compile --arch`` (every supported arch, bad names, a missing
cuda-bindings, a failing instantiation), and the self-check (every op; cached offline compile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import zerokv
from zerokv import selfcheck
from zerokv.__main__ import main
from zerokv.core import cexec
from zerokv.core import kernels as _kernels
from zerokv.core import offline as _offline
from zerokv.core import sources as _sources

pytest.importorskip("cuda.bindings.nvrtc")

# A header edit that breaks exactly the instantiations with an fp8 output.
BROKEN = "if constexpr (is_fp8<T>::value) {"
BREAK = BROKEN + ' static_assert(sizeof(T) != 1, "zerokv_test_broken_fp8");'
# One merge instantiation with a bf16 output, one with an fp8 output.
TWO = [
    next(e for e in _kernels.MERGE_STATE.expressions if e.startswith(f"{_kernels.MERGE_STATE.name}<{t}"))
    for t in ("zk_bfloat16, zk_bfloat16,", "zk_bfloat16, zk_fp8_e4m3,")
]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "zerokv-cache"
    monkeypatch.setenv("ZEROKV_CACHE_DIR", str(d))
    return d


@pytest.fixture
def broken_fp8(tmp_path, monkeypatch):
    """kernels_cu with fp8 outputs broken, and merge reduced to two instantiations."""
    copy = tmp_path / "kernels_cu"
    shutil.copytree(_sources.kernel_dir(), copy)
    header = copy / "common.cuh"
    text = header.read_text()
    assert BROKEN in text
    header.write_text(text.replace(BROKEN, BREAK))
    monkeypatch.setattr(_sources, "kernel_dir", lambda: copy)
    monkeypatch.setattr(_kernels, "instantiations", lambda: {"merge": list(TWO)})
    return copy


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.splitlines()[0] == f"zerokv {zerokv.__version__}"


def test_version_as_a_module():
    res = subprocess.run(
        [sys.executable, "-m", "zerokv", "--version"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == f"zerokv {zerokv.__version__}"


# CI's last step compiles every instantiation for every arch of ``CI_ARCHS``. The default run
# compiles, for the first arch of each family, each kernel's first instantiation of every output
# dtype and its last one (fp8 conversion differs below sm_89: Ampere and Ada are families of
# their own); ZEROKV_TEST_EVERY_ARCH=1 adds the whole compile of every arch here too.
FAMILIES = {
    "ampere": ("sm_80", "sm_86"),
    "ada": ("sm_89",),
    "hopper": ("sm_90",),
    "blackwell": ("sm_100", "sm_120"),
}
EVERY_ARCH = os.environ.get("ZEROKV_TEST_EVERY_ARCH") == "1"


def _representative() -> dict[str, list[str]]:
    """stem -> per kernel, its first instantiation of each output dtype, then its last."""
    chosen: dict[str, list[str]] = {}
    for kernel in _kernels.KERNELS:
        first_by_output: dict[str, str] = {}
        for e in kernel.expressions:
            targs = [a.strip() for a in e.split("<", 1)[1].rstrip(">").split(",")]
            output = next((a for a in targs[1:2] if a.startswith(("zk_", "float"))), targs[0])
            first_by_output.setdefault(output, e)
        picks = [*first_by_output.values(), kernel.expressions[-1]]
        chosen.setdefault(kernel.stem, []).extend(dict.fromkeys(picks))
    return chosen


def _compile_and_check(arch: str, capsys) -> None:
    expected = _kernels.instantiations()
    assert main(["compile", "--arch", arch, "--verbose"]) == 0
    out = capsys.readouterr().out
    total = sum(len(e) for e in expected.values())
    assert f"{arch}: {total} instantiations" in out
    for stem, exprs in expected.items():
        assert f" {stem} " in out and f"{len(exprs)} instantiations" in out
    lowered = {}
    for line in out.splitlines():
        if line.startswith("    "):
            expression, name = line.strip().rsplit(" ", 1)
            lowered[expression.strip()] = name
    assert sorted(lowered) == sorted(e for exprs in expected.values() for e in exprs)
    assert all(name.startswith("_Z") for name in lowered.values()), lowered  # mangled instances
    assert len(set(lowered.values())) == len(lowered)


def test_the_families_cover_every_ci_arch_and_the_subset_every_kernel_and_output():
    assert sorted(a for archs in FAMILIES.values() for a in archs) == sorted(_offline.CI_ARCHS)
    chosen = _representative()
    assert set(chosen) == set(_kernels.instantiations())
    for kernel in _kernels.KERNELS:
        picked = [e for e in chosen[kernel.stem] if e.startswith(f"{kernel.name}<")]
        assert picked[0] == kernel.expressions[0] and picked[-1] == kernel.expressions[-1]
        if any("zk_fp8_e4m3" in e for e in kernel.expressions):
            assert any("zk_fp8_e4m3" in e for e in picked), kernel.name
    assert sum(map(len, chosen.values())) < sum(map(len, _kernels.instantiations().values())) // 8


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compile_representative_instantiations_for(family, capsys, monkeypatch):
    chosen = _representative()
    monkeypatch.setattr(_kernels, "instantiations", lambda: chosen)
    _compile_and_check(FAMILIES[family][0], capsys)  # the family's first arch


if EVERY_ARCH:  # defined only when asked for: a parametrised test with no arch would skip

    @pytest.mark.parametrize("arch", _offline.CI_ARCHS)
    def test_compile_every_instantiation_for(arch, capsys):
        _compile_and_check(arch, capsys)


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        ("sm_1", "sm_1: zerokv needs sm_80 or newer"),
        ("sm_75", "sm_75: zerokv needs sm_80 or newer"),
        ("hopper", "'hopper' is not an arch name"),
        ("sm_90,sm_7x", "'sm_7x' is not an arch name"),
        ("sm_999", "sm_999: NVRTC"),
    ],
)
def test_bad_arch_is_refused_before_compiling(arch, message, capsys, monkeypatch):
    monkeypatch.setattr(_offline, "compile_stem", lambda *a, **k: pytest.fail("compiled"))
    assert main(["compile", "--arch", arch]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "valid: sm_80, sm_86" in err and "sm_90" in err and "sm_120" in err
    assert "Traceback" not in err


def _hide_cuda_bindings(monkeypatch):
    import cuda.bindings

    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # `import` now raises ImportError
    monkeypatch.delattr(cuda.bindings, "nvrtc", raising=False)


def test_without_cuda_bindings_cupys_nvrtc_compiles_the_same(cache_dir, monkeypatch):
    exprs = _kernels.instantiations()["empty_rows"][:2]
    with_bindings = _offline.compile_stem("empty_rows", "sm_90", exprs=exprs, cache=False)
    _hide_cuda_bindings(monkeypatch)
    from zerokv.core.cupy_nvrtc import CupyNvrtc

    assert isinstance(_offline.nvrtc(), CupyNvrtc)
    assert _offline.nvrtc_version() == tuple(
        int(v) for v in __import__("cupy_backends.cuda.libs.nvrtc", fromlist=["x"]).getVersion()
    )
    through_cupy = _offline.compile_stem("empty_rows", "sm_90", exprs=exprs, cache=False)
    assert [r.lowered_name for r in through_cupy] == [r.lowered_name for r in with_bindings]
    assert "sm_90a" in _offline.accepted_archs()
    with pytest.raises(_offline.CompileError, match="zerokv_not_a_type"):
        _offline._compile_or_raise("zerokv_not_a_type x;", "x.cu", [], "sm_90", "x")


def test_missing_cuda_bindings_gives_the_install_command(capsys, monkeypatch):
    _hide_cuda_bindings(monkeypatch)
    import cupy_backends.cuda.libs

    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", None)  # nor CuPy's NVRTC
    monkeypatch.delattr(cupy_backends.cuda.libs, "nvrtc", raising=False)
    with pytest.raises(ImportError, match="pip install 'cuda-bindings"):
        _offline.nvrtc()
    assert main(["compile", "--arch", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert "needs cuda-bindings: pip install 'cuda-bindings>=" in err
    assert "zerokv[cuda1" in err
    assert main(["compile", "--arch", "sm_1"]) == 2  # the name is still checked, from a fixed list
    assert "valid: sm_80, sm_86, sm_89, sm_90, sm_100, sm_120" in capsys.readouterr().err


def test_missing_nvrtc_library_gives_the_install_command(capsys, monkeypatch):
    class NoLibrary:
        def nvrtcVersion(self):
            raise RuntimeError('Failure finding "libnvrtc.so.13":\nNo such file')

    monkeypatch.setattr(_offline, "nvrtc", lambda: NoLibrary())
    assert main(["compile", "--arch", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert "NVRTC library cannot be loaded" in err and "pip install 'nvidia-cuda-nvrtc" in err
    monkeypatch.setattr(selfcheck, "gpu_available", lambda: False)
    assert selfcheck.main() == 1  # an install that cannot compile anything is not ok
    assert "NVRTC library cannot be loaded" in capsys.readouterr().out


def test_a_failing_instantiation_is_named_in_one_line(broken_fp8, cache_dir, capsys):
    assert main(["compile", "--arch", "sm_90"]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "merge_state_kernel<" in line]
    assert len(lines) == 1, out
    assert TWO[1] in lines[0] and "zerokv_test_broken_fp8" in lines[0] and "sm_90" in lines[0]
    assert "FAILED: 1 instantiations (--verbose shows NVRTC's log)" in out
    assert len(out.splitlines()) <= 4, out  # no log without --verbose


def test_verbose_shows_the_log(broken_fp8, cache_dir, capsys):
    assert main(["compile", "--arch", "sm_90", "--verbose"]) == 1
    out = capsys.readouterr().out
    assert "merge.cu(" in out and "error" in out
    assert out.count("zerokv_test_broken_fp8") >= 2  # the summary line and the log


def test_compile_error_names_only_the_failing_instantiations(broken_fp8, cache_dir):
    with pytest.raises(_offline.CompileError, match="NVRTC compile of merge.cu failed") as info:
        _offline.compile_stem("merge", "sm_80")
    assert [e for e, _ in info.value.failing] == [TWO[1]]
    assert "merge.cu(" in info.value.log


def test_an_error_outside_templates_is_one_line_for_every_instantiation(tmp_path, cache_dir, monkeypatch):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(_sources.kernel_dir(), copy)
    (copy / "common.cuh").write_text((copy / "common.cuh").read_text() + "\nzerokv_not_a_type x;\n")
    monkeypatch.setattr(_sources, "kernel_dir", lambda: copy)
    with pytest.raises(_offline.CompileError) as info:
        _offline.compile_stem("empty_rows", "sm_90")
    (only,) = info.value.failing
    n = len(_kernels.instantiations()["empty_rows"])
    assert only[0] == f"every instantiation ({n})" and "zerokv_not_a_type" in only[1]


def test_second_compile_comes_from_the_cache(cache_dir, monkeypatch):
    exprs = _kernels.instantiations()["empty_rows"][:2]
    monkeypatch.setattr(_kernels, "instantiations", lambda: {"empty_rows": exprs})
    first = _offline.compile_stem("empty_rows", "sm_86")
    assert not any(r.cached for r in first)

    def refuse(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(_offline, "_compile", refuse)
    second = _offline.compile_stem("empty_rows", "sm_86")
    assert all(r.cached for r in second)
    assert [(r.expression, r.lowered_name, r.cubin_bytes) for r in second] == [
        (r.expression, r.lowered_name, r.cubin_bytes) for r in first
    ]
    with pytest.raises(AssertionError, match="compiled again"):  # another arch: another entry
        _offline.compile_stem("empty_rows", "sm_89")


def test_an_edited_source_is_compiled_again(cache_dir, monkeypatch, tmp_path):
    exprs = _kernels.instantiations()["empty_rows"][:1]
    monkeypatch.setattr(_kernels, "instantiations", lambda: {"empty_rows": exprs})
    copy = tmp_path / "kernels_cu"
    shutil.copytree(_sources.kernel_dir(), copy)
    assert not _offline.compile_stem("empty_rows", "sm_90", directory=copy)[0].cached
    assert _offline.compile_stem("empty_rows", "sm_90", directory=copy)[0].cached
    (copy / "common.cuh").write_text((copy / "common.cuh").read_text() + "\n// a comment changes the key\n")
    assert not _offline.compile_stem("empty_rows", "sm_90", directory=copy)[0].cached


def test_unwritable_cache_warns_once_and_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ZEROKV_CACHE_DIR", str(blocker / "cache"))  # under a file: never creatable
    exprs = _kernels.instantiations()["empty_rows"][:1]
    monkeypatch.setattr(_kernels, "instantiations", lambda: {"empty_rows": exprs})
    from zerokv.core import disk_cache as _cache

    monkeypatch.setattr(_cache, "_warned", set())
    with pytest.warns(RuntimeWarning, match="cannot write its cache") as record:
        assert _offline.compile_stem("empty_rows", "sm_90")[0].lowered_name
        assert _offline.compile_stem("empty_rows", "sm_90")[0].lowered_name
    assert len([w for w in record if "cannot write its cache" in str(w.message)]) == 1


# --- the self-check ---------------------------------------------------------------------------


def test_selfcheck_cpu_covers_every_op():
    rows = selfcheck.run_cpu()
    assert [r.op for r in rows] == ["merge_state", "merge_states", "fixup_zero_kv_rows", "mask_empty_context"]
    assert all(r.ok() for r in rows), [str(r) for r in rows]


def test_selfcheck_without_a_gpu_reuses_compiled_kernels(cache_dir, monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "gpu_available", lambda: False)
    exprs = {stem: e[:1] for stem, e in _kernels.instantiations().items()}
    monkeypatch.setattr(_kernels, "instantiations", lambda: exprs)
    n = len(exprs) * len(selfcheck.OFFLINE_ARCHS)
    assert selfcheck.main() == 0
    first = capsys.readouterr().out
    assert f"compiled {n} kernel instantiations" in first and "(0 from the cache)" in first
    assert selfcheck.main() == 0
    second = capsys.readouterr().out
    assert f"({n} from the cache)" in second
    assert second.rstrip().endswith("ok")


def test_selfcheck_fails_on_a_compile_error(broken_fp8, cache_dir, monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "gpu_available", lambda: False)
    assert selfcheck.main() == 1
    out = capsys.readouterr().out
    assert TWO[1] in out and out.rstrip().endswith("FAILED")


def test_selfcheck_warns_about_two_cupy_packages(monkeypatch):
    real = selfcheck._dist
    monkeypatch.setattr(selfcheck, "_dist", lambda d: "14.2.0" if d.startswith("cupy-cuda") else real(d))
    line, warnings = selfcheck.environment()
    assert "cupy-cuda12x 14.2.0" in line and "cupy-cuda13x 14.2.0" in line
    assert len(warnings) == 1 and "pip uninstall -y cupy-cuda12x cupy-cuda13x" in warnings[0]


# --- the offline cache when damaged or read-only ----------------------------------------------


def _one_stem(monkeypatch, n=1):
    exprs = _kernels.instantiations()["empty_rows"][:n]
    monkeypatch.setattr(_kernels, "instantiations", lambda: {"empty_rows": exprs})


@pytest.mark.parametrize("part", ["json-truncated", "json-foreign", "cubin-truncated", "cubin-missing"])
def test_a_damaged_offline_entry_is_rebuilt_with_one_warning(cache_dir, monkeypatch, part):
    from zerokv.core import disk_cache as _cache

    _one_stem(monkeypatch)
    first = _offline.compile_stem("empty_rows", "sm_90")
    (entry,) = [
        p for p in (cache_dir / "offline").iterdir() if p.suffix == (".json" if "json" in part else ".cubin")
    ]
    if part == "json-truncated":
        entry.write_bytes(entry.read_bytes()[:20])
    elif part == "json-foreign":
        entry.write_text('{"something": "else"}')
    elif part == "cubin-truncated":
        entry.write_bytes(entry.read_bytes()[:500])
    else:
        entry.unlink()
    monkeypatch.setattr(_cache, "_warned", set())
    with pytest.warns(RuntimeWarning, match="rebuilding it") as record:
        again = _offline.compile_stem("empty_rows", "sm_90")
    assert len(record) == 1 and not again[0].cached
    assert [r.lowered_name for r in again] == [r.lowered_name for r in first]
    assert _offline.compile_stem("empty_rows", "sm_90")[0].cached  # the rebuilt entry serves again


def test_a_read_only_offline_cache_is_read_and_warns_once_for_new_work(cache_dir, monkeypatch):
    from zerokv.core import disk_cache as _cache

    _one_stem(monkeypatch)
    _offline.compile_stem("empty_rows", "sm_90")

    def read_only(path, data):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(_cache, "write_atomic", read_only)
    monkeypatch.setattr(_cache, "_warned", set())
    assert _offline.compile_stem("empty_rows", "sm_90")[0].cached  # entries there: used, no warning
    with pytest.warns(RuntimeWarning, match="cannot write its cache") as record:
        assert not _offline.compile_stem("empty_rows", "sm_86")[0].cached
        assert not _offline.compile_stem("empty_rows", "sm_89")[0].cached
    assert len(record) == 1


# --- honest commands --------------------------------------------------------------------------


def _help(args) -> str:
    with pytest.raises(SystemExit) as info:
        main([*args, "--help"])
    assert info.value.code == 0
    return info.value


def test_compile_help_is_plain_text_and_lists_every_accepted_arch(capsys):
    _help(["compile"])
    text = " ".join(capsys.readouterr().out.split())
    assert "``" not in text and ":func:" not in text
    assert "default: sm_90" in text
    for arch in _offline.accepted_archs():  # every name this NVRTC accepts is in the help
        assert arch in text, arch
    assert "--out" in text and "ZEROKV_KERNEL_DIR" in text and "--dtypes" in text and "--ops" in text
    _help([])
    top = capsys.readouterr().out
    assert "``" not in top and "compile" in top


def test_list_archs_prints_what_check_arch_accepts(capsys):
    assert main(["compile", "--list-archs"]) == 0
    names = capsys.readouterr().out.split()
    assert "sm_90a" in names and "sm_80" in names and "sm_75" not in names
    for name in names:
        assert _offline.check_arch(name) == name
    for name in ("sm_90f", "sm_80a"):  # variants NVRTC refuses are refused by name
        with pytest.raises(_offline.ArchError, match="cannot compile for it"):
            _offline.check_arch(name)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ops", "merge"], "--ops: 'merge' is not an op"),
        (["--dtypes", "int8"], "--dtypes: 'int8' is not supported"),
    ],
)
def test_bad_ops_or_dtypes_are_one_line(args, message, capsys, monkeypatch):
    monkeypatch.setattr(_offline, "compile_stem", lambda *a, **k: pytest.fail("compiled"))
    assert main(["compile", "--arch", "sm_90", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["compile", "--help"]])
def test_version_and_help_import_neither_torch_nor_cupy(args):
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "zerokv", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "zerokv" in imported  # the report is real
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "cupy", "cupy_backends", "cuda")}
    assert not heavy, sorted(heavy)[:5]


def test_compile_out_with_a_selection(tmp_path, cache_dir, capsys):
    out = tmp_path / "kernels"
    assert (
        main(
            [
                "compile",
                "--arch",
                "sm_80",
                "--ops",
                "mask_empty_context",
                "--dtypes",
                "float16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"set ZEROKV_KERNEL_DIR={out}" in text
    import json

    meta = json.loads((out / "empty_rows-sm_80.json").read_text())
    rules = {e.split("<")[1].rstrip(">").split(", ")[2] for e in meta["expressions"]}
    assert rules == {str(_kernels.RULE_CONTEXT_SPAN_EMPTY)}
    assert all(e.startswith(f"{_kernels.EMPTY_ROWS.name}<zk_half,") for e in meta["expressions"]), meta
    launcher = cexec.file_name(False)  # the compiled executor, built beside the kernels where it builds
    built_launcher = [launcher, launcher + ".sha256"] if cexec.load()[0] is not None else []
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["empty_rows-sm_80.cubin", "empty_rows-sm_80.json"] + built_launcher
    )


def test_compile_out_builds_the_launcher_an_image_without_a_compiler_loads(tmp_path, capsys):
    """``compile --out`` puts the compiled executor beside the kernels; a process with that
    directory, no C compiler (``CC`` a failing program) and an empty cache runs on it."""
    out = tmp_path / "image"
    args = [
        "compile",
        "--arch",
        "sm_90",
        "--ops",
        "fixup_zero_kv_rows",
        "--dtypes",
        "bfloat16",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    assert "launcher: launcher-" in capsys.readouterr().out
    env = dict(os.environ, ZEROKV_KERNEL_DIR=str(out), CC="false", ZEROKV_CACHE_DIR=str(tmp_path / "empty"))
    env.pop("ZEROKV_LAUNCHER", None)
    code = "import zerokv; name, why = zerokv.launcher(); print(name); print(why)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    name, why = res.stdout.splitlines()[:2]
    assert name == "c" and str(out) in why, res.stdout
    env.pop("ZEROKV_KERNEL_DIR")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.splitlines()[0] == "python", res.stdout + res.stderr
