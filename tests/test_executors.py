"""The compiled executor (``launcher.c``) and the Python executor (``pyexec``) run every bound
call the same way: on thousands of random calls of every op, option and adapter (valid and
invalid, shared buffers, aliases, lying shapes, wrong dtypes, None, non-tensors) each bound call
is run by both and must give the same outcome (taken or not, the same result objects, the same
launches: kernel, grid, block, every parameter) and the public calls raise the same exceptions
with the same messages under either executor. Malformed calls straight to the compiled ``run``
never crash it, also under AddressSanitizer and UndefinedBehaviorSanitizer; a machine whose
compiler fails runs everything on the Python executor. No GPU: CPU tensors take the GPU path
(``zerokv.testing``)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import zerokv
import zerokv.testing as zt
from zerokv.compat import flashinfer, sglang, vllm
from zerokv.core import bound, cexec, empty_rows_plan, merge_plans, merge_states_plan, plans, pyexec
from zerokv.core import executor as _executor

ROOT = Path(__file__).resolve().parents[1]
BF, F16, F32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
CALLS = int(os.environ.get("ZEROKV_AGREEMENT_CALLS", "5000"))


@pytest.fixture(scope="module")
def c_module():
    """The compiled executor (strict: a machine that runs these tests has a C compiler)."""
    module, _ = cexec.load(strict=True)
    return module


# --- random calls -----------------------------------------------------------------------------


class Maker:
    """Tensors of one random call, every one remembered (its storage names pointers in launches)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.made: list[torch.Tensor] = []

    def keep(self, x):
        if isinstance(x, torch.Tensor):
            self.made.append(x)
        return x

    def buf(self, n: int, dtype) -> torch.Tensor:
        return self.keep(torch.empty(n, dtype=dtype))

    def v(self, T: int, H: int, D: int, dtype=BF, lead: tuple = ()) -> torch.Tensor:
        """A ``[*lead, T, H, D]`` state in one of an engine's layouts, or a broken one."""
        rng, n = self.rng, int(np.prod(lead, dtype=np.int64)) if lead else 1
        kind = rng.choices(
            ("plain", "pad", "odd", "inner", "expand", "rank", "flip"), (10, 3, 1, 1, 1, 1, 1)
        )[0]
        if kind == "pad":
            return self.keep(torch.empty(*lead, T, H + rng.choice((1, 3)), D, dtype=dtype)[..., :H, :])
        if kind == "odd":  # one element into its buffer: no vector packs
            return self.keep(self.buf(n * T * H * D + 1, dtype)[1:].view(*lead, T, H, D))
        if kind == "inner":  # head_dim not unit-stride
            return self.keep(torch.empty(*lead, T, H, 2 * D, dtype=dtype)[..., ::2])
        if kind == "expand":
            return self.keep(torch.empty(*lead, 1, H, D, dtype=dtype).expand(*lead, T, H, D))
        if kind == "rank":
            return self.keep(torch.empty(*lead, T, H * D, dtype=dtype))
        if kind == "flip" and T > 1:
            return self.keep(torch.empty(*lead, H, T, D, dtype=dtype).transpose(-3, -2))
        return self.keep(torch.empty(*lead, T, H, D, dtype=dtype))

    def s(self, T: int, H: int, dtype=F32, lead: tuple = ()) -> torch.Tensor:
        """A ``[*lead, T, H]`` LSE: row-major, an ``[H, T]`` buffer's transpose, padded, broken."""
        rng = self.rng
        kind = rng.choices(("plain", "ht", "pad", "expand", "rank"), (8, 4, 2, 1, 1))[0]
        if kind == "ht":
            return self.keep(torch.empty(*lead, H, T, dtype=dtype).transpose(-1, -2))
        if kind == "pad":
            return self.keep(torch.empty(*lead, T, H + 2, dtype=dtype)[..., :H])
        if kind == "expand":
            return self.keep(torch.empty(*lead, 1, H, dtype=dtype).expand(*lead, T, H))
        if kind == "rank":
            return self.keep(torch.empty(*lead, T, dtype=dtype))
        return self.keep(torch.empty(*lead, T, H, dtype=dtype))

    def index(self, B: int, plus: int = 0) -> torch.Tensor:
        dtype = self.rng.choices((torch.int32, torch.int64, torch.float32), (6, 3, 1))[0]
        return self.keep(torch.zeros(B + plus, dtype=dtype))

    def shared(self, T: int, H: int, D: int, dtype, count: int, overlap: bool) -> list[torch.Tensor]:
        """``count`` states one after another in one buffer, the last over its neighbour when
        ``overlap``."""
        size = T * H * D
        buf = self.buf(count * size + 64, dtype)
        starts = [i * size + 8 * self.rng.randint(0, 1) * i for i in range(count)]
        if overlap and count > 1:
            starts[-1] = starts[-2] + max(0, size - 8)
        return [self.keep(buf[a : a + size].view(T, H, D)) for a in starts]

    def flag(self, x, state: str):
        """An output made read-only to the contract (requires grad, an inference tensor), or a
        module's parameter (needing grad or not)."""
        if state == "grad" and x.dtype.is_floating_point:
            return self.keep(x.detach().requires_grad_(True))
        if state == "param":
            grad = self.rng.random() < 0.5 and x.dtype in (BF, F16, F32)
            return self.keep(torch.nn.Parameter(x.detach(), requires_grad=grad))
        if state == "inference":
            with torch.inference_mode():
                return self.keep(torch.empty_like(x))
        return x


def _junk(rng: random.Random, like):
    """A non-tensor (or None) where a tensor belongs."""
    return rng.choice((None, 3.0, [1, 2], np.zeros((2, 2), np.float32), "x", 7))


def merge_state_call(m: Maker):
    rng = m.rng
    T, H, D = rng.choice((1, 2, 7, 16, 33)), rng.choice((1, 2, 4)), rng.choice((8, 16, 64))
    dt = rng.choices((BF, F16, F32, torch.float64), (8, 2, 3, 1))[0]
    T2 = T if rng.random() < 0.9 else T + 1  # a lying T on one input
    if rng.random() < 0.25:
        v_a, v_b, shared = m.shared(T, H, D, dt, 3, rng.random() < 0.5)  # out: the third, or none
    else:
        v_a, v_b, shared = m.v(T, H, D, dt), m.v(T2, H, D, dt), None
    s_a, s_b = m.s(T, H), m.s(T, H if rng.random() < 0.95 else H + 1)
    kw: dict = {}
    o = rng.choice(("none", "fresh", "fresh", "inplace", "shared", "f32", "fp8"))
    if o == "fresh":
        kw["out"] = m.flag(m.v(T, H, D, dt), rng.choice(("", "", "", "grad", "inference", "param")))
    elif o == "inplace":
        kw["out"] = v_a
    elif o == "shared" and shared is not None:
        kw["out"] = shared
    elif o == "f32":
        kw["out"] = m.keep(torch.empty(T, H, D))
    elif o == "fp8":
        kw["out"] = m.keep(torch.empty(T, H, D, dtype=FP8))
        g = rng.choice((0, 8, 16))
        if g and D % g == 0 and rng.random() < 0.5:
            kw["out_block_scale"] = m.s(T, H * D // g)
            kw["quant_group"] = g
        else:
            kw["out_scale"] = m.keep(torch.empty(rng.choice((1, 1, 1, 2))))
    lo = rng.choice(("none", "fresh", "fresh", "inplace", "ht"))
    if lo == "fresh":
        kw["out_lse"] = m.flag(m.s(T, H), rng.choice(("", "", "grad", "inference", "param")))
    elif lo == "inplace":
        kw["out_lse"] = s_a
    elif lo == "ht":
        kw["out_lse"] = m.keep(torch.empty(H, T).T)
    if rng.random() < 0.3:
        kw["prefix_rows"] = rng.choice((0, T // 2, T, T + 3, -1, True, 2.5, 1 << 40, np.int64(T // 2)))
    if rng.random() < 0.2:
        B = rng.randint(1, 4)
        kw["a_empty"] = (m.index(B, 1 if rng.random() < 0.9 else 0), m.index(B))
    if rng.random() < 0.2:
        kw["sinks"] = m.keep(torch.empty(H if rng.random() < 0.9 else H + 1))
        if rng.random() < 0.3:  # a module's weights (gpt-oss's sinks are)
            kw["sinks"] = m.flag(kw["sinks"], "param")
    if rng.random() < 0.1:
        kw["lse_base"] = rng.choice((2, "2", "x"))
    args = [v_a, s_a, v_b, s_b]
    if rng.random() < 0.05:
        args[0] = m.flag(v_a, "param")
    if rng.random() < 0.05:
        i = rng.randrange(4)
        args[i] = _junk(rng, args[i])
    how = rng.choice(("public", "public", "public", "vllm", "sglang", "flashinfer", "ops"))
    if how == "vllm" and "out" in kw and kw["out"] is not None and not ({"a_empty", "sinks"} & kw.keys()):
        lse = kw.get("out_lse")
        return lambda: vllm.merge_attn_states(
            kw["out"], args[0], _t(args[1]), args[2], _t(args[3]), _t(lse),
            prefill_tokens_with_context=kw.get("prefix_rows"), output_scale=kw.get("out_scale"),
            output_block_scale=kw.get("out_block_scale"), quant_group_size=kw.get("quant_group"),
        )  # fmt: skip
    if how == "sglang":
        return lambda: sglang.merge_state_v2(*args, kw.get("out"), kw.get("out_lse"))
    if how == "flashinfer":
        return lambda: flashinfer.merge_state_in_place(args[0], args[1], args[2], args[3])
    if how == "ops" and "out" in kw and "out_lse" in kw:
        cu, kv = kw.get("a_empty", (None, None))
        return lambda: torch.ops.zerokv.merge_state_out(
            *args, kw["out"], kw["out_lse"], prefix_rows=kw.get("prefix_rows") if type(kw.get("prefix_rows")) is int
            else None, a_cu_seqlens_q=cu, a_kv_lens=kv, sinks=kw.get("sinks"),
        )  # fmt: skip
    return lambda: zerokv.merge_state(*args, **kw)


def _t(x):
    return x.T if isinstance(x, torch.Tensor) and x.dim() == 2 else x


def merge_states_call(m: Maker):
    rng = m.rng
    N, T, H, D = rng.choice((1, 2, 3)), rng.choice((1, 5, 16)), rng.choice((1, 2, 4)), rng.choice((8, 64))
    dt = rng.choice((BF, F16, F32))
    v, s = m.v(T, H, D, dt, lead=(N,)), m.s(T, H, lead=(N,))
    kw: dict = {}
    o = rng.choice(("none", "fresh", "fresh", "fp8", "alias"))
    if o == "fresh":
        kw["out"] = m.flag(m.v(T, H, D, dt), rng.choice(("", "", "grad")))
    elif o == "fp8":
        kw["out"] = m.keep(torch.empty(T, H, D, dtype=FP8))
        if D % 8 == 0 and rng.random() < 0.5:
            kw["out_block_scale"], kw["quant_group"] = m.s(T, H * D // 8), 8
        else:
            kw["out_scale"] = m.keep(torch.empty(1))
    elif o == "alias" and v.dim() == 4:
        kw["out"] = v[0]
    if rng.random() < 0.6:
        kw["out_lse"] = m.s(T, H) if rng.random() < 0.9 else s[0]
    if rng.random() < 0.2:
        kw["sinks"] = m.keep(torch.empty(H))
    if rng.random() < 0.05:
        v = _junk(rng, v)
    if (
        rng.random() < 0.15
        and isinstance(v, torch.Tensor)
        and "out" in kw
        and "out_lse" in kw
        and not ({"out_scale", "out_block_scale", "sinks"} & kw.keys())
    ):
        return lambda: torch.ops.zerokv.merge_states_out(v, s, kw["out"], kw["out_lse"])
    return lambda: zerokv.merge_states(v, s, **kw)


def rows_call(m: Maker):
    rng = m.rng
    T, H, D, B = rng.choice((1, 6, 20)), rng.choice((1, 2, 4)), rng.choice((8, 64)), rng.randint(1, 4)
    out = m.flag(m.v(T, H, D, rng.choice((BF, F16, F32))), rng.choice(("", "", "", "grad", "inference")))
    lse = m.s(T, H) if rng.random() < 0.9 else out[..., 0].float()
    cu = m.index(B, 1 if rng.random() < 0.9 else 2)
    if rng.random() < 0.5:
        kv = m.index(B)
        if rng.random() < 0.05:
            kv = _junk(rng, kv)
        if rng.random() < 0.2:
            return lambda: sglang.fixup_zero_kv_rows(out, lse, kv, cu, rng.choice((T, 1, 0)))
        return lambda: zerokv.fixup_zero_kv_rows(out, lse, kv, cu, rng.choice((None, None, T, 0, -1)))
    ckv = m.index(B, 1)
    if rng.random() < 0.2:
        return lambda: vllm.mask_empty_context(_t(lse), out, cu, ckv)
    return lambda: zerokv.mask_empty_context(out, lse, cu, ckv)


def random_call(seed: int):
    """``(call, tensors)`` of seed ``seed``: the same call for the same seed."""
    rng = random.Random(seed)
    m = Maker(rng)
    maker = rng.choices((merge_state_call, merge_states_call, rows_call), (6, 2, 2))[0]
    call = maker(m)
    if rng.random() < 0.15:  # an engine's step: inference tensors are writable outputs there
        return _in_inference_mode(call), m.made
    return call, m.made


def _in_inference_mode(call):
    def inside():
        with torch.inference_mode():
            return call()

    return inside


# --- both executors on every bound call ------------------------------------------------------


class Both:
    """``executor.run`` in a block recording launches: each bound call run by the Python executor
    and then by the compiled one (torch signatures), their outcomes compared; the compiled one's
    result goes on."""

    def __init__(self, log: zt.LaunchLog, module) -> None:
        self.log, self.c = log, module
        self.runs = self.taken = 0
        self.ops: set[int] = set()

    def _one(self, run, bc, objs, scalars):
        n = len(self.log.launches)
        try:
            got = ("result", run(bc, objs, scalars))
        except Exception as e:  # noqa: BLE001 - compared, then raised again
            got = ("raise", e)
        launched = self.log.launches[n:]
        del self.log.launches[n:]
        return got, launched

    def __call__(self, bc, objs, scalars):
        if not bc.c_ok:
            return pyexec.run(bc, objs, scalars)
        py, py_launches = self._one(pyexec.run, bc, objs, scalars)
        c, c_launches = self._one(self.c.run, bc, objs, scalars)
        self.runs += 1
        self.ops.update(r[0] for r in bc.records)
        made = _agree(bc, objs, py, c)
        assert len(py_launches) == len(c_launches), bc.name
        for a, b in zip(py_launches, c_launches, strict=True):
            assert (a.kernel, a.grid, a.block, a.shared_mem) == (b.kernel, b.grid, b.block, b.shared_mem), (
                bc.name
            )
            assert a.params.keys() == b.params.keys()
            for k, x in a.params.items():
                assert x == b.params[k] or made.get(x) == b.params[k], (bc.name, k, x, b.params[k])
        self.log.launches.extend(c_launches)
        if c[0] == "raise":
            raise c[1]
        self.taken += c[1] is not None
        return c[1]


def _agree(bc, objs, py, c) -> dict:
    """The two outcomes are the same; the allocated outputs' pointers, Python's to the compiled one's."""
    assert py[0] == c[0], (bc.name, py, c)
    if py[0] == "raise":
        assert (type(py[1]), str(py[1])) == (type(c[1]), str(c[1]))
        return {}
    a, b = py[1], c[1]
    if a is None or a is True:
        assert b is a, (bc.name, a, b)
        return {}
    assert type(b) is tuple and len(a) == len(b), (bc.name, a, b)
    made = {}
    for x, y in zip(a, b, strict=True):
        if any(x is o for o in objs):
            assert y is x
        else:  # allocated by each executor: alike, not the same
            assert all(y is not o for o in objs)
            assert (x.shape, x.stride(), x.dtype, x.device) == (y.shape, y.stride(), y.dtype, y.device)
            made[x.data_ptr()] = y.data_ptr()
    return made


def _outcome(call, tensors, log: zt.LaunchLog) -> tuple:
    """A public call's outcome, pointers named by the tensor (and offset) they fall in."""
    n = len(log.launches)
    spans = [(x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()) for x in tensors]

    def name(v):
        if type(v) is int and v > 1 << 32:
            for i, (a, size) in enumerate(spans):
                if a <= v < a + max(size, 1):
                    return ("ptr", i, v - a)
            return ("allocated",)
        return v

    try:
        call()
        what: tuple = ("ok",)
    except Exception as e:  # noqa: BLE001 - the outcome compared
        message = re.sub(r"0x[0-9a-f]+", lambda h: str(name(int(h[0], 16))), str(e))  # pointers named
        what = ("raise", type(e).__name__, message)

    launched = tuple(
        (x.kernel, x.grid, x.block, tuple((k, name(v)) for k, v in x.params.items()))
        for x in log.launches[n:]
    )
    return what + launched


@contextlib.contextmanager
def _python_entries_counted(module) -> dict:
    """The compiled entries bound to counting wrappers of the Python entries: how many calls
    each entry left to Python (its recent bound calls did not take them)."""
    left = {"two": 0, "n": 0, "empty_rows": 0}

    def counted(name, fn):
        def entry(*args, **kwargs):
            left[name] += 1
            return fn(*args, **kwargs)

        return entry

    def bind(two, n, rows):
        module.bind_entries(vars(_executor), plans.recent, bound.BoundCall, pyexec.run, two, n, rows)

    python = (merge_plans.python_two, merge_states_plan.python_n, empty_rows_plan.python_run)
    bind(*(counted(k, fn) for k, fn in zip(left, python, strict=True)))
    try:
        yield left
    finally:
        bind(*python)


def test_the_executors_agree_on_random_calls(c_module):
    """Thousands of random calls of every op and adapter: each bound call met is run by both
    executors with the same outcome and launches (``Both``), and the public calls give the same
    outcome, exception and launches under the compiled executor as under the Python one, and
    through the compiled entries (the recent bound calls run from C) as through the Python ones."""
    got: dict[str, list] = {}
    for name in ("c", "python", "entries"):
        with zt.record_launches(executor="c" if name == "entries" else name) as log:
            both = Both(log, c_module)
            assert merge_plans.two is c_module.two and empty_rows_plan.run is c_module.empty_rows
            with contextlib.ExitStack() as stack:
                if name == "c":  # executor.run is not run_either: the entries leave every call
                    saved, _executor.run = _executor.run, both
                    stack.callback(setattr, _executor, "run", saved)
                if name == "entries":
                    assert _executor.run is c_module.run_either
                    left = stack.enter_context(_python_entries_counted(c_module))
                got[name] = []
                for seed in range(CALLS):
                    call, tensors = random_call(seed)
                    got[name].append(_outcome(call, tensors, log))
        if name == "c":
            runs, taken, ops = both.runs, both.taken, both.ops
    # the compiled entries took most calls a bound call takes, and left the rest to Python
    ok = sum(o[0] == "ok" for o in got["entries"])
    assert CALLS - sum(left.values()) > ok // 4 and all(left.values()), (left, ok)
    assert runs >= CALLS and CALLS // 10 < taken < runs - CALLS // 10, (runs, taken)  # both kinds, many
    assert ops >= {bound.OP_TENSOR, bound.OP_ABSENT, bound.OP_APART, bound.OP_DISTINCT, bound.OP_KEY}
    assert {bound.OP_SCALAR, bound.OP_ALLOC, bound.OP_ARITH, bound.OP_RANGE} <= ops
    for seed, (a, b, e) in enumerate(zip(got["python"], got["c"], got["entries"], strict=True)):
        assert a == b == e, (seed, a, b, e)
    raised = sum(o[0] == "raise" for o in got["c"])
    assert 0.1 * CALLS < raised < 0.9 * CALLS  # both kinds of call are many


# --- malformed calls straight to run ---------------------------------------------------------


def _bound_calls() -> list:
    """The bound calls of a few valid signatures (made in the current recording block)."""
    T, H, D = 12, 2, 16
    v = [torch.randn(T, H, D).to(BF) for _ in range(3)]
    s = [torch.randn(T, H) for _ in range(3)]
    zerokv.merge_state(v[0], s[0], v[1], s[1], out=v[2], out_lse=s[2])
    zerokv.merge_state(v[0], s[0], v[1], s[1])
    zerokv.merge_state(v[0], s[0], v[1], s[1], out=v[2], prefix_rows=5, sinks=torch.randn(H))
    zerokv.merge_states(torch.stack(v), torch.stack(s))
    zerokv.fixup_zero_kv_rows(
        v[2], s[2], torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    )
    return [bc for calls in plans.recent.values() for bc in calls]


def _fake(bc, rng: random.Random):
    """A bound call's look-alike with a damaged table, type, device or result."""
    recs = [list(r) for r in bc.records]
    for _ in range(rng.randint(1, 3)):
        r = rng.randrange(len(recs))
        recs[r][rng.randrange(bound.RECORD)] = rng.choice(
            (-1, -7, 0, 1, 3, 11, 12, 64, 159, 191, 192, 1 << 40, -(1 << 62))
        )
    table = b"".join(int(x).to_bytes(8, "little", signed=True) for r in recs for x in r)
    if rng.random() < 0.1:
        table = table[: rng.randrange(len(table))]
    return types.SimpleNamespace(
        table=table, torch_type=rng.choice((torch.Tensor, torch.Tensor, int, None)), device=rng.choice((-1, -1, 0, "x")),
        result=rng.choice((bc.result, (99,), (-1,), "ab", None)), allocators=bc.allocators,
        c_state=rng.choice((None, None, 5, torch.Tensor.__dlpack_c_exchange_api__)),
        entry=bc.entry, records=bc.records,
    )  # fmt: skip


def _bad_value(rng: random.Random, x):
    """Something in place of argument ``x``: another type, rank, size or stride."""
    choices = [
        None, 1, -1, 2.5, "t", b"x", [x], (x,), object(), np.zeros(3, np.float32), torch.Tensor,
        torch.empty(0), torch.empty(2, 3, 4, 5, 6), torch.empty(1).expand(1 << 40, 1 << 20),
        torch.empty(1, dtype=BF).expand(1 << 30, 1 << 30, 4), torch.empty(3, dtype=torch.bool),
        torch.nn.Parameter(torch.empty(4, 2)), torch.empty(2, 2, dtype=torch.complex64).conj(),
        torch.empty(2, 2).to_sparse(), torch.empty(4, 2, device="meta"),
    ]  # fmt: skip
    if (
        isinstance(x, torch.Tensor)
        and x.layout == torch.strided
        and x.is_cpu
        and x.dim() > 0
        and x.numel() < 1 << 20
    ):
        choices += [
            x[:0], x.transpose(0, -1), x.flip(0), x[..., :1], x.unsqueeze(0), x.detach().requires_grad_(x.is_floating_point()),
            x.as_strided(x.shape, (0,) * x.dim()), x.as_strided(x.shape, (1,) * x.dim()),
        ]  # fmt: skip
    return rng.choice(choices)


def test_malformed_calls_to_run_never_crash(c_module, valid_objs):
    """Wrong types, None, wrong ranks, huge or negative sizes and strides, non-tensors, short
    tuples, damaged tables: ``run`` returns a result, None, or raises a Python exception."""
    rng = random.Random(7)
    outcomes = {"none": 0, "taken": 0, "raised": 0}
    with zt.record_launches(executor="c", keep=False):
        calls = _bound_calls()
        assert calls
        for _ in range(3000):
            bc = rng.choice(calls)
            objs = list(rng.choice([c for c in valid_objs if len(c) == bc.n_slots] or valid_objs))
            for _ in range(rng.randint(0, 3)):
                if objs:
                    j = rng.randrange(len(objs))
                    objs[j] = _bad_value(rng, objs[j])
            if rng.random() < 0.1:
                objs = objs[: rng.randrange(len(objs) + 1)]
            scalars = rng.choice(((None,), (5,), (), (1 << 70,), (-3,), (True,), ("x",), (None, None, None)))
            target = _fake(bc, rng) if rng.random() < 0.3 else bc
            args = (target, tuple(objs) if rng.random() < 0.95 else objs, scalars)
            try:
                r = c_module.run(*args)
                outcomes["none" if r is None else "taken"] += 1
            except Exception:  # noqa: BLE001 - a Python exception is an answer; a crash is not
                outcomes["raised"] += 1
        for bad in ((), (None,), (1, 2), (calls[0], None, None), (None, (), ()), (calls[0], (), ())):
            with contextlib.suppress(TypeError):  # a wrong count of arguments
                c_module.run(*bad)
    assert outcomes["none"] > 100 and outcomes["taken"] > 10, outcomes


def _bad_table(rng: random.Random, table: tuple):
    """The two-way entry's table (``Layout.table()``) with one part damaged."""
    names, required, written, defaults, objs, key, scalars = table
    big, small = rng.choice((1 << 40, 1 << 31, 65, 64, 17, 16)), rng.choice((-1, -2, -(1 << 40)))
    bad = rng.choice((big, small, None, "x", 1.5, (), (1,), (1, 2, 3, 4)))
    kind = rng.randrange(9)
    if kind == 0:  # names: not strings, too many, none
        names = rng.choice(
            (names + (1,), names * 4, (), names[:3], [*names], tuple(n.encode() for n in names))
        )
    elif kind == 1:
        required, written = rng.choice(((bad, written), (required, bad), (bad, bad)))
    elif kind == 2:
        defaults = rng.choice((defaults[:-1], defaults + (None,), list(defaults), None))
    elif kind == 3 and objs:  # an object's argument, part or parts out of range
        j = rng.randrange(len(objs))
        objs = (
            objs[:j]
            + (tuple(bad if i == rng.randrange(3) else x for i, x in enumerate(objs[j])),)
            + objs[j + 1 :]
        )
    elif kind == 4:
        objs = rng.choice((objs * 6, objs + (bad,), (objs[0][:2],), objs[:0]))
    elif kind == 5 and key:
        j = rng.randrange(len(key))
        key = (
            key[:j]
            + (tuple(bad if i == rng.randrange(3) else x for i, x in enumerate(key[j])),)
            + key[j + 1 :]
        )
    elif kind == 6:
        key = rng.choice((key * 3, (), key + (bad,)))
    elif kind == 7:
        scalars = rng.choice(((bad,), scalars * 5, (len(names),), ()))
    else:
        return rng.choice(((), None, table[:6], table + (1,), list(table)))
    return names, required, written, defaults, objs, key, scalars


def test_malformed_two_tables_and_calls_never_crash(c_module):
    """``bind_entries`` checks every count and index of the two-way table it is handed (a bad
    one raises and leaves the bound one in place); the compiled ``two`` reads any call (too many
    arguments, unknown or repeated keywords, an option of several given otherwise) by a table it
    took, or hands it to the Python entry."""
    rng = random.Random(11)
    good = merge_plans.LAYOUT.table()
    bound_args = (vars(_executor), plans.recent, bound.BoundCall, pyexec.run)
    entries = (merge_plans.python_two, merge_states_plan.python_n, empty_rows_plan.python_run)
    outcomes = {"bound": 0, "refused": 0, "ran": 0, "raised": 0}
    v, s = torch.zeros(2, 2, 8, dtype=BF), torch.zeros(2, 2)
    cu, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    try:
        with zt.record_launches(executor="c", keep=False):
            for _ in range(400):
                table = _bad_table(rng, good) if rng.random() < 0.9 else good
                try:
                    c_module.bind_entries(*bound_args, *entries, table)
                    outcomes["bound"] += 1
                except (TypeError, ValueError):
                    outcomes["refused"] += 1
                args = [v, s, v, s, v.clone(), s.clone(), "e", None, (cu, lens), None, None, None]
                args += [False, None, None, None, None, "float32", None][: rng.randrange(8)]
                for _ in range(rng.randint(0, 2)):
                    args[rng.randrange(len(args))] = rng.choice(
                        (None, 3, "x", (cu,), (cu, lens, cu), [cu, lens])
                    )
                kw = rng.choice(
                    ({}, {"lse_ht": None}, {"names": None}, {"v_a": v}, {"nope": 1}, {"x" * 3: 2})
                )
                args += [None] * rng.randrange(3)  # too many
                try:
                    c_module.two(*args, **kw)
                    outcomes["ran"] += 1
                except Exception:  # noqa: BLE001 - a Python exception is an answer; a crash is not
                    outcomes["raised"] += 1
    finally:
        c_module.bind_entries(*bound_args, *entries, good)
    assert outcomes["refused"] > 100 and outcomes["bound"] > 20 and outcomes["ran"] > 20, outcomes


@pytest.fixture(scope="module")
def valid_objs() -> list[tuple]:
    """The argument tuples the ops pass to the bound calls of ``_bound_calls``'s signatures."""
    seen: list[tuple] = []

    def spy(bc, objs, scalars):
        seen.append(objs)
        return pyexec.run(bc, objs, scalars)

    with zt.record_launches(executor="python", keep=False):
        saved, _executor.run = _executor.run, spy
        try:
            _bound_calls()
            _bound_calls()
        finally:
            _executor.run = saved
    return seen


# --- subprocesses: sanitizers, a failing compiler -------------------------------------------


def _python(code: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )


def test_sanitizers_report_nothing_on_the_random_and_malformed_calls(tmp_path):
    """launcher.c built with -fsanitize=address,undefined runs a subset of the agreement and the
    fuzz in a process with libasan preloaded: no sanitizer report."""
    runtime = []  # ASan first; libstdc++ from the start, or ASan cannot intercept torch's C++ throws
    for lib in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run(
            ["cc", f"-print-file-name={lib}"], capture_output=True, text=True
        ).stdout.strip()
        assert os.path.isabs(path) and os.path.exists(path), f"no {lib} for the sanitized build ({path!r})"
        runtime.append(os.path.realpath(path))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-s", "-p", "no:cacheprovider", __file__, "-k", "agree_on or never_crash"],
        cwd=ROOT,
        env={
            **os.environ, "PYTHONPATH": str(ROOT), "ZEROKV_SANITIZE": "1", "ZEROKV_CACHE_DIR": str(tmp_path),
            "LD_PRELOAD": " ".join(runtime), "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "print_stacktrace=1",
            "ZEROKV_AGREEMENT_CALLS": "600",
        },  # fmt: skip
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert "runtime error" not in done.stderr and "ERROR: AddressSanitizer" not in done.stderr, report
    assert "3 passed" in done.stdout, report
    assert list(tmp_path.glob("launcher/launcher-asan-*")), "the sanitized build was not the one loaded"


def test_a_failing_compiler_leaves_the_python_executor(tmp_path):
    """``CC=false`` and an empty cache: ``load`` says why it has no module (one warning at most,
    ``strict`` raises), the ops run on the Python executor; a launcher built into a kernel
    directory beforehand is loaded from there without any compiler."""
    prebuilt = tmp_path / "kernels"
    cexec.build_into(prebuilt)
    code = f"""
import warnings
warnings.simplefilter("always")
import torch, zerokv, zerokv.testing as zt
from zerokv.core import cexec
with warnings.catch_warnings(record=True) as caught:
    m, why = cexec.load()
    m2, why2 = cexec.load()
assert m is None and m2 is None and why == why2 and "false" in why, why
assert len([w for w in caught if "compiled executor" in str(w.message)]) <= 1, [str(w.message) for w in caught]
try:
    cexec.load(strict=True)
    raise SystemExit("strict did not raise")
except RuntimeError as e:
    assert why in str(e)
assert zerokv.launcher()[0] == "python", zerokv.launcher()
v = [torch.randn(9, 2, 16).to(torch.bfloat16) for _ in range(3)]
s = [torch.randn(9, 2) for _ in range(3)]
with zt.record_launches() as log:
    for _ in range(3):
        zerokv.merge_state(v[0], s[0], v[1], s[1], out=v[2], out_lse=s[2])
assert log.executor == "python" and len(log.launches) == 3
out, lse = zerokv.merge_state(v[0], s[0], v[1], s[1])  # the CPU path
assert torch.isfinite(out.float()).all()
import os
os.environ["ZEROKV_KERNEL_DIR"] = {str(prebuilt)!r}
cexec._loaded.clear()
m, why = cexec.load()
assert m is not None and "ZEROKV_KERNEL_DIR" in why, why
print("OK")
"""
    done = _python(
        code, {"CC": "false", "ZEROKV_CACHE_DIR": str(tmp_path / "cache"), "ZEROKV_LAUNCHER": "auto"}
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
    assert not list((tmp_path / "cache").glob("launcher/launcher-*")), "nothing is cached by a failed build"


def test_a_corrupt_cached_launcher_is_rebuilt_once(tmp_path):
    """A cached launcher that is truncated (its digest stale, or matching), or another shared
    object under its name: rebuilt and loaded, one warning each; never loaded as it is."""
    path = cexec.build_into(tmp_path / cexec.KIND)
    code = f"""
import _ctypes, hashlib, warnings
from pathlib import Path
from zerokv.core import cexec, disk_cache
path = Path({str(path)!r})
digest = path.with_name(path.name + ".sha256")
good = path.read_bytes()
foreign = Path(_ctypes.__file__).read_bytes()
for damage, matching in ((good[:1000], False), (good[:-64], True), (foreign, True)):
    path.unlink()  # a new file: this process maps the one it loaded before
    path.write_bytes(damage)
    if matching:
        digest.write_text(hashlib.sha256(damage).hexdigest())
    disk_cache._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, why = cexec._load(False)
    assert m is not None and "built now" in why, why
    assert len([w for w in caught if "launcher" in str(w.message)]) == 1, [str(w.message) for w in caught]
    assert path.read_bytes() != damage and hashlib.sha256(path.read_bytes()).hexdigest() == digest.read_text().strip()
print("OK")
"""
    done = _python(code, {"ZEROKV_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr


def test_the_launchers_build_key_covers_each_part_it_includes(tmp_path, monkeypatch):
    """launcher.c includes exactly the parts cexec keys the build on, and an edit of any part
    names another file (a stale build is never loaded for the edited source)."""
    included = re.findall(r'^#include "([^"]+)"', cexec.SOURCE.read_text(), re.M)
    assert sorted(included) == [p.name for p in cexec.PARTS] and len(included) >= 2
    copies = []
    for f in (cexec.SOURCE, *cexec.PARTS):
        (tmp_path / f.name).write_bytes(f.read_bytes())
        copies.append(tmp_path / f.name)
    monkeypatch.setattr(cexec, "SOURCE", copies[0])
    monkeypatch.setattr(cexec, "PARTS", tuple(copies[1:]))
    names = {cexec.file_name(False)}
    for part in copies:
        part.write_bytes(part.read_bytes() + b"\n/* edited */\n")
        names.add(cexec.file_name(False))
    assert len(names) == len(copies) + 1
