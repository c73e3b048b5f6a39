"""The two-way entry's arguments as its table says (``entry_args.Layout``): the Python entry
reads a call as the compiled entry's table reads it (the table's own reading is the oracle),
an option appended to the spec is read by both with no edit of either, and the torch.ops schemas
take the spec's options as they were written by hand. No GPU."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import zerokv
import zerokv.testing as zt
from zerokv.core import cexec, entry_args, merge_plans, op_schema, plans, spec

LAYOUT = merge_plans.LAYOUT
_EXTRA = spec.Option(
    "extra",
    (spec.Arg("extra", ("H",), ("float32",), ("extra",), unit_inner=True),),
    "extra",
    ("extra",),
    (spec.Scalar("extra_mode", ("a", "b")),),
)
EXTRA_SPEC = dataclasses.replace(spec.MERGE_STATE, options=(*spec.MERGE_STATE.options, _EXTRA))
EXTRA = entry_args.Layout(
    merge_plans.python_two,
    tuple(
        (k, LAYOUT.names[a], LAYOUT.names[b] if k == entry_args.K_OR_IS_NONE else None)
        for k, a, b in LAYOUT.key
    ),
    ("prefix_rows",),
    EXTRA_SPEC,
)


def _table_read(layout, args: tuple, kwargs: dict) -> tuple[tuple, tuple, tuple]:
    """``(objects, key, scalars)`` of a call by the layout's table, read as the compiled entry
    reads it: the oracle of both entries."""
    a = list(args) + [None] * (len(layout.names) - len(args))
    given = [i < len(args) for i in range(len(layout.names))]
    for k, v in kwargs.items():
        i = layout.names.index(k, 0, layout.written)
        a[i], given[i] = v, True
    a = [x if g else d for x, g, d in zip(a, given, layout.defaults, strict=True)]
    objs = tuple(a[i] if p < 0 or a[i] is None else a[i][p] for i, p, _ in layout.objs)
    make = {
        entry_args.K_VALUE: lambda x, y: x,
        entry_args.K_IS_NONE: lambda x, y: x is None,
        entry_args.K_NOT_NONE: lambda x, y: x is not None,
        entry_args.K_OR_IS_NONE: lambda x, y: (y is None) if x is None else x,
    }
    key = tuple(make[k](a[i], a[j]) for k, i, j in layout.key)
    return objs, key, tuple(a[i] for i in layout.scalars)


class _Seen(Exception):
    pass


def _python_read(monkeypatch, layout, args, kwargs):
    """``(objects, key, scalars)`` the Python entry hands its recent bound calls."""
    got = []

    def recent_call(key, objs, scalars):
        got.append((objs, key, scalars))
        raise _Seen

    monkeypatch.setattr(merge_plans, "LAYOUT", layout)
    monkeypatch.setattr(merge_plans, "_MORE_KEY", layout.more_key)
    monkeypatch.setattr(plans, "recent_call", recent_call)
    with pytest.raises(_Seen):
        merge_plans.python_two(*args, **kwargs)
    objs, key, scalars = got[0]
    n = len(layout.objs)
    return objs + (None,) * (n - len(objs)), key, scalars


def _random_call(rng: random.Random, layout):
    """Distinct objects for the arguments of a call (a pair for an option of several), some
    left out at the end, some given by keyword."""
    values = []
    for i, name in enumerate(layout.names):
        several = [p for a, p, k in layout.objs if a == i and k > 1]
        if name in (
            "lse_base",
            "scale_format",
            "extra_mode",
            "quant_group",
            "suffix_verbatim",
            "allocate_lse",
        ):
            pool = {
                "lse_base": ("e", 2), "scale_format": ("float32", "ue8m0"), "extra_mode": ("a", "b"),
                "quant_group": (None, 64), "suffix_verbatim": (False, True), "allocate_lse": (None, True, False),
            }[name]  # fmt: skip
            values.append(rng.choice(pool))
        elif name == "names":
            values.append(rng.choice((None, {"v_a": "x"})))
        elif several:
            values.append(rng.choice((None, tuple(object() for _ in several))))
        else:
            values.append(rng.choice((None, object())) if i >= 4 else object())
    n = rng.randrange(layout.required, len(values) + 1)
    written = layout.written  # the Python function's parameters: by keyword too
    if n <= written and n > layout.required and rng.random() < 0.4:
        first = rng.randrange(layout.required, n)
        return tuple(values[:first]), {layout.names[i]: values[i] for i in range(first, n)}
    return tuple(values[:n]), {}


@pytest.mark.parametrize("layout", [LAYOUT, EXTRA], ids=["spec", "spec and one more option"])
def test_the_python_entry_reads_a_call_as_the_compiled_entrys_table(monkeypatch, layout):
    rng = random.Random(5)
    for _ in range(300):
        args, kwargs = _random_call(rng, layout)
        want = _table_read(layout, args, kwargs)
        got = _python_read(monkeypatch, layout, args, kwargs)
        assert got[1] == want[1], (args, kwargs)
        assert got[2] == want[2]
        assert len(got[0]) == len(want[0]) and all(a is b for a, b in zip(got[0], want[0], strict=True))


def test_an_option_appended_to_the_spec_comes_after_the_written_ones():
    assert EXTRA.names == LAYOUT.names + ("extra", "extra_mode")
    assert EXTRA.defaults[-2:] == (None, "a")
    assert EXTRA.objs == LAYOUT.objs + ((len(LAYOUT.names), -1, 1),)
    assert EXTRA.key == LAYOUT.key + ((entry_args.K_VALUE, len(LAYOUT.names) + 1, 0),)
    assert EXTRA.option_scalars(("e", True, False, True, 64, "ue8m0", False, "b")) == (64, "ue8m0", "b")
    too_many = (None,) * (len(EXTRA.names) - EXTRA.written + 1)
    with pytest.raises(TypeError, match=f"takes {len(EXTRA.names)} arguments"):
        EXTRA.more_args((), (), too_many, None)


def test_the_compiled_entry_keys_a_call_by_the_table_it_is_handed():
    """A table with one more option: the compiled entry makes its key with the option's scalar
    (its recent bound calls under that key take the call; another value of it: the Python
    entry's)."""
    module, _ = cexec.load(strict=True)
    from zerokv.core import bound, empty_rows_plan, merge_states_plan, pyexec
    from zerokv.core import executor as _executor

    v, s = [torch.randn(3, 2, 16).to(torch.bfloat16) for _ in range(3)], [torch.randn(3, 2) for _ in range(3)]
    entries = (merge_plans.python_two, merge_states_plan.python_n, empty_rows_plan.python_run)
    left = []

    def python_two(*args, **kwargs):
        left.append(args)
        return merge_plans.python_two(*args[: len(LAYOUT.names)], **kwargs)

    head = (vars(_executor), plans.recent, bound.BoundCall, pyexec.run)
    with zt.record_launches(executor="c") as log:
        zerokv.merge_state(v[0], s[0], v[1], s[1], out=v[2], out_lse=s[2])
        call = (v[0], s[0], v[1], s[1], v[2], s[2], "e", None, None, None, None, None, False, None, None)
        key = _table_read(LAYOUT, call, {})[1]
        plans.recent[(*key, "b")] = plans.recent[key]
        try:
            module.bind_entries(*head, python_two, *entries[1:], EXTRA.table())
            full = [*call, *EXTRA.defaults[len(call) :]]
            full[EXTRA.names.index("extra")] = torch.zeros(2)
            module.two(*full[:-1], "b")
            assert not left and len(log.launches) == 2
            module.two(*full[:-1], "a")  # no bound call under this key
            assert len(left) == 1 and len(log.launches) == 3
            with pytest.raises(TypeError, match="extra"):  # by position only, as the Python entry
                module.two(*call, extra=torch.zeros(2))
            assert len(left) == 2
        finally:
            module.bind_entries(*head, *entries, LAYOUT.table())


_SCHEMAS = {
    "merge_state": 'zerokv::merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, str lse_base="e", '
    "SymInt? prefix_rows=None, Tensor? a_cu_seqlens_q=None, Tensor? a_kv_lens=None, Tensor? sinks=None) "
    "-> (Tensor, Tensor)",
    "merge_state_out": "zerokv::merge_state_out(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, Tensor(a!) out, "
    'Tensor(b!)? out_lse, str lse_base="e", SymInt? prefix_rows=None, Tensor? a_cu_seqlens_q=None, '
    "Tensor? a_kv_lens=None, Tensor? out_scale=None, Tensor? sinks=None, Tensor(c!)? out_block_scale=None, "
    'int? quant_group=None, str scale_format="float32") -> ()',
    "merge_states": 'zerokv::merge_states(Tensor v, Tensor s, str lse_base="e", Tensor? sinks=None) '
    "-> (Tensor, Tensor)",
    "merge_states_out": "zerokv::merge_states_out(Tensor v, Tensor s, Tensor(a!) out, Tensor(b!)? out_lse, "
    'str lse_base="e", Tensor? out_scale=None, Tensor? sinks=None, Tensor(c!)? out_block_scale=None, '
    'int? quant_group=None, str scale_format="float32") -> ()',
}


@pytest.mark.parametrize("name", sorted(_SCHEMAS))
def test_the_schemas_derived_from_the_spec_are_those_written_by_hand_before(name):
    assert str(getattr(torch.ops.zerokv, name).default._schema) == _SCHEMAS[name]


def test_a_schema_takes_an_appended_option_and_passes_it_on():
    fixed = {"suffix_verbatim": False, "allocate_lse": None, "names": {}, "lse_ht": None}
    opts = op_schema.Options(EXTRA, True, fixed)
    assert opts.schema.endswith(", Tensor? extra=None, str extra_mode='a'")
    x, cu, lens = object(), object(), object()
    tail = opts((cu, lens, *opts.defaults[2:-2], x))  # extra and extra_mode: the last two
    by_name = dict(zip(EXTRA.names[8:], tail, strict=True))
    assert by_name["a_empty"] == (cu, lens) and by_name["extra"] is x and by_name["extra_mode"] == "a"
    assert by_name["row_mask"] is None and by_name["names"] == {}
    with pytest.raises(ValueError, match="a_cu_seqlens_q and a_kv_lens: give both or neither"):
        opts((cu,))
    assert "extra" not in op_schema.Options(LAYOUT, True, fixed).schema


def test_merge_states_schemas_take_an_appended_option_by_its_keyword():
    extra = dataclasses.replace(spec.MERGE_STATES, options=(*spec.MERGE_STATES.options, _EXTRA))
    for out in (False, True):
        kw = op_schema.Keywords(extra, out)
        assert kw.schema.endswith(", Tensor? sinks=None, Tensor? extra=None, str extra_mode='a'") != out
        assert (
            kw.schema.endswith(", str scale_format='float32', Tensor? extra=None, str extra_mode='a'") == out
        )
        x = object()
        got = kw((*kw.defaults[:-2], x, "b"))
        assert got["extra"] is x and got["extra_mode"] == "b" and got["sinks"] is None
        assert set(got) == set(kw.names) and ("out_scale" in got) == out
        assert kw((x,)) == {"out_scale" if out else "sinks": x}  # those left at the end: omitted
    with pytest.raises(ValueError, match="several arguments"):
        op_schema.Keywords(spec.MERGE_STATE, True)  # a_empty is a pair: the two-way entry's Options


def test_every_option_reaches_the_reference_or_the_cpu_paths_writing():
    """An option the float64 reference does not take by its name and the CPU path does not
    write would be ignored on host tensors."""
    import inspect

    from zerokv import reference
    from zerokv.core import cpu_path

    takes = inspect.signature(reference.merge_state).parameters
    for o in spec.MERGE_STATE.options:
        assert (o.name in takes) != (o.name in cpu_path.WRITING), o.name
