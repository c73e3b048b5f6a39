"""The benchmark suite: its baseline CUDA kernel compiles (NVRTC, no GPU), its dry run goes through
the whole pipeline on the CPU, the report judges rows as documented, and on a GPU the baseline
merge in vLLM's design computes what the float64 reference says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DTYPES, assert_close, f64

from zerokv import reference

ROOT = Path(__file__).resolve().parent.parent
INF, NAN = float("inf"), float("nan")


@pytest.fixture
def bench(monkeypatch):
    """The bench package (a folder beside zerokv, not installed)."""
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.baselines
    import bench.common
    import bench.report

    return bench


def test_vllm_design_kernel_compiles_for_sm90(bench):
    pytest.importorskip("cuda.bindings.nvrtc")
    for kernel in (bench.baselines.VLLM_DESIGN, bench.baselines.EMPTY):
        lowered = bench.baselines.compile_offline(kernel, arch="sm_90")
        assert list(lowered) == kernel.expressions
        assert all(name.startswith("_Z") for name in lowered.values())


def test_vllm_design_checks_its_layout_and_packs_by_name(bench):
    T, H, D = 5, 3, 64
    v = [torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(3)]
    s_ht = [torch.randn(H, T) for _ in range(3)]
    args, grid = bench.baselines.vllm_design_args(v[0], s_ht[0].T, v[1], s_ht[1].T, v[2], s_ht[2].T)
    assert [n for n, _ in bench.baselines.VLLM_DESIGN.params] == list(args)
    assert grid == -(-T * H * (D // 8) // bench.baselines.VLLM_DESIGN.block)
    bench.baselines.VLLM_DESIGN.pack(**args)
    s_th = torch.randn(T, H)  # a [T, H] LSE is not the layout this design reads
    with pytest.raises(ValueError, match="s_a"):
        bench.baselines.vllm_design_args(v[0], s_th, v[1], s_ht[1].T, v[2], s_ht[2].T)
    with pytest.raises(ValueError, match="multiple of 8"):
        w = [torch.randn(T, H, 12, dtype=torch.bfloat16) for _ in range(3)]
        bench.baselines.vllm_design_args(w[0], s_ht[0].T, w[1], s_ht[1].T, w[2], s_ht[2].T)


def test_eager_baselines_follow_the_empty_rule(bench):
    """+inf and -inf are empty and NaN garbage in an empty V never reaches the output."""
    T, H, D = 6, 2, 8
    rng = np.random.default_rng(3)
    va, vb = (torch.from_numpy(rng.standard_normal((T, H, D))).float() for _ in range(2))
    sa, sb = (torch.from_numpy(rng.standard_normal((T, H)) * 3).float() for _ in range(2))
    sa[0], va[0] = -INF, NAN
    sb[1], vb[1] = INF, NAN
    sa[2], sb[2], va[2], vb[2] = -INF, INF, NAN, NAN
    sa[3, 0] = NAN
    want = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    out, lse = torch.full((T, H, D), NAN), torch.full((T, H), NAN)
    bench.baselines.eager_merge_state(va, sa, vb, sb, out, lse)
    assert_close(out, want[0], torch.float32, "out")
    assert_close(lse, want[1], torch.float32, "lse")


def _row(bench, impl, us, layout, **kw):
    return bench.common.Row(
        op="merge_state", impl=impl, dtype="bf16", T=8, H=4, D=64, us=us, params={"layout": layout}, **kw
    )


def test_report_judges_zerokv_against_the_best_baseline_of_each_shape(bench):
    rows = [
        _row(bench, "zerokv", 2.0, "TH"),
        _row(bench, "zerokv", 3.0, "HT"),
        _row(bench, "vLLM-design CUDA", 2.5, "HT"),
        _row(bench, "Triton", 4.0, "TH"),
        _row(bench, "Triton", 5.0, "HT"),
    ]
    lines = {x["layout"]: x for x in bench.report.merge_lines(rows)}
    assert lines["TH"]["best"].impl == lines["HT"]["best"].impl == "vLLM-design CUDA"
    assert lines["TH"]["ratio"] == pytest.approx(0.8) and lines["HT"]["ratio"] == pytest.approx(1.2)
    judged = {t.name: t for t in bench.report.evaluate(rows)}
    assert judged["merge_state zerokv / best baseline, layout TH, every shape"].reached is True
    assert judged["merge_state zerokv / best baseline, layout HT, every shape"].reached is False
    assert "merge_state zerokv" in bench.report.summary(rows, bench.report.evaluate(rows))


def test_report_host_targets_are_over_torch_mul_of_the_same_mode(bench):
    Row = bench.common.Row

    def host(label, kind, mode, us):
        return Row(op="host", impl=label, us=us, params={"mode": mode, "kind": kind})

    rows = [
        host("torch.mul(a, b, out=c)", "reference", "a", 10.0),
        host("torch.mul(a, b, out=c)", "reference", "b", 5.0),
        host("merge_state", "zerokv", "a", 12.0),  # 1.2 x: reached
        host("merge_state", "zerokv", "b", 7.0),  # 1.4 x: missed
        host("merge_state", "zerokv", "c", 19.0),  # 1.9 x of (a)'s torch.mul: reached
        host("fixup_zero_kv_rows", "zerokv", "a", 16.0),  # 1.6 x: missed
        host("Triton merge (vLLM design)", "baseline", "a", 40.0),  # a baseline: never judged
    ]
    t = {x.name: x.reached for x in bench.report.host_targets(rows)}
    assert t == {
        "host (a) new T every call: merge_state, six tensors": True,
        "host (a) new T every call: every other op and adapter": False,
        "host (b) the same call repeated: every op and adapter": False,
        "host (c) outputs allocated by zerokv, new T every call": True,
    }


def test_dry_run_goes_through_the_whole_pipeline(tmp_path):
    """``python -m bench --quick --dry-run``: every part, the CPU path, synthetic times; the JSON,
    the Markdown and (with matplotlib) the PNG are written, and no task failed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "bench", "--quick", "--dry-run", "--out", str(tmp_path)]
    cmd += ["--only", "merge,empty_rows,host,compile"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (found,) = tmp_path.glob("zerokv-bench-*-dry.json")
    doc = json.loads(found.read_text())
    ops = {(r["op"], r["impl"]) for r in doc["rows"]}
    for op in (
        "copy",
        "merge_state",
        "merge_states",
        "fixup_zero_kv_rows",
        "mask_empty_context",
        "host",
        "compile",
    ):
        assert any(o == op for o, _ in ops), op
    assert ("merge_state", "vLLM-design CUDA") in ops
    assert all(r["max_err"] is None or r["max_err"] < 0.1 for r in doc["rows"])
    assert {"merge_state zerokv / best baseline, layout HT, every shape"} <= {
        t["name"] for t in doc["targets"]
    }
    assert "## targets" in found.with_suffix(".md").read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_design_merge_matches_the_reference(bench, dtype):
    """The baseline in vLLM's design follows zerokv's rules: empty (+-inf) inputs selected away
    with NaN in their V, both empty -> (0, -inf), NaN propagates, huge LSE gaps."""
    torch.manual_seed(11)
    T, H, D = 37, 5, 128
    dev = torch.device("cuda")
    va, vb = (torch.randn(T, H, D, device=dev).to(dtype) for _ in range(2))
    sa_ht, sb_ht = (torch.randn(H, T, device=dev) * 3 for _ in range(2))
    sa_ht[:, 0], va[0] = -INF, NAN
    sb_ht[:, 1], vb[1] = INF, NAN
    sa_ht[:, 2], sb_ht[:, 2], va[2], vb[2] = -INF, INF, NAN, NAN
    sa_ht[1, 3] = NAN
    sa_ht[:, 4], sb_ht[:, 4] = 80.0, -80.0
    out = torch.full((T, H, D), NAN, device=dev, dtype=dtype)
    lse_ht = torch.full((H, T), NAN, device=dev)
    bench.baselines.vllm_design_merge(va, sa_ht.T, vb, sb_ht.T, out, lse_ht.T)
    torch.cuda.synchronize()
    want_o, want_l = reference.merge_state(f64(va), f64(sa_ht.T), f64(vb), f64(sb_ht.T))
    assert_close(out, want_o, dtype, "out")
    assert_close(lse_ht.T, want_l, torch.float32, "lse")


@pytest.mark.gpu
def test_triton_merge_matches_the_reference(bench):
    pytest.importorskip("triton")
    torch.manual_seed(12)
    T, H, D = 19, 3, 96
    dev = torch.device("cuda")
    va, vb = (torch.randn(T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    sa, sb = (torch.randn(H, T, device=dev).T * 3 for _ in range(2))  # [H, T] buffers as .T
    sa[0], va[0] = -INF, NAN
    sa[1], sb[1], va[1], vb[1] = INF, -INF, NAN, NAN
    out = torch.full((T, H, D), NAN, device=dev, dtype=torch.bfloat16)
    lse = torch.full((T, H), NAN, device=dev)
    bench.baselines.triton_merge_state(va, sa, vb, sb, out, lse)
    torch.cuda.synchronize()
    want_o, want_l = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    assert_close(out, want_o, torch.bfloat16, "out")
    assert_close(lse, want_l, torch.float32, "lse")
