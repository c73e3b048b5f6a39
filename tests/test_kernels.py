"""Each kernel's Python description against its C parameter list in kernels_cu/ (no GPU needed).

The packing of every launch comes from the description; these tests make a description that
disagrees with the kernel (a parameter renamed, retyped, missing or swapped) fail here rather
than as garbage on a GPU.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from zerokv.core import forms
from zerokv.core import kernel_params as _kernel_params
from zerokv.core import kernels as _kernels
from zerokv.core import sources as _sources
from zerokv.core import spec as _spec

_GLOBAL = re.compile(
    r"__global__\s+void\s+(__launch_bounds__\((?P<bounds>[^)]*)\)\s+)?(?P<name>\w+)\s*\((?P<params>[^)]*)\)",
    re.S,
)


def _c_type(decl: str) -> str:
    """Our C-type class of one parameter declaration (``const Tin* va`` -> ``ptr``)."""
    decl = re.sub(r"\b(const|__restrict__|volatile)\b", " ", decl)
    if "*" in decl:
        return "ptr"
    words = decl.split()[:-1]
    kind = " ".join(words)
    types = {"i64": "i64", "long long": "i64", "int": "i32", "unsigned": "u32", "float": "f32"}
    if kind not in types:
        raise AssertionError(f"parameter {decl.strip()!r} has a type the runtime cannot pack")
    return types[kind]


def c_signature(kernel: _kernels.Kernel) -> tuple[str, list[tuple[str, str]]]:
    """``(launch bounds text, [(name, type), ...])`` of ``kernel`` as its source declares it."""
    text = re.sub(r"//[^\n]*", "", _sources.kernel_source(kernel))
    found = {m["name"]: m for m in _GLOBAL.finditer(text)}
    assert kernel.name in found, f"{kernel.name}: no __global__ function of that name in {kernel.stem}.cu"
    m = found[kernel.name]
    params = []
    for decl in m["params"].split(","):
        name = re.findall(r"\w+", decl)[-1]
        params.append((name, _c_type(decl)))
    return m["bounds"] or "", params


def mismatches(kernel: _kernels.Kernel) -> list[str]:
    """How ``kernel``'s description differs from its C signature (empty: they agree)."""
    _, params = c_signature(kernel)
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
