"""Each kernel's Python description against its C parameter list in kernels_cu/ (no GPU needed).

The packing of every launch comes from the description; these tests make a description that
disagrees with the kernel (a parameter renamed, retyped, missing or swapped) fail here rather
than as garbage on a GPU.
"""

from __future__ import annotations

import dataclasses
import random
import re
from types import SimpleNamespace

import pytest

from zerokv.core import bound as _bound
from zerokv.core import forms
from zerokv.core import kernel_params as _kernel_params
from zerokv.core import kernels as _kernels
from zerokv.core import offline as _offline
from zerokv.core import sources as _sources
from zerokv.core import spec as _spec

_GLOBAL = re.compile(
    r"__global__\s+void\s+(__launch_bounds__\((?P<bounds>[^)]*)\)\s+)?(?P<name>\w+)\s*\((?P<params>[^)]*)\)",
    re.S,
)


_STRUCT = re.compile(r"template\s*<(?P<targs>[^>]*)>\s*struct\s+(?P<name>\w+)\s*\{(?P<body>[^}]*)\};", re.S)


def _c_type(decl: str) -> str:
    """Our C-type class of one parameter declaration (``const Tin* va`` -> ``ptr``)."""
    decl = re.sub(r"\b(const|__restrict__|volatile|__grid_constant__)\b", " ", decl)
    if "*" in decl:
        return "ptr"
    words = decl.split()[:-1]
    kind = " ".join(words)
    types = {"i64": "i64", "long long": "i64", "int": "i32", "unsigned": "u32", "float": "f32"}
    if kind not in types:
        raise AssertionError(f"parameter {decl.strip()!r} has a type the runtime cannot pack")
    return types[kind]


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside template brackets; empty pieces dropped."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [x.strip() for x in out if x.strip()]


def _struct_fields(text: str, decl: str) -> list[tuple[str, str]] | None:
    """The fields ``[(name, type)]`` of the struct a parameter declaration ``decl`` takes by value
    (``const FlatArgs<Tin, Tout, int> p``), its template parameters replaced by the declaration's
    arguments; None when ``decl`` names no struct template of ``text``."""
    m = re.search(r"(\w+)\s*<(.*)>\s*\w+$", decl)
    structs = {s["name"]: s for s in _STRUCT.finditer(text)}
    if m is None or m[1] not in structs:
        return None
    s = structs[m[1]]
    formal = [t.split()[-1] for t in _split(s["targs"], ",")]
    actual = dict(zip(formal, _split(m[2], ","), strict=True))
    fields = []
    for member in _split(s["body"], ";"):
        first, *more = _split(member, ",")
        base, _, name = first.rpartition(" ")
        stars = base.count("*")
        base = re.sub(r"\b\w+\b", lambda w: actual.get(w[0], w[0]), base.replace("*", " "))
        for i, declarator in enumerate([name, *more]):
            ptr = "*" * ((stars if i == 0 else 0) + declarator.count("*"))
            name_i = declarator.strip("* ")
            fields.append((name_i, _c_type(f"{base} {ptr} {name_i}")))
    return fields


def c_signature(kernel: _kernels.Kernel, text: str | None = None) -> tuple[str, list[tuple[str, str]]]:
    """``(launch bounds text, [(name, type), ...])`` of ``kernel`` as its source (or ``text``)
    declares it. A kernel that takes a struct by value takes it alone (its fields then lie where
    a parameter list's would: from offset 0, each at its natural alignment), and the list is the
    struct's fields."""
    text = re.sub(r"//[^\n]*", "", _sources.kernel_source(kernel) if text is None else text)
    found = {m["name"]: m for m in _GLOBAL.finditer(text)}
    assert kernel.name in found, f"{kernel.name}: no __global__ function of that name in {kernel.stem}.cu"
    m = found[kernel.name]
    decls = _split(m["params"], ",")
    structs = [f for f in (_struct_fields(text, d) for d in decls) if f is not None]
    if structs:
        assert len(decls) == 1, f"{kernel.name}: a struct parameter must be the only one"
        return m["bounds"] or "", structs[0]
    return m["bounds"] or "", [(re.findall(r"\w+", d)[-1], _c_type(d)) for d in decls]


def mismatches(kernel: _kernels.Kernel, text: str | None = None) -> list[str]:
    """How ``kernel``'s description differs from its C signature (empty: they agree)."""
    _, params = c_signature(kernel, text)
    described = list(kernel.params)
    problems = []
    if [n for n, _ in described] != [n for n, _ in params]:
        problems.append(f"names/order: described {[n for n, _ in described]}, C {[n for n, _ in params]}")
    for (n, t), (cn, ct) in zip(described, params, strict=False):
        if n == cn and t != ct:
            problems.append(f"{n}: described as {t}, C type is {ct}")
    return problems


@pytest.mark.parametrize("kernel", _kernels.KERNELS, ids=lambda k: k.name)
def test_description_matches_the_c_parameter_list(kernel):
    assert mismatches(kernel) == []


@pytest.mark.parametrize("kernel", _kernels.KERNELS, ids=lambda k: k.name)
def test_block_size_reaches_the_launch_bounds(kernel):
    bounds, _ = c_signature(kernel)
    assert bounds.split(",")[0].strip() == f"ZK_BLOCK_{kernel.name}", bounds
    assert f"#define ZK_BLOCK_{kernel.name} {kernel.block}\n" in _sources.kernel_source(kernel)


@pytest.mark.parametrize("kernel", _kernels.KERNELS, ids=lambda k: k.name)
def test_packing_follows_c_alignment(kernel):
    packer = kernel.packer
    offset = 0
    for (name, ctype), code in zip(
        kernel.params, re.findall(r"x*([A-Za-z])", packer.format[1:]), strict=False
    ):
        size = _kernels.CTYPES[ctype][1]
        offset += -offset % size
        assert _kernels.CTYPES[ctype][0] == code, name
        offset += size
    assert packer.size == offset
    values = {n: (1.5 if t == "f32" else i + 1) for i, (n, t) in enumerate(kernel.params)}
    assert len(kernel.pack(**values)) == packer.size
    with pytest.raises(TypeError, match="missing"):
        kernel.pack(**dict(list(values.items())[1:]))


def _swapped(kernel: _kernels.Kernel, i: int, j: int) -> _kernels.Kernel:
    params = list(kernel.params)
    params[i], params[j] = params[j], params[i]
    return dataclasses.replace(kernel, params=tuple(params))


@pytest.mark.parametrize("kernel", _kernels.KERNELS, ids=lambda k: k.name)
def test_swapping_two_parameters_is_caught(kernel):
    # neighbours of the same C type (the swap a packing by type alone would miss), and the ends
    pairs = [
        (i, i + 1) for i in range(len(kernel.params) - 1) if kernel.params[i][1] == kernel.params[i + 1][1]
    ]
    pairs.append((0, len(kernel.params) - 1))
    for i, j in pairs[:4]:
        assert mismatches(_swapped(kernel, i, j)), (kernel.name, kernel.params[i], kernel.params[j])


def test_a_retyped_parameter_is_caught():
    k = _kernels.MERGE_STATE
    params = tuple((n, "i32" if n == "T" else t) for n, t in k.params)
    assert any("T: described as i32" in p for p in mismatches(dataclasses.replace(k, params=params)))


# The kernels that take their parameters as the fields of one struct, and its name (merge_rows.cuh).
STRUCT_KERNELS = {
    _kernels.MERGE_STATE_FLAT: "FlatArgs",
    _kernels.MERGE_STATE_HEADS: "HeadsArgs",
    _kernels.MERGE_STATE_FLAT_GATHERED: "FlatArgs",
    _kernels.MERGE_STATE_FLAT64_GATHERED: "FlatArgs",
}
_FLAT = [k for k, s in STRUCT_KERNELS.items() if s == "FlatArgs"]


def _edited(kernel: _kernels.Kernel, old: str, new: str) -> str:
    """``kernel``'s source with the one occurrence of ``old`` in the body of the struct that
    ``kernel`` takes replaced by ``new``."""
    text = _sources.kernel_source(kernel)
    (m,) = [m for m in _STRUCT.finditer(text) if m["name"] == STRUCT_KERNELS[kernel]]
    assert m["body"].count(old) == 1, old
    return text[: m.start("body")] + m["body"].replace(old, new) + text[m.end("body") :]


@pytest.mark.parametrize("kernel", _kernels.KERNELS, ids=lambda k: k.name)
def test_the_flat_kernels_take_one_struct(kernel):
    text = re.sub(r"//[^\n]*", "", _sources.kernel_source(kernel))
    params = {m["name"]: m["params"] for m in _GLOBAL.finditer(text)}[kernel.name]
    m = re.fullmatch(r"\s*const (\w+)<[^>]*> p\s*", params)
    assert (m and m[1]) == STRUCT_KERNELS.get(kernel)


@pytest.mark.parametrize("kernel", STRUCT_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize(
    "old, new",
    [
        ("sa_st, sa_sh,", "sa_sh, sa_st,"),  # two fields of one declaration, of one C type
        ("H, packs", "packs, H"),
        ("const Tin* va;\n  const Tin* vb;", "const Tin* vb;\n  const Tin* va;"),  # two declarations
        ("  int g_shr;", "  int g_shr_moved;"),  # a renamed field
    ],
)
def test_a_swapped_or_renamed_struct_field_is_caught(kernel, old, new):
    assert mismatches(kernel, _edited(kernel, old, new))


def test_the_heads_kernel_struct_is_its_own():
    """An edit of FlatArgs leaves merge_state_heads_kernel's description matched, one of
    HeadsArgs the flat kernel's: each kernel is held against the struct it takes."""
    heads, flat = _kernels.MERGE_STATE_HEADS, _kernels.MERGE_STATE_FLAT
    assert mismatches(flat, _edited(flat, "sa_st, sa_sh,", "sa_sh, sa_st,"))
    assert not mismatches(heads, _edited(flat, "sa_st, sa_sh,", "sa_sh, sa_st,"))
    assert mismatches(heads, _edited(heads, "sa_st, sa_sh,", "sa_sh, sa_st,"))
    assert not mismatches(flat, _edited(heads, "sa_st, sa_sh,", "sa_sh, sa_st,"))


@pytest.mark.parametrize("kernel", _FLAT, ids=lambda k: k.name)
def test_a_retyped_struct_field_is_caught(kernel):
    edited = _edited(kernel, "unsigned packs_mul;", "int packs_mul;")
    assert mismatches(kernel, edited) == ["packs_mul: described as u32, C type is i32"]
    # a field of the index type I has the kernel's own template argument: int, or i64 in flat64
    wide = kernel is _kernels.MERGE_STATE_FLAT64_GATHERED
    edited = _edited(kernel, "I bs_st, bs_sg;", "int bs_st, bs_sg;")
    retyped = [f"{n}: described as i64, C type is i32" for n in ("bs_st", "bs_sg")]
    assert mismatches(kernel, edited) == (retyped if wide else [])
    described = tuple((n, "i32" if n == "sa_st" else t) for n, t in kernel.params)
    retyped = ["sa_st: described as i32, C type is i64"]
    assert mismatches(dataclasses.replace(kernel, params=described)) == (retyped if wide else [])


def test_a_retyped_heads_struct_field_is_caught():
    k = _kernels.MERGE_STATE_HEADS
    edited = _edited(k, "int H, packs, packs_shr;", "int H, packs;\n  unsigned packs_shr;")
    assert mismatches(k, edited) == ["packs_shr: described as i32, C type is u32"]


def test_a_struct_beside_other_parameters_is_refused():
    k = _kernels.MERGE_STATE_FLAT
    old = "merge_state_flat_kernel(const FlatArgs<Tin, Tout, int> p)"
    text = _sources.kernel_source(k)
    assert text.count(old) == 1
    text = text.replace(old, old[:-1] + ", int n)")
    with pytest.raises(AssertionError, match="must be the only one"):
        c_signature(k, text)


def test_the_struct_lays_its_fields_where_the_bound_call_packs_them():
    """The compiler's own layout of the struct each of these kernels takes (NVRTC, no GPU): every
    field at the offset the bound call's entry packs it at, the struct 8-byte aligned (it opens
    the parameter space at offset 0) and as long as the buffer both executors pass."""
    lines = [
        "template <typename F> struct zk_param_of;",
        "template <typename A> struct zk_param_of<void (*)(A)> { typedef A type; };",
    ]
    for kernel in STRUCT_KERNELS:
        form = SimpleNamespace(kernel=kernel, grid=1, per_token=0, run_tail=0, cap=0, _fields=())
        entry = _bound.make_entry(None, form, 0, 1, {n: i for i, (n, _) in enumerate(kernel.params)}, {})
        assert kernel.packer.size == entry.nbytes
        for j, expr in enumerate(kernel.expressions):
            t = f"zk_p_{kernel.name}_{j}"
            lines.append(f"typedef zk_param_of<decltype(&{expr})>::type {t};")
            lines.append(f'static_assert(sizeof({t}) == {entry.nbytes} && alignof({t}) == 8, "{expr}");')
            for (name, _), (offset, _, _) in zip(kernel.params, entry.pack, strict=True):
                lines.append(f'static_assert(__builtin_offsetof({t}, {name}) == {offset}, "{expr}: {name}");')
    result = _offline._compile(_sources.source("merge") + "\n".join(lines) + "\n", "merge.cu", [], "sm_80")
    assert not isinstance(result, str), result[:2000]


def test_option_parameters_come_from_the_spec_rows():
    """The merge kernels' option parameters are the spec's rows, typed by rule: a new option of
    merge_state reaches the generic kernel's description (and, unwritten in merge.cu, fails the
    test above); an option whose row does not say its parameters fails here."""
    spec = _spec.MERGE_STATE
    generic = dict(_kernels.MERGE_STATE.params)
    flat = dict(_kernels.MERGE_STATE_FLAT.params)
    flat_features = forms.MERGE_FORMS[1].features
    for o in spec.options:
        ptrs = {a.params[0] for a in o.args}
        for p in (*o.params, *o.derived):
            if o.generic:
                assert generic[p] == ("ptr" if p in ptrs else "i64"), (o.name, p)
            if o.feature in flat_features:  # the flat family's options (a tuning step)
                assert flat[p] == ("ptr" if p in ptrs else "i32"), (o.name, p)
    extra = dataclasses.replace(
        spec,
        options=(*spec.options, _spec.Option("x", (_spec.Arg("x", ("1",), ("float32",), ("x_ptr",)),), "x", ("x_ptr", "x_n"))),
    )  # fmt: skip
    text = "ptr va, @a_empty, @*"
    params = _kernel_params.params(text, extra)
    assert params[-2:] == (("x_ptr", "ptr"), ("x_n", "i64"))
    assert [n for n, _ in params[1:4]] == ["a_cu", "a_lens", "a_batch"]
    assert "bscale" not in dict(params)  # per-group fp8: not the generic kernel's
    k = dataclasses.replace(
        _kernels.MERGE_STATE, params=_kernel_params.params(text.replace("@*", "ptr x_ptr"), extra)
    )
    assert k.params[-1] == ("x_ptr", "ptr")
    with pytest.raises(StopIteration):
        _kernel_params.params("ptr va, @no_such_option", spec)


def test_instantiations_are_unique_and_name_described_kernels():
    inst = _kernels.instantiations()
    assert set(inst) == {k.stem for k in _kernels.KERNELS}
    for stem, exprs in inst.items():
        assert len(exprs) == len(set(exprs)), stem
        names = {k.name for k in _kernels.KERNELS if k.stem == stem}
        assert all(e.split("<")[0] in names for e in exprs)


def _fast_div(n: int, mul: int, shr: int) -> int:
    """The kernels' fast_div (common.cuh) in Python integers."""
    return n if mul == 0 else ((n * mul) >> 32) >> shr


def test_fast_divisor_divides_exactly_below_2_to_the_31():
    rng = random.Random(7)
    divisors = [*range(1, 3000), *(2**k + j for k in range(1, 31) for j in (-1, 0, 1))]
    divisors += [rng.randrange(1, 2**31) for _ in range(2000)]
    for d in divisors:
        if d >= 2**31:
            continue
        mul, shr = _kernels.fast_divisor(d)
        assert 0 <= mul < 2**32 and 0 <= shr < 32, (d, mul, shr)
        top = 2**31 - 1
        for n in (
            0,
            1,
            d - 1,
            d,
            d + 1,
            top,
            top - top % d,
            top - top % d - 1,
            *(rng.randrange(2**31) for _ in range(20)),
        ):
            if 0 <= n < 2**31:
                assert _fast_div(n, mul, shr) == n // d, (n, d)


@pytest.mark.parametrize("d", [0, -3, 2**31])
def test_fast_divisor_rejects_divisors_it_cannot_serve(d):
    with pytest.raises(ValueError, match="d must be"):
        _kernels.fast_divisor(d)


def test_feature_bits_and_run_spans_are_those_of_merge_cu():
    """FEAT's bits, merge_flat_run's spans a block and the window's requests, as kernels.py and
    forms.py use them, are the constants merge.cu compiles (a bit moved on one side only would
    launch another option)."""
    text = _sources.source("merge")
    c_values = {m[1]: int(m[2]) for m in re.finditer(r"constexpr (?:int|unsigned) (\w+) = (\d+);", text)}
    names = [n for n in dir(_kernels) if n.startswith("F_") or n in ("A_RUN_SPANS", "A_WINDOW")]
    assert "F_A_RUN" in names and "F_GROUP_SHIFT" in names
    for n in names:
        assert c_values.get(n) == getattr(_kernels, n), (n, c_values.get(n), getattr(_kernels, n))
