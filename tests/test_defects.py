"""Rough edges a newcomer met, each held here: the image-build figures the docs state, the
self-check with an unwritable home, can_run's reasons, no CuPy cache directory made without a
GPU, empty --dtypes/--ops, a second compile --out into one directory, the accepted lse_base and
prefix_rows values, the adapters' +inf rule, the cache directory in compile --help, --version,
and the messages of plan_context_chunks and torch.ops.zerokv for hostile inputs."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import zerokv
from zerokv.__main__ import _selection, main, parser
from zerokv.compat import sglang, vllm
from zerokv.core import offline, probe

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
INTEGRATING = (ROOT / "docs" / "integrating.md").read_text()
ADAPTERS = (ROOT / "docs" / "adapters.md").read_text()


def _run(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter from the repository root, with ``env`` over a clean one."""
    base = {k: v for k, v in os.environ.items() if k not in ("CUPY_CACHE_DIR", "XDG_CACHE_HOME")}
    base.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Prepended to a child's code: the NVIDIA driver library cannot be loaded (a machine without a
# GPU, whatever this one has), and the offline compile reduced to one instantiation per arch.
NO_DRIVER = """
import ctypes
_real_cdll = ctypes.CDLL
def _cdll(name, *a, **k):
    if str(name).startswith("libcuda.so"):
        raise OSError(f"{name}: cannot open shared object file")
    return _real_cdll(name, *a, **k)
ctypes.CDLL = _cdll
"""
ONE_KERNEL = """
from zerokv.core import kernels as _kernels
_one = {"empty_rows": _kernels.instantiations()["empty_rows"][:1]}
_kernels.instantiations = lambda: _one
"""


# --- 1. the image-build figures the docs state ---------------------------------------------------


def _image_build_count() -> int:
    """How many instantiations the README's image-build line builds, per the CLI's selection."""
    section = README[README.index("## Kernels built into an image") :]
    line = next(ln for ln in section.splitlines() if ln.startswith("python -m zerokv compile"))
    args = parser().parse_args(shlex.split(line.split("#")[0])[3:])
    dtypes = args.dtypes.split(",") if args.dtypes else None
    ops = args.ops.split(",") if args.ops else None
    chosen = _selection(dtypes, ops) or offline.selected()
    return sum(len(e) for e in chosen.values()) * len(args.arch.split(","))


def test_the_readme_states_how_many_instantiations_its_image_lines_build():
    stated = re.search(r"The lines above build (\d+) instantiations", README)
    assert stated, "the README no longer states what its image-build lines build"
    assert int(stated.group(1)) == _image_build_count()


def test_integrating_states_the_same_count_for_its_bf16_and_fp32_build():
    stated = re.search(r"for the (\d+) bf16 \+ fp32 instantiations of sm_90", INTEGRATING)
    assert stated and int(stated.group(1)) == _image_build_count()


# --- 2. the self-check with a home directory that cannot be written ------------------------------


def test_the_selfcheck_without_a_gpu_needs_no_writable_home(tmp_path):
    """HOME under a regular file: nothing can be created there. Without a GPU the self-check
    compiles with one warning about its cache, as `compile` does, and passes: no traceback."""
    (tmp_path / "file").write_text("")
    res = _run(
        NO_DRIVER + ONE_KERNEL + "import sys, zerokv.selfcheck as s; sys.exit(s.main(quiet=True))",
        {"HOME": str(tmp_path / "file" / "home"), "ZEROKV_CACHE_DIR": str(tmp_path / "file" / "zk")},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stdout.rstrip().endswith("ok")
    assert res.stderr.count("cannot write its cache") == 1, res.stderr


def test_the_selfcheck_with_a_gpu_and_an_unwritable_cupy_cache_fails_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    res = _run(
        "import sys, zerokv.selfcheck as s\n"
        "from zerokv.core import probe\n"
        "probe.driver_devices = lambda: (1, '')  # the driver sees a GPU\n"
        "sys.exit(s.main(quiet=True))",
        {"HOME": str(tmp_path / "file" / "home")},
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    failed = [line for line in res.stdout.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 1 and "CUPY_CACHE_DIR" in failed[0], res.stdout


def test_can_run_blames_the_cache_directory_not_cupys_import(tmp_path):
    (tmp_path / "file").write_text("")
    res = _run(
        "from zerokv.core import probe\n"
        "probe.driver_devices = lambda: (1, '')  # the driver sees a GPU\n"
        "print(probe.can_run())",
        {"HOME": str(tmp_path / "file" / "home")},
    )
    assert res.returncode == 0, res.stderr
    assert "False" in res.stdout and "CUPY_CACHE_DIR" in res.stdout, res.stdout
    assert "CuPy cannot be imported" not in res.stdout, res.stdout


# --- 3. can_run's reasons -------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "gpu", 1.5, -1, "cuda:x", True], ids=lambda d: f"device={d!r}")
def test_can_run_names_a_bad_device_argument(device):
    ok, why = zerokv.can_run(device)
    assert ok is False and repr(device) in why, why
    assert "not a CUDA device" in why or "negative" in why, why


def _no_libcuda(monkeypatch):
    real = ctypes.CDLL

    def cdll(name, *a, **k):
        if str(name).startswith("libcuda.so"):
            raise OSError(f"{name}: cannot open shared object file")
        return real(name, *a, **k)

    monkeypatch.setattr(ctypes, "CDLL", cdll)


def test_without_a_driver_can_run_says_so(monkeypatch):
    _no_libcuda(monkeypatch)
    ok, why = zerokv.can_run()
    assert ok is False and "no NVIDIA driver" in why and "Insufficient" not in why, why


def test_a_driver_that_sees_no_device(monkeypatch):
    class NoDevice:
        def cuInit(self, flags):
            return 100  # CUDA_ERROR_NO_DEVICE

    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: NoDevice())
    assert probe.driver_devices() == (0, "no CUDA GPU: the NVIDIA driver sees no device")


# --- 4. no CuPy cache directory made on a machine without a GPU -----------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "import zerokv; print(zerokv.can_run())",
        ONE_KERNEL + "import zerokv.selfcheck as s; print(s.main(quiet=True))",
        "import types, torch\n"
        "from bench import run_record\n"
        "b = types.SimpleNamespace(torch=torch, mode='dry', dry=True, l2_bytes=4096, copy_gbps=None)\n"
        "print(run_record.environment(b, {})['cupy'])",
    ],
    ids=["can_run", "selfcheck", "bench_dry_run"],
)
def test_no_cupy_cache_directory_without_a_gpu(tmp_path, code):
    home = tmp_path / "home"
    home.mkdir()
    res = _run(NO_DRIVER + code, {"HOME": str(home), "ZEROKV_CACHE_DIR": str(tmp_path / "zk")})
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (home / ".cupy").exists(), sorted(str(p) for p in home.rglob("*"))


# --- 5. an empty --dtypes or --ops ----------------------------------------------------------------


@pytest.mark.parametrize("args", [["--dtypes", ""], ["--ops", ""], ["--ops", " , "], ["--arch", ""]])
def test_an_empty_list_is_refused_before_compiling(args, capsys, monkeypatch):
    monkeypatch.setattr(offline, "compile_stem", lambda *a, **k: pytest.fail("compiled"))
    assert main(["compile", *args]) == 2
    err = capsys.readouterr().err
    assert f"{args[0]}: " in err and "names nothing" in err and err.count("\n") == 1, err


# --- 6. a second compile --out into the same directory --------------------------------------------


def test_a_second_compile_out_adds_to_the_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZEROKV_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "kernels"
    common = ["compile", "--arch", "sm_80", "--ops", "mask_empty_context", "--out", str(out)]
    assert main([*common, "--dtypes", "float16"]) == 0
    first = json.loads((out / "empty_rows-sm_80.json").read_text())["expressions"]
    assert main([*common, "--dtypes", "bfloat16"]) == 0
    text = capsys.readouterr().out
    record = json.loads((out / "empty_rows-sm_80.json").read_text())
    bf16 = _selection(["bfloat16"], ["mask_empty_context"])["empty_rows"]
    assert set(record["expressions"]) == set(first) | set(bf16)
    assert set(first).isdisjoint(bf16) and first
    assert f"{len(first)} more kept from the earlier build" in text, text
    cubin = (out / record["cubin"]).read_bytes()
    from zerokv.core import prebuilt

    assert prebuilt.sha256(cubin) == record["cubin_sha256"]


# --- 7. lse_base and prefix_rows ------------------------------------------------------------------


def _states(rng, T=5, H=2, D=8):
    return (
        rng.standard_normal((T, H, D)).astype(np.float32),
        rng.standard_normal((T, H)).astype(np.float32),
        rng.standard_normal((T, H, D)).astype(np.float32),
        rng.standard_normal((T, H)).astype(np.float32),
    )


@pytest.mark.parametrize("base", ["2", "E", "ln", " e"])
def test_only_the_documented_lse_bases(base):
    v_a, s_a, v_b, s_b = _states(np.random.default_rng(1))
    out = np.full_like(v_a, np.nan)
    with pytest.raises(ValueError, match=f"lse_base: expected 'e' or 2.*got {re.escape(repr(base))}"):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, lse_base=base)
    assert np.isnan(out).all()  # a rejected call writes nothing
    with pytest.raises(ValueError, match="lse_base"):
        zerokv.merge_states(np.stack([v_a, v_b]), np.stack([s_a, s_b]), lse_base=base)


def test_torch_ops_take_the_base_as_the_string_2():
    """Equal LSEs of 0 in base 2 merge to the mean of the two V and an LSE of exactly 1."""
    rng = np.random.default_rng(2)
    v_a, _, v_b, _ = (torch.from_numpy(x) for x in _states(rng))
    zero = torch.zeros(5, 2)
    out, lse = torch.ops.zerokv.merge_state(v_a, zero, v_b, zero, lse_base="2")
    torch.testing.assert_close(out, (v_a + v_b) / 2)
    assert torch.equal(lse, torch.ones(5, 2))
    with pytest.raises(ValueError, match="lse_base: expected 'e' or '2'"):
        torch.ops.zerokv.merge_state(v_a, zero, v_b, zero, lse_base="E")


@pytest.mark.parametrize("k", [np.int64(3), np.int32(3), np.uint8(3)])
def test_prefix_rows_takes_numpy_integers(k):
    """Rows from k on take state b alone: their output is b's V and LSE, the rows before merge."""
    v_a, s_a, v_b, s_b = _states(np.random.default_rng(3))
    out, lse = zerokv.merge_state(v_a, s_a, v_b, s_b, prefix_rows=k)
    np.testing.assert_allclose(out[3:], v_b[3:], rtol=1e-6)
    np.testing.assert_allclose(lse[3:], s_b[3:], rtol=1e-6)
    np.testing.assert_allclose(lse[:3], np.logaddexp(s_a[:3], s_b[:3]), rtol=1e-5)


def test_prefix_rows_still_refuses_bools_and_floats():
    v_a, s_a, v_b, s_b = _states(np.random.default_rng(4))
    for bad in (np.bool_(True), 3.0, np.float32(3)):
        with pytest.raises(TypeError, match="prefix_rows: expected an int or None"):
            zerokv.merge_state(v_a, s_a, v_b, s_b, prefix_rows=bad)


# --- 8. what the adapters' page says about a +inf LSE upstream ------------------------------------


def _sentences(text: str) -> list[str]:
    """Sentences, clauses and table cells: the units a claim is made in."""
    return re.split(r"(?<=[.;])\s+|\s*\|\s*", " ".join(text.split()))


@pytest.mark.parametrize("doc", [ADAPTERS, INTEGRATING], ids=["adapters.md", "integrating.md"])
def test_no_page_says_a_plus_inf_lse_gives_nan_in_every_engine(doc):
    """vLLM's and SGLang's merges count a +inf LSE as -inf (their rows say so); FlashInfer's
    give NaN for it. A claim that links +inf to NaN upstream names FlashInfer, the engine it
    is true of, and neither of the others."""
    claims = [s for s in _sentences(doc) if "+inf" in s and "NaN" in s]
    for s in claims:
        assert "FlashInfer" in s and "vLLM" not in s and "SGLang" not in s, s


def test_the_vllm_and_sglang_rows_state_the_rule_the_adapters_follow():
    vllm_part = ADAPTERS[ADAPTERS.index("## vLLM") : ADAPTERS.index("## SGLang")]
    sglang_part = ADAPTERS[ADAPTERS.index("## SGLang") :]
    for part in (vllm_part, sglang_part):
        assert re.search(r"`\+inf` LSE counts as `-inf`, as upstream", part), part[:200]
    # and the adapters do it: a +inf prefix (FA2's empty rows) with NaN garbage gives the suffix
    rng = np.random.default_rng(5)
    T, H, D = 4, 2, 8
    v_b, s_b = (
        rng.standard_normal((T, H, D)).astype(np.float32),
        rng.standard_normal((T, H)).astype(np.float32),
    )
    v_a, s_a = np.full((T, H, D), np.nan, np.float32), np.full((T, H), np.inf, np.float32)
    out = np.full((T, H, D), np.nan, np.float32)
    out_lse = np.full((H, T), np.nan, np.float32)
    vllm.merge_attn_states(out, v_a, s_a.T.copy(), v_b, s_b.T.copy(), out_lse)
    np.testing.assert_array_equal(out, v_b)
    np.testing.assert_array_equal(out_lse, s_b.T)
    v, s = sglang.merge_state_v2(v_a, s_a, v_b, s_b)
    np.testing.assert_array_equal(np.asarray(v), v_b)
    np.testing.assert_array_equal(np.asarray(s), s_b)


# --- 9. the cache directory in compile --help -----------------------------------------------------


def test_compile_help_names_the_cache_directory_of_this_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ZEROKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps long paths
    assert str(tmp_path / "xdg" / "zerokv") in text


# --- 10. --version for NVRTC problems -------------------------------------------------------------


def test_version_names_nvrtc_and_cupy(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"zerokv {zerokv.__version__}"
    text = "\n".join(lines[1:])
    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        assert f"{dist} {version}" in text, text
    assert "NVRTC" in text or "nvrtc" in text, text


# --- hostile inputs: messages that name the value, the index, the function to call ---------------


@pytest.mark.parametrize(
    ("q", "ctx", "exc", "needles"),
    [
        (5, [1], TypeError, ["query_lens", "int 5", "[5]"]),
        (np.int64(7), [1], ValueError, ["query_lens", "0-d", "7"]),
        ([[1, 2], [3]], [1, 2], ValueError, ["query_lens", "element 0", "list", "[1, 2]"]),
        ([1, None], [1, 1], TypeError, ["query_lens", "element 1", "None"]),
        ([1], [2**70], ValueError, ["context_lens", str(2**70), "index 0", "2147483647"]),
        ([1, 2], [1, 2**40], ValueError, ["context_lens", str(2**40), "index 1", "2147483647"]),
        ([2**31 - 1, 1, 1], [1, 1, 1], ValueError, ["query_lens", "2147483649", "index 1"]),
    ],
)
def test_plan_context_chunks_names_the_value_and_where(q, ctx, exc, needles):
    with pytest.raises(exc) as info:
        zerokv.plan_context_chunks(q, ctx, chunk_tokens=8)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize(
    ("call", "native"),
    [
        (lambda v, s: torch.ops.zerokv.merge_state(v.numpy(), s, v, s), "zerokv.merge_state"),
        (lambda v, s: torch.ops.zerokv.merge_state(v, s, v, s, lse_base=2), "zerokv.merge_state"),
        (lambda v, s: torch.ops.zerokv.merge_states(torch.stack([v, v]), [s, s]), "zerokv.merge_states"),
        (lambda v, s: torch.ops.zerokv.fixup_zero_kv_rows(v, s, [0], [0, 3]), "zerokv.fixup_zero_kv_rows"),
    ],
)
def test_torch_ops_name_the_zerokv_function_to_call(call, native):
    v, s = torch.randn(3, 2, 8), torch.randn(3, 2)
    with pytest.raises(TypeError) as info:
        call(v, s)
    assert isinstance(info.value, RuntimeError)  # still what torch raised, for code catching that
    assert native in str(info.value) and "Expected a value of type" in str(info.value), str(info.value)
