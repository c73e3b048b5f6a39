"""The bound call of a signature (zerokv.core.bound, derived from the op's spec): a later call of
a known signature takes it (no full validation, no facts record), and it launches exactly what
the validated path launches for the same arguments. No GPU needed: host tensors are routed
down the GPU path with the launchers replaced by recorders (test_launch_paths)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from states import layout_states as _states

import zerokv
from zerokv.compat import sglang, vllm
from zerokv.core import bound, executor, facts, spec, validation

H, D = 4, 64
BF = torch.bfloat16


class _Weight(torch.nn.Parameter):
    """An engine's parameter class (vLLM's and others subclass ``torch.nn.Parameter``)."""


def _calls(T: int) -> list:
    """One call of each two-way and empty-rows signature family, on fresh tensors of T tokens."""
    v_a, s_a, v_b, s_b = _states(T, H, D, seed=T)
    out, out_lse = torch.empty(T, H, D, dtype=BF), torch.empty(T, H)
    cu32 = torch.tensor([0, 3, T // 2, T], dtype=torch.int32)
    kv32 = torch.tensor([0, 5, 0], dtype=torch.int32)
    cu64, kv64 = cu32.long(), kv32.long()
    ckv = torch.tensor([0, 0, 4, 4], dtype=torch.int32)
    sinks, scale = torch.randn(H), torch.tensor([0.25])
    sinks_param = _Weight(sinks.clone(), requires_grad=False)  # an engine's own parameter class
    v_a_param = torch.nn.Parameter(v_a.clone(), requires_grad=True)
    out8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn)
    bscale = torch.empty(T, H * D // 32)
    mask = torch.rand(T) > 0.5
    odd = torch.empty(T * H * D + 1, dtype=BF)[1:].view(T, H, D)
    v_a2, s_a2 = v_a.clone(), s_a.clone()
    lse_ht = torch.randn(H, T).T
    v3, s3 = torch.randn(3, T, H, D).to(BF), torch.randn(3, T, H)
    v3_param = torch.nn.Parameter(v3.clone(), requires_grad=False)
    f32 = (v_a.float(), s_a, v_b.float(), s_b)  # the plain call's pattern with other sizes
    out32, v3f = torch.empty(T, H, D), v3.float()
    v2, s2 = v3[:2], s3[:2]
    return [
        ("plain", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)),
        ("float32", lambda: zerokv.merge_state(*f32, out=out32, out_lse=out_lse)),
        ("float32 merge_states", lambda: zerokv.merge_states(v3f, s3, out=out32, out_lse=out_lse)),
        ("no out_lse", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)),
        ("allocated", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b)),
        ("prefix_rows", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, prefix_rows=T // 2)),
        (  # a scheduler's numpy count: the bound call of the Python int's signature takes it
            "prefix_rows numpy",
            lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, prefix_rows=np.int64(T // 2)),
        ),
        ("a_empty int32", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, a_empty=(cu32, kv32))),
        ("a_empty int64", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, a_empty=(cu64, kv64))),
        ("sinks", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse, sinks=sinks)),
        (  # a module's weights among the inputs (a sink; v_a needing grad): the plain tensors' bound call
            "parameters",
            lambda: zerokv.merge_state(v_a_param, s_a, v_b, s_b, out=out, out_lse=out_lse, sinks=sinks_param),
        ),
        ("out_scale", lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out8, out_scale=scale)),
        (
            "per-group fp8",
            lambda: zerokv.merge_state(v_a, s_a, v_b, s_b, out=out8, out_block_scale=bscale, quant_group=32),
        ),
        ("row_mask", lambda: zerokv.merge.merge_two(v_a, s_a, v_b, s_b, out, row_mask=mask)),
        ("in place", lambda: zerokv.merge_state(v_a2, s_a2, v_b, s_b, out=v_a2, out_lse=s_a2)),
        ("unaligned", lambda: zerokv.merge_state(odd, s_a, v_b, s_b, out=out)),
        ("vllm [H, T]", lambda: vllm.merge_attn_states(out, v_a, s_a.T, v_b, s_b.T, out_lse.T)),
        ("sglang", lambda: sglang.merge_state_v2(v_a, s_a, v_b, s_b)),
        ("torch.ops", lambda: torch.ops.zerokv.merge_state_out(v_a, s_a, v_b, s_b, out, out_lse)),
        ("merge_states N = 2", lambda: zerokv.merge_states(v2, s2, out=out, out_lse=out_lse)),
        ("merge_states N = 3", lambda: zerokv.merge_states(v3, s3, out=out, out_lse=out_lse)),
        ("merge_states allocated", lambda: zerokv.merge_states(v3, s3)),
        ("merge_states sinks", lambda: zerokv.merge_states(v3, s3, out=out, sinks=sinks)),
        ("merge_states parameters", lambda: zerokv.merge_states(v3_param, s3, out=out, sinks=sinks_param)),
        ("merge_states out_scale", lambda: zerokv.merge_states(v2, s2, out=out8, out_scale=scale)),
        (
            "merge_states per-group fp8",
            lambda: zerokv.merge_states(v2, s2, out=out8, out_block_scale=bscale, quant_group=32),
        ),
        ("merge_states torch.ops", lambda: torch.ops.zerokv.merge_states_out(v3, s3, out, out_lse)),
        ("fixup", lambda: zerokv.fixup_zero_kv_rows(out, out_lse, kv32, cu32)),
        ("fixup int64", lambda: zerokv.fixup_zero_kv_rows(out, lse_ht, kv64, cu64)),
        ("mask_empty_context", lambda: zerokv.mask_empty_context(out, out_lse, cu32, ckv)),
    ]


@pytest.fixture
def counted(recorded, monkeypatch):
    """The recorder's log and a count of full validations and facts records, per op."""
    seen = {"validate": 0, "facts": 0}

    def count(fn, what):
        def counted_fn(*a, **k):
            seen[what] += 1
            return fn(*a, **k)

        return counted_fn

    monkeypatch.setattr(validation, "validate", count(validation.validate, "validate"))
    monkeypatch.setattr(facts, "of", count(facts.of, "facts"))
    return recorded, seen


def test_a_later_call_of_a_signature_takes_its_bound_call(counted):
    """Every family's second call (a new T, new tensors) launches without the full validation
    or a facts record."""
    log, seen = counted
    first, later = _calls(48), _calls(61)
    for (name, call), (_, again) in zip(first, later, strict=True):
        call()
        seen["validate"] = seen["facts"] = 0
        launched = len(log)
        again()
        assert seen == {"validate": 0, "facts": 0}, name
        assert len(log) == launched + 1, name
        seen["validate"] = seen["facts"] = 0


def test_bound_calls_launch_what_the_validated_path_launches(recorded, monkeypatch):
    """The same calls with every signature's bound call and without any (each call fully
    validated, its facts put in order by the kernels' getters): the same kernels, grids and
    arguments by name, for a first T and a later one of another form."""
    series = [c for T in (48, 61, 3000) for c in _calls(T)]
    for _, call in series:
        call()
    generated = list(recorded)
    recorded.clear()
    from zerokv.core import plans

    plans.clear_cache()
    monkeypatch.setattr(executor, "run", lambda *a: None)  # every call down the validated path
    for _, call in series:
        call()
    assert len(recorded) == len(generated) == len(series)
    for (name, _), got, want in zip(series, generated, recorded, strict=True):
        if name in (
            "allocated",
            "sglang",
            "merge_states allocated",
        ):  # outputs allocated per call: their pointers differ
            got, want = (
                r[:3] + ({k: v for k, v in r[3].items() if k not in ("out", "olse")},) for r in (got, want)
            )
        assert got == want, name


def test_a_dozen_signatures_met_in_turn_each_take_their_own_bound_call(counted):
    """Twelve signatures of the same scalar arguments (three dtypes, each with and without an
    LSE out, an unaligned out, sinks) called in turn: after each one's first call, no call is
    validated again or read into facts, and each launches what its validated first call did."""
    log, seen = counted
    T = 24
    calls = []
    for dt in (BF, torch.float16, torch.float32):
        v_a, s_a, v_b, s_b = (x.to(dt) if x.dim() == 3 else x for x in _states(T, H, D, seed=len(calls)))
        a = (v_a, s_a, v_b, s_b)
        out, out_lse = torch.empty(T, H, D, dtype=dt), torch.empty(T, H)
        odd = torch.empty(T * H * D + 1, dtype=dt)[1:].view(T, H, D)
        sinks = torch.randn(H)
        calls += [
            lambda a=a, o=out, ol=out_lse: zerokv.merge_state(*a, out=o, out_lse=ol),
            lambda a=a, o=out: zerokv.merge_state(*a, out=o),
            lambda a=a, o=odd, ol=out_lse: zerokv.merge_state(*a, out=o, out_lse=ol),
            lambda a=a, o=out, ol=out_lse, k=sinks: zerokv.merge_state(*a, out=o, out_lse=ol, sinks=k),
        ]
    first = []
    for call in calls:
        call()
        first.append(log[-1])
    assert seen["validate"] == len(calls)  # twelve signatures: each its own plan
    seen["validate"] = seen["facts"] = 0
    for _ in range(2):
        for call, want in zip(calls, first, strict=True):
            launched = len(log)
            call()
            assert len(log) == launched + 1 and log[-1] == want
    assert seen == {"validate": 0, "facts": 0}


def test_a_call_no_bound_call_takes_is_validated_once_and_launched_from_its_facts(counted):
    """A later call its signature's bound call refuses (numpy arrays read backwards: a negative
    token stride) runs the full validation once and launches from the facts of that validation:
    the pointer of its first token, the strides as they are; what the bound call launches for
    the same memory read forwards differs only there."""
    log, seen = counted
    T = 20
    v_a, s_a, v_b, s_b = (x.float().numpy() for x in _states(T, H, D))
    out, out_lse = np.empty((T, H, D), np.float32), np.empty((T, H), np.float32)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    forwards = log[-1]
    for _ in range(2):
        seen["validate"] = seen["facts"] = 0
        zerokv.merge_state(v_a[::-1], s_a, v_b, s_b, out=out, out_lse=out_lse)
        assert seen == {"validate": 1, "facts": 1}
        got = log[-1]
        assert got[:2] == forwards[:2]
        va_st = got[3]["va_st"]
        assert va_st == -H * D and got[3]["va"] == v_a.ctypes.data + (T - 1) * H * D * 4
        same = {k: v for k, v in got[3].items() if k not in ("va", "va_st")}
        assert same == {k: v for k, v in forwards[3].items() if k not in ("va", "va_st")}


def test_a_parameter_is_read_as_a_plain_tensor_unless_it_requires_grad_as_an_output(counted):
    """A module's parameter takes the bound call of plain tensors as an input (v_a needing
    grad) and as an output it may write (no grad), launched with its memory; as an output that
    requires grad it is refused by name by the full validation, on every call."""
    log, seen = counted
    T = 16
    v_a, s_a, v_b, s_b = _states(T, H, D)
    out = torch.empty(T, H, D, dtype=BF)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)
    want = log[-1]
    for _ in range(2):
        seen["validate"] = 0
        with pytest.raises(ValueError, match=r"^out: requires grad"):
            zerokv.merge_state(v_a, s_a, v_b, s_b, out=torch.nn.Parameter(out.clone()))
        assert seen["validate"] == 1
        param = torch.nn.Parameter(torch.full((T, H, D), float("nan"), dtype=BF), requires_grad=False)
        v_a_param = torch.nn.Parameter(v_a.clone(), requires_grad=True)
        zerokv.merge_state(v_a_param, s_a, v_b, s_b, out=param)
        assert seen["validate"] == 1 and log[-1][:3] == want[:3]
        assert (log[-1][3]["out"], log[-1][3]["va"]) == (param.data_ptr(), v_a_param.data_ptr())


def test_a_signature_met_first_with_a_parameter_output_gets_its_bound_call(counted):
    """A signature whose first call writes into a module's parameter (no grad) is a torch
    signature with a bound call: a later call with another such output is not validated."""
    log, seen = counted
    T = 16
    v_a, s_a, v_b, s_b = _states(T, H, D)

    def out():
        return torch.nn.Parameter(torch.full((T, H, D), float("nan"), dtype=BF), requires_grad=False)

    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out())
    seen["validate"] = 0
    later = out()
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=later)
    assert seen["validate"] == 0 and log[-1][3]["out"] == later.data_ptr()


def test_a_scalar_in_the_key_is_taken_alike_by_the_bound_call_and_the_full_validation(counted):
    """quant_group is part of a later call's key, so a number equal to 32 (32.0, numpy's) finds
    the bound call of 32; the full validation takes them too, on a signature's first call; a
    bool or another size is refused by name."""
    from zerokv.core import plans

    log, seen = counted
    T = 8
    v_a, s_a, v_b, s_b = _states(T, H, D)
    out, bs = torch.empty(T, H, D, dtype=torch.float8_e4m3fn), torch.empty(T, H * D // 32)

    def call(q):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_block_scale=bs, quant_group=q)

    call(32)
    want = log[-1]
    for q in (32.0, np.int64(32), np.float32(32)):
        seen["validate"] = 0
        call(q)
        assert seen["validate"] == 0 and log[-1] == want, q
        plans.clear_plans()
        call(q)  # a first call: validated, and launched alike
        assert seen["validate"] == 1 and log[-1] == want, q
    for bad in (True, 24.0, np.int64(24)):
        with pytest.raises(ValueError, match="^quant_group: expected a power of two"):
            call(bad)
    from fractions import Fraction

    plain = lambda base: zerokv.merge_state(v_a, s_a, v_b, s_b, out=torch.empty(T, H, D), lse_base=base)  # noqa: E731
    plain(2)
    want = log[-1]
    for base in (2.0, np.float32(2), Fraction(2), 2 + 0j):  # lse_base: also in the key
        plans.clear_plans()
        plain(base)
        assert log[-1][:3] == want[:3] and log[-1][3]["k"] == want[3]["k"], base


def test_each_kernel_parameter_comes_from_a_register_its_bound_call_names(recorded):
    """The Python executor keeps only the registers something reads: every register a form's
    kernel reads a parameter from, for a first T and a later one of another form, is among
    the bound call's ``params``."""
    from zerokv.core import plans

    for T in (48, 3000):
        for _, call in _calls(T):
            call()
    bcs = {bc for calls in plans.recent.values() for bc in calls}
    assert {bc.name for bc in bcs} == {
        "merge_state",
        "merge_states",
        "fixup_zero_kv_rows",
        "mask_empty_context",
    }
    for bc in bcs:
        assert bc.params is not None and bc.forms, bc.name
        for e in bc.forms.values():
            assert {r for r in e.srcs if r < bound.CONST_BASE} <= bc.params, (bc.name, e.kernel.name)


def test_a_bound_call_of_another_signature_is_not_taken(counted):
    """Signatures met one after another (a new dtype, an option more, another producer):
    each call finds its own plan; a bound call never launches another signature's call."""
    log, _ = counted
    T = 40
    v_a, s_a, v_b, s_b = _states(T, H, D)
    f16 = [x.half() if x.dtype == BF else x for x in (v_a, s_a, v_b, s_b)]
    for _ in range(2):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=torch.empty(T, H, D, dtype=BF))
        assert log[-1][1][:2] == ("zk_bfloat16", "zk_bfloat16")
        zerokv.merge_state(*f16, out=torch.empty(T, H, D, dtype=torch.float16))
        assert log[-1][1][:2] == ("zk_half", "zk_half")
        zerokv.merge_state(*f16, out=torch.empty(T, H, D))
        assert log[-1][1][:2] == ("zk_half", "float")


def test_a_bound_call_is_a_table_of_fixed_size_integer_records(counted):
    """What a compiled executor runs: records of RECORD integers, the same bytes in ``table``."""
    log, _ = counted
    v_a, s_a, v_b, s_b = _states(16, H, D)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=torch.empty(16, H, D, dtype=BF))
    from zerokv.core import plans

    (bc,) = next(iter(plans.recent.values()))
    assert all(len(r) == bound.RECORD and all(type(x) is int for x in r) for r in bc.records)
    assert len(bc.table) == 8 * bound.RECORD * len(bc.records)
    assert bc.records[-1][0] == bound.OP_KEY


@pytest.mark.parametrize("seed", range(600))
def test_a_bound_call_takes_no_call_the_full_validation_rejects(counted, seed):
    """Random layouts in shared buffers (padded strides, transposed LSEs), the six tensors placed
    in a random order one after another in their buffer, one of them over the last element (V:
    pack) of the one before (an overlap of inputs, or of an output), or exactly state a (in
    place): whatever the signature's bound call takes, the full validation
    accepts, and it launches what the validated path launches for the same call."""
    import random

    from zerokv.core import plans

    log, _ = counted
    rng = random.Random(seed)
    T, H, D = rng.randint(1, 24), rng.randint(1, 6), rng.choice((8, 16, 64))
    vbuf, sbuf = torch.randn(8 * T * H * (D + 8) + 64).to(BF), torch.randn(8 * T * (H + 4) + 64)
    ends: dict[str, list[int]] = {"v": [0], "s": [0]}  # where each buffer's tensors end

    def place(name, kind, shape, strides, span):
        unit = 8 if kind == "v" else 1  # V stays on 16 bytes: the aligned signature's calls
        gap = -unit if name == short and len(ends[kind]) > 1 else rng.choice((0, 0, unit, 8 * unit))
        start = max(ends[kind]) + gap  # after the buffer's last tensor, or over its last element
        ends[kind].append(start + span)
        return (vbuf if kind == "v" else sbuf).as_strided(shape, strides, start)

    def v(name):
        pad = rng.choice((0, 0, 8))
        st = (H * (D + pad), D + pad, 1)
        return place(name, "v", (T, H, D), st, (T - 1) * st[0] + (H - 1) * st[1] + D)

    def s(name):
        pad = rng.choice((0, 0, 4))
        st = (1, T + pad) if rng.random() < 0.3 else (H + pad, 1)  # an [H, T] buffer's transpose
        return place(name, "s", (T, H), st, (T - 1) * st[0] + (H - 1) * st[1] + 1)

    order = ["v_a", "s_a", "v_b", "s_b", "out", "out_lse"]
    rng.shuffle(order)  # outputs placed before or after the inputs they may touch
    short = rng.choice(order)  # the one tensor that starts on its predecessor's last element
    t = {n: s(n) if n.startswith("s") or n == "out_lse" else v(n) for n in order}
    v_a, s_a, v_b, s_b, out, out_lse = (t[n] for n in ("v_a", "s_a", "v_b", "s_b", "out", "out_lse"))
    if rng.random() < 0.15:  # in place: out and out_lse exactly state a's
        out, out_lse = v_a, s_a
    zerokv.merge_state(
        *_states(T, H, D, seed=seed), out=torch.empty(T, H, D, dtype=BF), out_lse=torch.empty(T, H)
    )
    scalars = ("e", True, False, False, None, "float32", False)
    objs = (v_a, s_a, v_b, s_b, out, out_lse, None, None, None, None, None)
    taken = any(executor.run(bc, objs, (None,)) is not None for bc in plans.recent.get(scalars, ()))
    try:
        validation.validate(spec.MERGE_STATE, objs, {"lse_base": "e"})
        valid = True
    except ValueError:
        valid = False
    SEEN.append((taken, valid))
    assert valid or not taken, "the bound call took a call the full validation rejects"
    if taken:
        generated = log[-1]
        plans.clear_cache()
        with pytest.MonkeyPatch.context() as m:
            m.setattr(executor, "run", lambda *a: None)
            zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
        assert log[-1] == generated


SEEN: list[tuple[bool, bool]] = []  # (taken, valid) of each layout: the mix this test covers


def test_a_later_merge_states_call_with_outputs_of_another_shape_is_refused_by_name(counted):
    """merge_states' bound call sends outputs of another shape (or a stride under head_dim)
    to the full validation, which names them; nothing is launched."""
    log, _ = counted
    T = 12
    v, s = torch.randn(3, T, H, D).to(BF), torch.randn(3, T, H)
    zerokv.merge_states(v, s, out=torch.empty(T, H, D, dtype=BF), out_lse=torch.empty(T, H))
    launched = len(log)
    for out, out_lse, match in [
        (torch.empty(T, H, D, dtype=BF), torch.empty(T, H + 1), "out_lse: expected shape"),
        (torch.empty(T + 1, H, D, dtype=BF), torch.empty(T, H), "out: expected shape"),
        (torch.empty(T, H, D, 2, dtype=BF)[..., 0], torch.empty(T, H), "out"),
    ]:
        with pytest.raises(ValueError, match=match):
            zerokv.merge_states(v, s, out=out, out_lse=out_lse)
    assert len(log) == launched


def test_a_later_per_group_fp8_call_with_out_lse_on_an_input_lse_is_refused_by_name(counted):
    """With out_block_scale the spec takes out_lse's aliases away: a later call of the signature
    whose out_lse is s_a itself goes to the full validation, which names it; nothing launched."""
    log, _ = counted
    T = 10
    v_a, s_a, v_b, s_b = _states(T, H, D, seed=3)
    out8, bscale = torch.empty(T, H, D, dtype=torch.float8_e4m3fn), torch.empty(T, H * D // 32)
    zerokv.merge_state(
        v_a, s_a, v_b, s_b, out=out8, out_lse=torch.empty(T, H), out_block_scale=bscale, quant_group=32
    )
    launched = len(log)
    before = s_a.clone()
    with pytest.raises(ValueError, match="out_lse: may not alias s_a or s_b with out_block_scale"):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out8, out_lse=s_a, out_block_scale=bscale, quant_group=32)
    assert len(log) == launched and torch.equal(s_a, before)
