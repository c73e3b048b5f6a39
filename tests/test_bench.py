"""The benchmark suite: its baseline CUDA kernel compiles (NVRTC, no GPU), its dry run goes through
the whole pipeline on the CPU, the report judges rows as documented, the interleaved timing
replays as documented (against a fake CUDA clock), and on a GPU the baseline merge in vLLM's
design computes what the float64 reference says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import oracles
import pytest
import torch
from conftest import DTYPES, assert_close, f64
from tolerances import tolerance

from zerokv import reference

ROOT = Path(__file__).resolve().parent.parent
INF, NAN = float("inf"), float("nan")


@pytest.fixture
def bench(monkeypatch):
    """The bench package (a folder beside zerokv, not installed)."""
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.baselines
    import bench.baselines_cuda
    import bench.baselines_triton
    import bench.common
    import bench.compare
    import bench.report
    import bench.targets
    import bench.timing
    import bench.yardsticks

    return bench


def test_vllm_design_kernel_compiles_for_sm90(bench):
    for kernel in (bench.baselines_cuda.VLLM_DESIGN, bench.yardsticks.EMPTY):
        lowered = bench.baselines_cuda.compile_offline(kernel, arch="sm_90")
        assert list(lowered) == kernel.expressions
        assert all(name.startswith("_Z") for name in lowered.values())


def test_vllm_design_checks_its_layout_and_packs_by_name(bench):
    T, H, D = 5, 3, 64
    v = [torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(3)]
    s_ht = [torch.randn(H, T) for _ in range(3)]
    args, grid = bench.baselines_cuda.vllm_design_args(v[0], s_ht[0].T, v[1], s_ht[1].T, v[2], s_ht[2].T)
    assert [n for n, _ in bench.baselines_cuda.VLLM_DESIGN.params] == list(args)
    assert grid == -(-T * H * (D // 8) // bench.baselines_cuda.VLLM_DESIGN.block)
    bench.baselines_cuda.VLLM_DESIGN.pack(**args)
    s_th = torch.randn(T, H)  # a [T, H] LSE is not the layout this design reads
    with pytest.raises(ValueError, match="s_a"):
        bench.baselines_cuda.vllm_design_args(v[0], s_th, v[1], s_ht[1].T, v[2], s_ht[2].T)
    with pytest.raises(ValueError, match="multiple of 8"):
        w = [torch.randn(T, H, 12, dtype=torch.bfloat16) for _ in range(3)]
        bench.baselines_cuda.vllm_design_args(w[0], s_ht[0].T, w[1], s_ht[1].T, w[2], s_ht[2].T)


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
    want = oracles.merge2(va, sa, vb, sb)
    out, lse = torch.full((T, H, D), NAN), torch.full((T, H), NAN)
    bench.baselines.eager_merge_state(va, sa, vb, sb, out, lse)
    assert_close(out, want[0], torch.float32, "out", arithmetic="float32")  # torch's float32 eager ops
    assert_close(lse, want[1], torch.float32, "lse", arithmetic="float32")


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
    lines = {x["layout"]: x for x in bench.compare.merge_lines(rows)}
    assert lines["TH"]["best"].impl == lines["HT"]["best"].impl == "vLLM-design CUDA"
    assert lines["TH"]["ratio"] == pytest.approx(0.8) and lines["HT"]["ratio"] == pytest.approx(1.2)
    judged = {t.name: t for t in bench.targets.evaluate(rows)}
    assert judged["merge_state zerokv / best baseline, layout TH, every shape"].reached is True
    assert judged["merge_state zerokv / best baseline, layout HT, every shape"].reached is False
    assert "merge_state zerokv" in bench.report.summary(rows, bench.targets.evaluate(rows))


def test_report_host_targets_are_over_torch_mul_of_the_same_mode(bench):
    Row = bench.common.Row

    def host(label, kind, mode, us):
        return Row(op="host", impl=label, us=us, params={"mode": mode, "kind": kind})

    rows = [
        host("torch.mul(a, b, out=c)", "reference", "a", 10.0),
        host("torch.mul(a, b, out=c)", "reference", "b", 5.0),
        host("merge_state", "zerokv", "a", 14.0),  # 1.4 x <= 1.5: reached
        host("merge_state", "zerokv", "b", 6.0),  # 1.2 x <= 1.3
        host("merge_state, 60 layers' buffers, one T", "zerokv", "b", 7.0),  # 1.4 x: missed
        host("merge_state sinks=", "zerokv", "a", 15.5),  # 1.55 <= 1.4 + 0.2: reached
        host("merge_state sinks=", "zerokv", "b", 7.5),  # 1.5 > 1.2 + 0.2: missed
        host("fixup_zero_kv_rows", "zerokv", "a", 16.0),  # 1.6 x > 1.5: missed
        host("merge_state", "zerokv", "c", 19.0),  # 1.9 x of (a)'s torch.mul
        host("torch.ops.zerokv.merge_state_out", "zerokv", "a", 21.0),  # 2.1 x: missed
        host("Triton merge (vLLM design)", "baseline", "a", 40.0),  # a baseline: never judged
        Row(op="host_first", impl="merge_state, first call of a new signature", us=190.0),
    ]
    t = {x.name: x.reached for x in bench.targets.host_targets(rows)}
    assert t == {
        "host (b) the same T: merge_state (repeated, 60 layers)": False,
        "host (a) new T every call: merge_state": True,
        "host (a) new T: options, LSE layouts, adapters": True,
        "host (b) the same T: options, LSE layouts, adapters": False,
        "host (a) new T every call: the other ops": False,
        "host: outputs allocated by zerokv (c), torch.ops.zerokv.* (a, b)": False,
        "host: first call of a new signature (kernel loaded)": True,
    }
    rows[6] = host("merge_state sinks=", "zerokv", "b", 6.9)  # 1.38 <= 1.4
    t = {x.name: x.reached for x in bench.targets.host_targets(rows)}
    assert t["host (b) the same T: options, LSE layouts, adapters"] is True


class _FakeCuda:
    """Enough of ``torch.cuda`` for ``CudaTimer`` on the CPU: a clock that graph replays and
    sleeps advance, events that read it, and a log of every replay and event in queue order."""

    def __init__(self, cost_us):
        self.cost_us = cost_us  # per call of each implementation, by name
        self.now_ms = 0.0
        self.log = []
        self.capturing = None
        outer = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self):
                self.t = outer.now_ms
                outer.log.append(("event", self))

            def elapsed_time(self, other):
                return other.t - self.t

            def synchronize(self):
                pass

        class CUDAGraph:
            def __init__(self):
                self.calls = []

            def capture_begin(self):
                outer.capturing = self

            def capture_end(self):
                outer.capturing = None

            def replay(self):
                outer.log.append(("replay", self))
                outer.now_ms += sum(outer.cost_us[c] for c in self.calls) / 1e3

        class Stream:
            def wait_stream(self, other):
                pass

        self.Event, self.CUDAGraph, self.Stream = Event, CUDAGraph, Stream

    def _sleep(self, cycles):
        self.now_ms += cycles / 1e6  # a 1 GHz clock

    def synchronize(self):
        pass

    def current_stream(self):
        return self.Stream()

    def stream(self, s):
        import contextlib

        return contextlib.nullcontext()

    def call(self, name):
        """What one call of implementation ``name`` does: queue itself (into a graph when one
        is being captured)."""
        if self.capturing is not None:
            self.capturing.calls.append(name)
        else:
            self.now_ms += self.cost_us[name] / 1e3


def test_interleaved_timing_replays_each_graph_before_timing_it_in_a_new_order(bench):
    """``CudaTimer.time_together``: every timed replay follows an untimed replay of the same
    graph; the order changes from round to round; each figure is the per-call time of its own
    graph; a failing call gives its exception in its place and the others are still timed."""
    cost = {"a": 2.0, "b": 5.0, "c": 1.0, "slow": 400.0}
    cuda = _FakeCuda(cost)
    fake_torch = type("FakeTorch", (), {"cuda": cuda})()
    timer = bench.timing.CudaTimer(fake_torch, budget_us=10000.0)
    sets = bench.common.Sets(3, lambda k: (k,))

    def impl(name):
        return lambda k: cuda.call(name)

    def broken(k):
        raise RuntimeError("no kernel image")

    cuda.log.clear()
    out = timer.time_together(
        [(impl("a"), sets), (broken, sets), (impl("b"), sets), (impl("c"), sets), (impl("slow"), sets)]
    )
    assert isinstance(out[1], RuntimeError)
    for t, name in zip([out[0], out[2], out[3], out[4]], ["a", "b", "c", "slow"], strict=True):
        assert t.us == pytest.approx(cost[name]) and t.stats["interleaved_with"] == 3
    rounds = out[0].stats["replays"]
    assert rounds >= bench.timing.MIN_ROUNDS
    # the timed part of the log: after the last graph upload, pairs of events around one replay
    log = cuda.log
    timed = [i for i, (kind, _) in enumerate(log) if kind == "event"]
    timed = timed[len(timed) - 2 * 4 * rounds :]
    orders = []
    for j in range(0, len(timed), 2):
        start, end = timed[j], timed[j + 1]
        inside = [x for kind, x in log[start + 1 : end] if kind == "replay"]
        before = log[start - 1]
        assert len(inside) == 1 and before == ("replay", inside[0])  # an untimed replay first
        orders.append(inside[0].calls[0])
    per_round = [tuple(orders[r * 4 : (r + 1) * 4]) for r in range(rounds)]
    assert all(sorted(o) == ["a", "b", "c", "slow"] for o in per_round)
    assert len(set(per_round)) > 1  # not one fixed order


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
    # each row within its output dtype's bound (tolerances.py) on unit-scale data (|values| <= 8)
    labels = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    checked = [r for r in doc["rows"] if r["max_err"] is not None]
    assert len(checked) >= 10, len(checked)
    for r in checked:
        atol, rtol = tolerance(labels[r["dtype"]])
        assert r["max_err"] <= atol + 8 * rtol, (r["op"], r["impl"], r["dtype"], r["max_err"])
    assert {"merge_state zerokv / best baseline, layout HT, every shape"} <= {
        t["name"] for t in doc["targets"]
    }
    assert "## targets" in found.with_suffix(".md").read_text()


def test_ab_ratios_and_what_leaves_each_trees_spread(bench):
    from bench import ab

    times = {
        "same": {"this": [10.0, 10.02], "other": [10.01, 10.0]},  # within this tree's 0.2 %
        "slower": {"this": [10.0, 10.0], "other": [10.3, 10.3]},
        "noisy": {"this": [10.0, 11.0], "other": [10.4, 10.4]},  # 10 % spread covers it
        "alone": {"this": [1.0]},  # not run on the other tree: no ratio
    }
    got = ab.compare(times)
    assert got["n"] == 3 and set(got["rows"]) == {"same", "slower", "noisy"}
    assert got["rows"]["slower"]["ratio"] == pytest.approx(1.03)
    assert got["rows"]["noisy"]["ratio"] == pytest.approx(10.4 / 10.5)
    assert list(got["beyond_noise"]) == ["slower"]
    assert got["median_ratio"] == pytest.approx(10.005 / 10.01)  # the middle of the three


def test_ab_dry_run_imports_each_trees_own_package(tmp_path):
    """``python -m bench.ab --dry-run`` against a copy of this tree's package: each tree's runs
    import their own zerokv, and every row of both has a ratio."""
    other = tmp_path / "other"
    other.mkdir()
    for d in ("zerokv", "kernels_cu"):
        subprocess.run(["cp", "-r", str(ROOT / d), str(other / d)], check=True)
    out = tmp_path / "ab.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "bench.ab", "--other", str(other), "--rounds", "1", "--dry-run"]
    cmd += ["--parts", "merge", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["packages"]["this"] == str(ROOT / "zerokv" / "__init__.py")
    assert doc["packages"]["other"] == str(other / "zerokv" / "__init__.py")
    assert doc["n"] >= 5 and all(r["rc"] == 0 for r in doc["runs"])
    assert all(len(v["this"]) == len(v["other"]) == 1 for v in doc["rows"].values())


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
    bench.baselines_cuda.vllm_design_merge(va, sa_ht.T, vb, sb_ht.T, out, lse_ht.T)
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
    bench.baselines_triton.triton_merge_state(va, sa, vb, sb, out, lse)
    torch.cuda.synchronize()
    want_o, want_l = reference.merge_state(f64(va), f64(sa), f64(vb), f64(sb))
    assert_close(out, want_o, torch.bfloat16, "out")
    assert_close(lse, want_l, torch.float32, "lse")
