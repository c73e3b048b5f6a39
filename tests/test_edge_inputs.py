"""Edge inputs of every op: meta, sparse and nested tensors, a numpy array as ``lse_base``,
ragged or sparse planner lengths (each a TypeError / ValueError naming the argument, nothing
written); zero-size numpy arrays of any strides (a no-op); numpy and torch in one call (on the
CPU: works, outputs allocated like the first tensor; on a GPU: a TypeError naming both)."""

from __future__ import annotations

import numpy as np
import oracles
import pytest
import torch
from conftest import assert_close, f64

import zerokv

T, H, D = 9, 3, 16
G = torch.Generator().manual_seed(2)


def _states():
    return (
        torch.randn(T, H, D, generator=G),
        torch.randn(T, H, generator=G) * 2,
        torch.randn(T, H, D, generator=G),
        torch.randn(T, H, generator=G) * 2,
    )


CU = torch.tensor([0, 4, T], dtype=torch.int32)
KV = torch.tensor([0, 5], dtype=torch.int32)
CU_KV = torch.tensor([0, 0, 5], dtype=torch.int32)


def _ops(bad_at: str, bad):
    """(op, argument name) for every op given ``bad`` in the argument ``bad_at`` plays."""
    v_a, s_a, v_b, s_b = _states()
    out, lse = torch.full((T, H, D), float("nan")), torch.full((T, H), float("nan"))
    calls = {
        "v": lambda: zerokv.merge_state(bad, s_a, v_b, s_b, out=out, out_lse=lse),
        "lse": lambda: zerokv.merge_state(v_a, bad, v_b, s_b, out=out, out_lse=lse),
        "states_v": lambda: zerokv.merge_states(bad, torch.stack([s_a, s_b]), out=out, out_lse=lse),
        "fixup_lens": lambda: zerokv.fixup_zero_kv_rows(out, lse, bad, CU),
        "mask_cu": lambda: zerokv.mask_empty_context(out, lse, bad, CU_KV),
    }
    return calls[bad_at], out, lse


BAD_ARGS = {"v": "v_a", "lse": "s_a", "states_v": "v", "fixup_lens": "kv_lens", "mask_cu": "cu_seqlens_q"}


def _meta(where):
    shape = {"v": (T, H, D), "lse": (T, H), "states_v": (2, T, H, D), "fixup_lens": (2,), "mask_cu": (3,)}[
        where
    ]
    dtype = torch.int32 if where in ("fixup_lens", "mask_cu") else torch.float32
    return torch.empty(shape, dtype=dtype, device="meta")


def _sparse(where):
    x = {
        "v": lambda: torch.randn(T, H, D, generator=G),
        "lse": lambda: torch.randn(T, H, generator=G),
        "states_v": lambda: torch.randn(2, T, H, D, generator=G),
        "fixup_lens": lambda: KV.clone(),
        "mask_cu": lambda: CU.clone(),
    }[where]()
    return x.to_sparse()


@pytest.mark.parametrize("where", list(BAD_ARGS))
@pytest.mark.parametrize(
    ("kind", "make", "message"), [("meta", _meta, "a meta tensor"), ("sparse", _sparse, "a sparse tensor")]
)
def test_meta_and_sparse_tensors_are_a_type_error_naming_the_argument(where, kind, make, message):
    call, out, lse = _ops(where, make(where))
    with pytest.raises(TypeError) as info:
        call()
    assert str(info.value).startswith(f"{BAD_ARGS[where]}: {message}"), str(info.value)
    assert torch.isnan(out).all() and torch.isnan(lse).all()  # a rejected call writes nothing


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: CSR support is in beta
def test_a_csr_tensor_is_named_with_its_layout():
    v_a, s_a, v_b, s_b = _states()
    with pytest.raises(TypeError, match=r"^s_b: a sparse tensor \(sparse_csr\)"):
        zerokv.merge_state(v_a, s_a, v_b, s_b.to_sparse_csr())


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: nested tensors are a prototype
def test_a_nested_tensor_is_named():
    nested = torch.nested.nested_tensor([torch.randn(2, H, D), torch.randn(3, H, D)])
    _, s_a, v_b, s_b = _states()
    with pytest.raises(TypeError, match=r"^v_a: a nested tensor"):
        zerokv.merge_state(nested, s_a, v_b, s_b)


@pytest.mark.parametrize("base", [np.array(2), np.array([2]), [2], {"base": 2}, torch.tensor(2)])
def test_an_array_as_lse_base_is_a_value_error_naming_it(base):
    v_a, s_a, v_b, s_b = _states()
    with pytest.raises(ValueError, match=r"^lse_base: expected 'e' or 2, got "):
        zerokv.merge_state(v_a, s_a, v_b, s_b, lse_base=base)
    with pytest.raises(ValueError, match=r"^lse_base: expected 'e' or 2, got "):
        zerokv.merge_states(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), lse_base=base)


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "arg", "error"),
    [
        ([[1, 2], [3]], [1, 2], "query_lens", ValueError),
        ([1, 2], [[1], [2, 3]], "context_lens", ValueError),
        (torch.tensor([1, 2]).to_sparse(), torch.tensor([1, 2]), "query_lens", TypeError),
        (torch.tensor([1, 2]), torch.tensor([3, 4]).to_sparse(), "context_lens", TypeError),
        (torch.empty(2, dtype=torch.int64, device="meta"), [1, 2], "query_lens", ValueError),
        (np.array([1, None], dtype=object), [1, 2], "query_lens", TypeError),
    ],
    ids=["ragged-query", "ragged-context", "sparse-query", "sparse-context", "meta-query", "object-array"],
)
def test_ragged_or_sparse_planner_lengths_name_the_argument(query_lens, context_lens, arg, error):
    with pytest.raises(error) as info:
        zerokv.plan_context_chunks(query_lens, context_lens, chunk_tokens=16)
    assert str(info.value).startswith(f"{arg}:"), str(info.value)


# --- zero-size numpy arrays of any strides: a no-op -------------------------------------------


ZERO_SHAPES = [(0, H, D), (T, 0, D), (T, H, 0)]


@pytest.mark.parametrize("shape", ZERO_SHAPES)
@pytest.mark.parametrize("make", [np.zeros, np.empty], ids=["zeros", "empty"])
def test_zero_size_numpy_merges_are_a_no_op(shape, make):
    v = make(shape, np.float32)  # numpy 2 gives these strides of 0
    s = make(shape[:2], np.float32)
    out, lse = zerokv.merge_state(v, s, v, s)
    assert out.shape == shape and lse.shape == shape[:2] and out.dtype == np.float32
    given = make(shape, np.float32), make(shape[:2], np.float32)
    res = zerokv.merge_state(v, s, v, s, out=given[0], out_lse=given[1])
    assert res[0] is given[0] and res[1] is given[1]
    vs, ss = make((2, *shape), np.float32), make((2, *shape[:2]), np.float32)
    out, lse = zerokv.merge_states(vs, ss)
    assert out.shape == shape and lse.shape == shape[:2]


@pytest.mark.parametrize("shape", ZERO_SHAPES[:2])
def test_zero_size_numpy_fixup_and_mask_are_a_no_op(shape):
    out, lse = np.zeros(shape, np.float32), np.zeros(shape[:2], np.float32)
    batch = 0 if shape[0] == 0 else 2
    cu = np.array([0, 4, T][: batch + 1] if batch else [0], np.int32)
    lens = np.array([0, 5][:batch], np.int32)
    assert zerokv.fixup_zero_kv_rows(out, lse, lens, cu) is None
    assert zerokv.mask_empty_context(out, lse, cu, np.zeros(batch + 1, np.int32)) is None


# --- numpy and torch in one call --------------------------------------------------------------


def _want():
    v_a, s_a, v_b, s_b = _states()
    return (v_a, s_a, v_b, s_b), oracles.merge2(v_a, s_a, v_b, s_b)


@pytest.mark.parametrize("numpy_args", [("s_a",), ("v_a",), ("v_b", "s_b"), ("v_a", "s_a", "v_b")])
def test_on_the_cpu_a_mix_works_and_allocates_like_the_first_tensor(numpy_args):
    (v_a, s_a, v_b, s_b), (want_v, want_s) = _want()
    args = {"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b}
    for name in numpy_args:
        args[name] = args[name].numpy()
    out, lse = zerokv.merge_state(**args)
    kind = np.ndarray if "v_a" in numpy_args else torch.Tensor
    assert type(out) is kind and type(lse) is kind  # the documented rule: like v_a
    assert_close(torch.as_tensor(out), want_v, torch.float32, "V")
    assert_close(torch.as_tensor(lse), want_s, torch.float32, "LSE")


def test_on_the_cpu_a_given_output_of_the_other_kind_is_written():
    (v_a, s_a, v_b, s_b), (want_v, want_s) = _want()
    out, lse = np.full((T, H, D), np.nan, np.float32), np.full((T, H), np.nan, np.float32)
    res = zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    assert res[0] is out and res[1] is lse
    assert_close(out, want_v, torch.float32, "V")
    assert_close(lse, want_s, torch.float32, "LSE")
    o, s = torch.full((T, H, D), float("nan")), torch.full((T, H), float("nan"))
    ref_o, ref_s = oracles.with_empty_rows(o, s, oracles.fixup_rows(CU, KV, T))
    zerokv.fixup_zero_kv_rows(o, s.numpy(), KV.numpy(), CU)  # LSE as a numpy view of the tensor
    np.testing.assert_array_equal(f64(o), ref_o)
    np.testing.assert_array_equal(f64(s), ref_s)


@pytest.mark.gpu
@pytest.mark.parametrize("cupy_arg", ["s_a", "v_b", "out"])
def test_on_a_gpu_torch_beside_cupy_is_a_type_error_naming_both(cupy_arg):
    cupy = pytest.importorskip("cupy")
    (v_a, s_a, v_b, s_b), _ = _want()
    args = {n: x.cuda() for n, x in (("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b))}
    args["out"] = torch.full((T, H, D), float("nan"), device="cuda")
    poisoned = args["out"].clone()
    args[cupy_arg] = cupy.asarray(args[cupy_arg])
    with pytest.raises(TypeError) as info:
        zerokv.merge_state(**args)
    message = str(info.value)
    assert "is a torch tensor but" in message and f"{cupy_arg} is a cupy array" in message, message
    if cupy_arg != "out":
        assert torch.equal(args["out"].isnan(), poisoned.isnan())  # nothing written


def test_torch_beside_another_producer_is_a_signature_of_its_own():
    """The facts' producer part of a signature: a mixed call never finds the plan of an
    all-torch or all-numpy call (a torch subclass beside numpy included), so its validation runs."""
    from zerokv.core import facts, spec, validation

    v_a, s_a, v_b, s_b = _states()
    rest = (None,) * 7

    def facts_of(*states):
        objs = (*states, *rest)
        return facts.of(
            spec.MERGE_STATE, validation.validate(spec.MERGE_STATE, objs, {"lse_base": "e"}), objs
        )

    torch_only = facts_of(v_a, s_a, v_b, s_b)
    numpy_only = facts_of(v_a.numpy(), s_a.numpy(), v_b.numpy(), s_b.numpy())
    mixed = facts_of(v_a, s_a.numpy(), v_b, s_b)
    subclass = facts_of(torch.nn.Parameter(v_a, requires_grad=False), s_a.numpy(), v_b.numpy(), s_b.numpy())
    assert (torch_only.sig[-1], numpy_only.sig[-1], mixed.sig[-1], subclass.sig[-1]) == (
        True,
        False,
        None,
        None,
    )
    assert torch_only.torch and not (numpy_only.torch or mixed.torch or subclass.torch)
    assert len({torch_only.sig, numpy_only.sig, mixed.sig, subclass.sig}) == 4


def test_the_one_library_rule_names_both_arguments_on_a_gpu_only():
    from zerokv.core import checks
    from zerokv.core.tensors import view

    v_a, s_a, _, _ = _states()
    t, n = view(v_a, "v_a"), view(s_a.numpy(), "s_a")
    checks.one_library_on_gpu([("v_a", t), ("s_a", n), ("out", None)])  # on the host: any mix works
    checks.one_library_on_gpu([("v_a", t._replace(device=0)), ("s_a", t._replace(device=0))])
    with pytest.raises(TypeError, match=r"^v_a is a torch tensor but s_a is a numpy array; on a GPU"):
        checks.one_library_on_gpu([("v_a", t._replace(device=0)), ("s_a", n._replace(device=0))])
