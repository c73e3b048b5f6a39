"""merge_state / merge_states: the CPU path against the independent oracles (``oracles.py``: the
CPU path runs the reference, so the reference cannot be its oracle), the reference against closed
forms, and the kernels (GPU) against the float64 reference."""

from __future__ import annotations

import numpy as np
import oracles
import pytest
import torch
from conftest import DTYPES, assert_close, f64
from states import INF, NAN, make_states

import zerokv
from zerokv import reference
from zerokv.compat import vllm

# --- the reference is the specification: check it against independent closed forms ---------


def test_reference_matches_logaddexp_formula():
    v_a, s_a, v_b, s_b = (f64(x) for x in make_states(33, 5, 9, torch.float64, edges=False))
    out, lse = reference.merge_state(v_a, s_a, v_b, s_b)
    expected_lse = np.logaddexp(s_a, s_b)
    wa = np.exp(s_a - expected_lse)[..., None]
    wb = np.exp(s_b - expected_lse)[..., None]
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)
    np.testing.assert_allclose(out, wa * v_a + wb * v_b, rtol=1e-10, atol=1e-12)


def test_reference_sinks_match_logaddexp_formula():
    """``S' = logaddexp(S, sink)``, ``out *= exp(S - S')``; a sink of -inf changes nothing, one
    of +inf takes all the weight (0, +inf); a row with no keys gets (0, sink)."""
    rng = np.random.default_rng(3)
    out, lse = rng.standard_normal((5, 4, 6)), rng.standard_normal((5, 4)) * 3
    lse[0] = -np.inf  # no keys
    sinks = np.array([1.5, -np.inf, np.inf, -0.7])
    got_out, got_lse = reference.apply_sinks(out, lse, sinks)
    for h in (0, 3):
        new = np.logaddexp(lse[1:, h], sinks[h])
        np.testing.assert_allclose(got_lse[1:, h], new, rtol=1e-12)
        np.testing.assert_allclose(got_out[1:, h], out[1:, h] * np.exp(lse[1:, h] - new)[:, None], rtol=1e-12)
        assert got_lse[0, h] == sinks[h] and (got_out[0, h] == 0).all()
    assert np.array_equal(got_lse[1:, 1], lse[1:, 1]) and np.array_equal(got_out[1:, 1], out[1:, 1])
    assert (got_lse[:, 2] == np.inf).all() and (got_out[:, 2] == 0).all()


def test_max_error_counts_misplaced_nan_and_inf_as_infinite():
    e = np.array([1.0, -np.inf, np.nan, 2.0])
    assert reference.max_error(e + np.array([0.25, 0, 0, -0.5]), e) == 0.5
    assert reference.max_error(np.array([1.0, -np.inf, 0.0, 2.0]), e) == np.inf  # NaN lost
    assert reference.max_error(np.array([1.0, np.inf, np.nan, 2.0]), e) == np.inf  # inf sign
    assert reference.max_error(np.array([np.nan, -np.inf, np.nan, 2.0]), e) == np.inf  # NaN added
    assert reference.max_error(e[:3], e) == np.inf  # shapes differ


def test_reference_base2_matches_formula():
    v_a, s_a, v_b, s_b = (f64(x) for x in make_states(17, 3, 4, torch.float64, edges=False))
    out, lse = reference.merge_state(v_a, s_a, v_b, s_b, lse_base=2)
    expected_lse = np.logaddexp2(s_a, s_b)
    wa = np.exp2(s_a - expected_lse)[..., None]
    wb = np.exp2(s_b - expected_lse)[..., None]
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)
    np.testing.assert_allclose(out, wa * v_a + wb * v_b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device_kind", ["torch", "numpy"])
def test_edges_on_the_cpu_path(device_kind):
    v_a, s_a, v_b, s_b = make_states(64, 4, 8, torch.float32, edges=False)
    s_a[0, 0], v_a[0, 0] = -INF, NAN  # a empty, garbage V
    s_b[1, 1], v_b[1, 1] = INF, NAN  # b empty the FA2 way
    s_a[2, 2], s_b[2, 2] = -INF, -INF  # both empty
    s_a[3, 3], s_b[3, 3] = INF, -INF  # both empty, mixed markers
    s_a[4, 0] = NAN  # a bug upstream: must show
    s_a[5, 1] = s_b[5, 1] + 1e4  # huge gap
    args = (v_a, s_a, v_b, s_b)
    if device_kind == "numpy":
        args = tuple(x.numpy() for x in args)
    out, lse = zerokv.merge_state(*args)
    out, lse = torch.as_tensor(out), torch.as_tensor(lse)
    assert torch.equal(out[0, 0], v_b[0, 0]) and lse[0, 0] == s_b[0, 0]
    assert torch.equal(out[1, 1], v_a[1, 1]) and lse[1, 1] == s_a[1, 1]
    for t, h in ((2, 2), (3, 3)):
        assert torch.equal(out[t, h], torch.zeros(8)) and lse[t, h] == -INF
    assert out[4, 0].isnan().all() and lse[4, 0].isnan()
    assert torch.allclose(out[5, 1], v_a[5, 1]) and lse[5, 1] == s_a[5, 1]
    rest = torch.ones(64, 4, dtype=torch.bool)
    rest[[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1]] = False
    assert torch.isfinite(out[rest]).all() and torch.isfinite(lse[rest]).all()


@pytest.mark.parametrize("prefix_rows", [0, 7, 20])
def test_prefix_rows_take_state_b_with_the_empty_rule(prefix_rows):
    v_a, s_a, v_b, s_b = make_states(20, 3, 8, torch.float32)
    out, lse = zerokv.merge_state(v_a, s_a, v_b, s_b, prefix_rows=prefix_rows)
    ref_head = oracles.merge2(*(f64(x)[:prefix_rows] for x in (v_a, s_a, v_b, s_b)))
    assert_close(out[:prefix_rows], ref_head[0], torch.float32)
    assert_close(lse[:prefix_rows], ref_head[1], torch.float32)
    tail = slice(prefix_rows, None)
    empty_b = torch.isinf(s_b[tail])
    expected = torch.where(empty_b[..., None], 0.0, v_b[tail])
    expected_lse = torch.where(empty_b, -INF, s_b[tail])
    assert torch.equal(out[tail], expected) and torch.equal(lse[tail], expected_lse)


def test_in_place_aliasing_cpu():
    v_a, s_a, v_b, s_b = make_states(16, 2, 8, torch.float32)
    ref = oracles.merge2(*(f64(x) for x in (v_a, s_a, v_b, s_b)))
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=v_a, out_lse=s_a)
    assert_close(v_a, ref[0], torch.float32)
    assert_close(s_a, ref[1], torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_out_without_out_lse_writes_no_lse(device):
    T, H, D = 130, 2, 8
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.float32, device, seed=41)
    inputs = (v_a, s_a, v_b, s_b)
    kept = [x.clone() for x in inputs]
    # out is the front of a poisoned buffer whose tail is where an LSE could land
    buf = torch.full((T * H * D + T * H + 64,), NAN, device=device)
    out = buf[: T * H * D].view(T, H, D)
    res = zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)
    assert res[0] is out and res[1] is None
    ref_out, _ = oracles.merge2(*(f64(x) for x in kept))
    assert_close(out, ref_out, torch.float32, "out")
    tail = buf[T * H * D :].view(torch.int32)
    assert torch.equal(tail, torch.full_like(buf[:1], NAN).view(torch.int32).expand_as(tail)), (
        "an LSE was written"
    )
    for x, k in zip(inputs, kept, strict=True):  # nor into an input LSE (or V)
        assert torch.equal(x.view(torch.int32), k.view(torch.int32))


def test_a_empty_treats_requests_state_a_as_empty_cpu():
    v_a, s_a, v_b, s_b = make_states(12, 2, 4, torch.float32, edges=False)
    cu = torch.tensor([0, 3, 3, 8, 12], dtype=torch.int64)
    kv = torch.tensor([0, 0, 5, 0], dtype=torch.int64)
    v_a[:3] = NAN  # garbage the attention kernel left for request 0 (finite LSE!)
    v_a[8:] = NAN
    out, lse = zerokv.merge_state(v_a, s_a, v_b, s_b, a_empty=(cu, kv))
    assert torch.equal(out[:3], v_b[:3]) and torch.equal(lse[:3], s_b[:3])
    assert torch.equal(out[8:], v_b[8:])
    ref = oracles.merge2(*(f64(x)[3:8] for x in (v_a, s_a, v_b, s_b)))
    assert_close(out[3:8], ref[0], torch.float32)
    assert_close(lse[3:8], ref[1], torch.float32)


def test_merge_states_equals_pairwise_merge_cpu():
    v_a, s_a, v_b, s_b = make_states(10, 3, 8, torch.float32)
    out, lse = zerokv.merge_states(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]))
    ref = oracles.merge2(*(f64(x) for x in (v_a, s_a, v_b, s_b)))
    assert_close(out, ref[0], torch.float32)
    assert_close(lse, ref[1], torch.float32)


# --- validation: TypeError / ValueError naming the argument; nothing written ------------------


def _valid(T=6, H=2, D=8):
    return make_states(T, H, D, torch.float32, edges=False)


@pytest.mark.parametrize(
    "mutate, exc, needle",
    [
        (lambda a: a.update(v_b=a["v_b"][:3]), ValueError, "v_b"),
        (lambda a: a.update(s_a=a["s_a"][:, :1]), ValueError, "s_a"),
        (lambda a: a.update(s_b=a["s_b"].double()), TypeError, "s_b"),
        (lambda a: a.update(v_a=a["v_a"].int()), TypeError, "v_a"),
        (lambda a: a.update(v_b=a["v_b"].half()), TypeError, "v_b"),
        (lambda a: a.update(v_a=a["v_a"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "v_a"),
        (lambda a: a.update(v_a=a["v_a"][0]), ValueError, "v_a"),
        (lambda a: a.update(v_a=[1, 2, 3]), TypeError, "v_a"),
        (lambda a: a.update(lse_base=10), ValueError, "lse_base"),
        (lambda a: a.update(prefix_rows=99), ValueError, "prefix_rows"),
        (lambda a: a.update(prefix_rows=1.5), TypeError, "prefix_rows"),
        (lambda a: a.update(out_scale=torch.ones(1)), ValueError, "out_scale"),
        (lambda a: a.update(a_empty=(torch.tensor([0, 6]), torch.tensor([1, 2]))), ValueError, "kv_lens"),
        (
            lambda a: a.update(a_empty=(torch.tensor([0.0, 6.0]), torch.tensor([1]))),
            TypeError,
            "cu_seqlens_q",
        ),
        (lambda a: a.update(out_lse=torch.zeros(6, 2, dtype=torch.float16)), TypeError, "out_lse"),
    ],
)
def test_rejected_calls_name_the_argument_and_write_nothing(mutate, exc, needle):
    v_a, s_a, v_b, s_b = _valid()
    out = torch.full_like(v_a, NAN)
    kw = {"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b, "out": out}
    mutate(kw)
    with pytest.raises(exc, match=needle):
        zerokv.merge_state(kw.pop("v_a"), kw.pop("s_a"), kw.pop("v_b"), kw.pop("s_b"), **kw)
    assert out.isnan().all()


@pytest.mark.gpu
def test_cpu_gpu_mix_is_rejected():
    v_a, s_a, v_b, s_b = _valid()
    with pytest.raises(ValueError, match="cuda:0"):
        zerokv.merge_state(v_a, s_a, v_b.cuda(), s_b)


# --- GPU: the kernel against the reference ----------------------------------------------------

SHAPES_T = (0, 1, 127, 128, 4097)
SHAPES_H = (1, 16, 128)
SHAPES_D = (7, 64, 72, 128, 512)


def _compare(out, lse, v_a, s_a, v_b, s_b, out_dtype, base="e", prefix_rows=None, sample=4096):
    """Reference on (a sample of) the tokens; NaN rows checked on the whole output on the GPU."""
    T = s_a.shape[0]
    if T == 0:
        return
    nan_rows = (s_a.isnan() | s_b.isnan()) & (
        torch.arange(T, device=s_a.device)[:, None] < (T if prefix_rows is None else prefix_rows)
    )
    assert torch.equal(out.isnan().any(-1), nan_rows), "NaN rows differ (unwritten or wrong)"
    H, D = v_a.shape[1:]
    idx = torch.arange(T)
    if sample * 64 < T * H * D:
        g = torch.Generator().manual_seed(T)
        idx = torch.unique(
            torch.cat([torch.randint(0, T, (sample // H + 1,), generator=g), torch.tensor([0, T - 1])])
        )
    prefix = None if prefix_rows is None else int((idx < prefix_rows).sum())
    sel = [f64(x[idx.to(x.device)]) for x in (v_a, s_a, v_b, s_b)]
    ref_out, ref_lse = reference.merge_state(*sel, lse_base=base, prefix_rows=prefix)
    assert_close(out[idx.to(out.device)], ref_out, out_dtype, "out")
    if lse is not None:
        assert_close(lse[idx.to(lse.device)], ref_lse, torch.float32, "lse")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", SHAPES_T)
@pytest.mark.parametrize("H", SHAPES_H)
@pytest.mark.parametrize("D", SHAPES_D)
def test_kernel_matches_reference(dtype, T, H, D):
    v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, "cuda", seed=T * 7 + H + D)
    out = torch.full_like(v_a, NAN)
    lse = torch.full_like(s_a, NAN)
    res = zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    assert res[0] is out and res[1] is lse
    _compare(out, lse, v_a, s_a, v_b, s_b, dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("op", ["merge_state", "merge_states"])
@pytest.mark.parametrize("weights", [False, True])
def test_sinks_match_the_reference(device, base, op, weights):
    """Sinks of every kind (finite, -inf, +inf) over states with every edge (empty, both
    empty, NaN, a huge gap): the kernels' fold of the sink against the float64 reference;
    ``weights``: the sinks a module's parameter (gpt-oss's are), on a signature's first call
    and on the later one its bound call takes."""
    T, H, D = 300, 8, 128
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, device, seed=11)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(4)) * 3
    sinks[0], sinks[1] = -INF, INF
    sinks = sinks.to(device)
    if weights:
        sinks = torch.nn.Parameter(sinks, requires_grad=False)
    # the CPU path runs the reference: its oracle is the independent one
    ref = oracles.merge if device == "cpu" else reference.merge_states
    v, s = torch.stack([v_a, v_b]), torch.stack([s_a, s_b])
    for _ in range(2 if weights else 1):
        if op == "merge_state":
            out, lse = zerokv.merge_state(v_a, s_a, v_b, s_b, lse_base=base, sinks=sinks)
        else:
            out, lse = zerokv.merge_states(v, s, lse_base=base, sinks=sinks)
    ref_out, ref_lse = ref(f64(v), f64(s), base, f64(sinks))
    assert_close(out, ref_out, torch.bfloat16, "out")
    assert_close(lse, ref_lse, torch.float32, "lse")


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype, out_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
])  # fmt: skip
@pytest.mark.parametrize("D", (64, 72, 7))
def test_output_dtype_differs_from_inputs(in_dtype, out_dtype, D):
    v_a, s_a, v_b, s_b = make_states(333, 8, D, in_dtype, "cuda", seed=D)
    out = torch.full((333, 8, D), NAN, dtype=out_dtype, device="cuda")
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)
    _compare(out, None, v_a, s_a, v_b, s_b, out_dtype)


def _merge_both_ways(v_a, s_a, v_b, s_b, out_dtype) -> None:
    """merge_state, then a two-state merge_states of the same states, each into NaN-filled
    outputs, each against float64."""
    T, H, D = v_a.shape
    out = torch.full((T, H, D), NAN, dtype=out_dtype, device=v_a.device)
    lse = torch.full_like(s_a, NAN)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    _compare(out, lse, v_a, s_a, v_b, s_b, out_dtype)
    out.fill_(NAN)
    lse.fill_(NAN)
    zerokv.merge_states(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), out=out, out_lse=lse)
    _compare(out, lse, v_a, s_a, v_b, s_b, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, out_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
])  # fmt: skip
@pytest.mark.parametrize(
    "T, H, D", [(1, 32, 128), (8, 8, 64), (3, 7, 64), (2, 37, 128), (1, 3, 96), (1, 3, 1024), (32, 8, 64)]
)
@pytest.mark.parametrize("lse_ht", [False, True])
def test_the_smallest_calls_in_blocks_of_heads(dtype, out_dtype, T, H, D, lse_ht):
    """Calls of at most 2048 packs of 16 bytes take merge_state_heads_kernel: 128-thread blocks
    of heads of one token (7 heads: fewer than a block holds; 37 heads: a last block of 5 or 1
    heads; D = 1024: rows of 128 packs; 32 x 8 x 64: exactly 2048 packs; D = 96: rows of 12
    packs, the flat kernel), LSEs [T, H] or [H, T]. The first rows empty in a, in b, in both,
    with NaN V; prefix_rows; two-state merge_states takes it too."""
    v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, "cuda", seed=T * H + D)
    s_a[0, 0], v_a[0, 0] = -INF, NAN
    s_b[0, 1], v_b[0, 1] = INF, NAN
    s_a[0, 2], v_a[0, 2], s_b[0, 2], v_b[0, 2] = -INF, NAN, -INF, NAN
    if lse_ht:
        s_a, s_b = s_a.T.contiguous().T, s_b.T.contiguous().T
    _merge_both_ways(v_a, s_a, v_b, s_b, out_dtype)
    out, lse = (
        torch.full((T, H, D), NAN, dtype=out_dtype, device="cuda"),
        torch.full((H, T), NAN, device="cuda").T,
    )
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, prefix_rows=T // 2)
    _compare(out, lse, v_a, s_a, v_b, s_b, out_dtype, prefix_rows=T // 2)


def _lse_layout(T: int, H: int, kind: str) -> torch.Tensor:
    """A NaN-filled ``[T, H]`` out_lse in a layout: contiguous, an ``[H, T]`` buffer as ``.T``,
    padded along either axis, or with neither axis unit-stride."""
    full = lambda *shape: torch.full(shape, NAN, device="cuda")  # noqa: E731
    return {
        "TH": lambda: full(T, H),
        "HT": lambda: full(H, T).T,
        "TH-padded": lambda: full(T, H + 5)[:, :H],
        "HT-padded": lambda: full(H, T + 3)[:, :T].T,
        "strided": lambda: full(T, H, 2)[..., 1],
    }[kind]()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["TH", "HT", "TH-padded", "HT-padded", "strided"])
@pytest.mark.parametrize("T, H, D", [(4099, 15, 72), (8200, 129, 128), (8201, 128, 128), (7, 1000, 1024)])
def test_many_waves_write_every_lse_once_in_every_layout(kind, T, H, D):
    """Calls from 2^19 threads gather the output LSE per block of 512 (4099 x 15 x 72: rows of
    9 packs cut by the blocks' edges, a partial last block); an out_lse laid [H, T] (plain or
    padded) walks the rows in tiles of 8 tokens, the last tokens (3 of 4099, 1 of 8201, all 7
    of T = 7) after them in natural order; other layouts: padded axes, an out_lse with no
    unit-stride axis. The suffix past prefix_rows by the empty rule and, through vLLM's
    adapter, verbatim. Every row's LSE is checked (one left unwritten stays NaN), V on a
    sample of rows."""
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, "cuda", seed=T + H)
    s_b_ht = s_b.T.contiguous().T  # the inputs' LSEs in both layouts
    first = [f64(x) for x in (v_a[..., :1], s_a, v_b[..., :1], s_b)]  # the LSE needs no more of V
    for prefix in (None, T // 3):
        out, lse = torch.full_like(v_a, NAN), _lse_layout(T, H, kind)
        zerokv.merge_state(v_a, s_a, v_b, s_b_ht, out=out, out_lse=lse, prefix_rows=prefix)
        assert_close(lse, reference.merge_state(*first, prefix_rows=prefix)[1], torch.float32, "lse")
        _compare(out, None, v_a, s_a, v_b, s_b, torch.bfloat16, prefix_rows=prefix)
    out, lse = torch.full_like(v_a, NAN), _lse_layout(T, H, kind)
    vllm.merge_attn_states(out, v_a, s_a.T, v_b, s_b.T, lse.T, T // 3)
    ref_lse = reference.merge_state(*first, prefix_rows=T // 3, suffix_verbatim=True)[1]
    assert_close(lse, ref_lse, torch.float32, "lse")
    assert torch.equal(lse[T // 3 :], s_b[T // 3 :]), "the suffix's LSE is not copied verbatim"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, H", [(4097, 8), (4099, 33), (16383, 64)])
def test_grids_from_2_19_threads_in_blocks_of_512(dtype, T, H):
    """Aligned calls from 2^19 packs take the flat kernel in blocks of 512 with the output LSE
    gathered (16-bit: the first shape is 128 packs past 2^19, the second ends in a partial
    block, the third is 1024 packs short of 2^24); two-state merge_states takes it too."""
    D = 128
    v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, "cuda", seed=T + H)
    _merge_both_ways(v_a, s_a, v_b, s_b, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, H, D", [(4099, 16, 128), (1031, 40, 104), (7, 1000, 1024)])
def test_rows_in_tiles_of_8_tokens_for_an_lse_laid_h_t(dtype, T, H, D):
    """From 2^19 packs, an LSE laid [H, T] (out_lse; without one, s_a) makes the kernel walk
    the rows in tiles of 8 tokens of one head, the tokens past the last whole tile (3 of 4099
    and of 1031, all of T = 7) in natural order; rows of 13 packs (D = 104, 16-bit) are cut by
    the blocks' edges. Every row of V and of the LSE against float64, outputs NaN-filled; then
    with s_a [H, T] and no out_lse, V alone."""
    v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, "cuda", seed=T + D)
    s_a_ht = s_a.T.contiguous().T
    out, lse = torch.full_like(v_a, NAN), _lse_layout(T, H, "HT")
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    _compare(out, lse, v_a, s_a, v_b, s_b, dtype, sample=T * H * D)
    out.fill_(NAN)
    zerokv.merge_state(v_a, s_a_ht, v_b, s_b, out=out)
    _compare(out, None, v_a, s_a, v_b, s_b, dtype, sample=T * H * D)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("lse_ht", [False, True], ids=["lse-th", "lse-ht"])
def test_rows_longer_than_a_block_of_512(dtype, lse_ht):
    """D = 8200: rows of 1025 (bf16) or 2050 (float32) packs of 16 bytes, in the gathered form
    (64 x 9 rows, past 2^19 packs): each row spans two to five blocks of 512, most blocks hold no
    row's first pack and write no LSE; every row's LSE is written once, by the block of its
    first pack."""
    T, H, D = 64, 9, 8200
    v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, "cuda", seed=D)
    out = torch.full((T, H, D), NAN, dtype=dtype, device="cuda")
    lse = _lse_layout(T, H, "HT" if lse_ht else "TH")
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    _compare(out, lse, v_a, s_a, v_b, s_b, dtype, sample=T * H * D)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T, D, lse_ht",
    [(8200, 1024, False), (16400, 1024, False), (16400, 1024, True), (131083, 128, True)],
    ids=["2GB-spans", "past-int32-elements", "past-int32-elements-lse-ht", "past-int32-short-rows-lse-ht"],
)
def test_spans_past_two_gigabytes_and_past_int32_elements(T, D, lse_ht):
    """bf16 [T, 128, D]. T = 8200, D = 1024: 2.15 GB per tensor in 1.07e9 elements, so the
    32-bit kernels run, with element offsets below 2^31 and byte offsets above; past 2^31
    elements, the flat kernel's 64-bit form (64-bit strides and offsets) in blocks of 512 with
    the output LSE gathered, for either out_lse layout (T = 131083: a partial last block). The
    sample holds the last rows (the largest offsets), with empty states of NaN V among them."""
    H = 128
    need = 3 * T * H * D * 2 + T * H * D + 2**30  # V in, out, the NaN-row scan's mask
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 1e9:.1f} GB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(T)
    v_a = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v_b = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    s_a = torch.randn(T, H, device="cuda", generator=g) * 4
    s_b = torch.randn(T, H, device="cuda", generator=g) * 4
    s_a[-1, ::2] = -INF
    v_a[-1, ::2] = NAN
    s_b[-2, 1::2] = INF
    v_b[-2, 1::2] = NAN
    out = torch.full_like(v_a, NAN)
    lse = _lse_layout(T, H, "HT" if lse_ht else "TH")
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    _compare(out, lse, v_a, s_a, v_b, s_b, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hn_lse_layout_padded_heads_and_unaligned_views(dtype):
    T, H, D = 1025, 16, 128
    v_a, s_a, v_b, s_b = make_states(T, H, D, dtype, "cuda", seed=3)
    # [H, T] LSE buffers passed transposed; V with padded heads and tokens; an unaligned view.
    s_a_ht = torch.full((H, T + 3), NAN, device="cuda")[:, :T].copy_(s_a.T)
    s_b_ht = s_b.T.contiguous()
    padded = torch.full((T, H + 2, D + 8), NAN, dtype=dtype, device="cuda")[:, 1 : H + 1, :D].copy_(v_a)
    flat = torch.empty(T * H * D + 1, dtype=dtype, device="cuda")
    unaligned = flat[1:].view(T, H, D).copy_(v_b)
    out = torch.full((T, H, D + 16), NAN, dtype=dtype, device="cuda")[..., :D]
    lse_ht = torch.full((H, T), NAN, device="cuda")
    zerokv.merge_state(padded, s_a_ht.T, unaligned, s_b_ht.T, out=out, out_lse=lse_ht.T)
    _compare(out, lse_ht.T, v_a, s_a, v_b, s_b, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alias", ["a", "b"])
def test_in_place_aliasing_gpu(dtype, alias):
    v_a, s_a, v_b, s_b = make_states(4097, 16, 128, dtype, "cuda", seed=5)
    keep = [x.clone() for x in (v_a, s_a, v_b, s_b)]
    out, lse = (v_a, s_a) if alias == "a" else (v_b, s_b)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    _compare(out, lse, *keep, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_rows", [0, 1000, 4097])
def test_prefix_rows_gpu(prefix_rows):
    v_a, s_a, v_b, s_b = make_states(4097, 8, 64, torch.bfloat16, "cuda", seed=9)
    out, lse = zerokv.merge_state(v_a, s_a, v_b, s_b, prefix_rows=prefix_rows)
    _compare(out, lse, v_a, s_a, v_b, s_b, torch.bfloat16, prefix_rows=prefix_rows)


@pytest.mark.gpu
def test_lse_base_2_gpu():
    v_a, s_a, v_b, s_b = make_states(999, 16, 128, torch.float32, "cuda", seed=11)
    out, lse = zerokv.merge_state(v_a, s_a, v_b, s_b, lse_base=2)
    _compare(out, lse, v_a, s_a, v_b, s_b, torch.float32, base=2)


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_empty_gpu_matches_cpu_path(index_dtype):
    T, H, D = 3000, 8, 128
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, "cuda", seed=13)
    g = torch.Generator().manual_seed(1)
    q_lens = torch.randint(0, 40, (120,), generator=g)
    q_lens[-1] = T - q_lens[:-1].sum()
    assert q_lens[-1] >= 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(index_dtype)
    kv = torch.randint(0, 3, (120,), generator=g).to(index_dtype)
    # state a of the a-empty rows as an attention kernel leaves it: a finite garbage LSE (larger
    # than b's, so that using it would show) and V of NaN and Inf
    rows = torch.from_numpy(reference.rows_with_empty_a(cu.numpy(), kv.numpy(), T))
    assert 0 < int(rows.sum()) < T
    s_a_garbage, v_a_garbage = s_a.clone(), v_a.clone()
    s_a_garbage[rows.cuda()] = 30.0
    v_a_garbage[rows.cuda()] = NAN
    v_a_garbage[rows.cuda(), :, ::3] = INF
    out = torch.full_like(v_a, NAN)
    lse = torch.full_like(s_a, NAN)
    zerokv.merge_state(
        v_a_garbage, s_a_garbage, v_b, s_b, out=out, out_lse=lse, a_empty=(cu.cuda(), kv.cuda())
    )
    inputs = (v_a_garbage, s_a_garbage, v_b, s_b)
    ref_out, ref_lse = reference.merge_state(*(f64(x) for x in inputs), a_empty_rows=rows.numpy())
    assert_close(out, ref_out, torch.bfloat16, "out")
    assert_close(lse, ref_lse, torch.float32, "lse")
    cpu_out, cpu_lse = zerokv.merge_state(*(x.cpu() for x in inputs), a_empty=(cu, kv))
    assert_close(out, f64(cpu_out), torch.bfloat16, "out: GPU vs CPU", roundings=2)
    assert_close(lse, f64(cpu_lse), torch.float32, "lse: GPU vs CPU", roundings=2)


@pytest.mark.gpu
def test_fp8_output_with_scale():
    fp8 = torch.float8_e4m3fn
    v_a, s_a, v_b, s_b = make_states(512, 8, 128, torch.bfloat16, "cuda", seed=17, edges=False)
    scale = torch.tensor([0.01], device="cuda")
    out = torch.full((512, 8, 128), NAN, device="cuda").to(fp8)  # e4m3fn's NaN: unwritten shows
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_scale=scale)
    ref, _ = reference.merge_state(*(f64(x) for x in (v_a, s_a, v_b, s_b)))
    expected = torch.from_numpy(np.clip(ref / 0.01, -448, 448)).float()
    # e4m3 keeps 3 mantissa bits: within one rounding step (1/16 relative, 2^-9 near zero)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=1 / 16, atol=2**-9)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NTHD", "TNHD"])
@pytest.mark.parametrize("N", [1, 2, 3, 8])
def test_merge_states_kernel(dtype, layout, N):
    T, H, D = 513, 16, 72
    states = [make_states(T, H, D, dtype, "cuda", seed=N * 10 + i) for i in range(N)]
    v = torch.stack([s[0] for s in states])
    s = torch.stack([s[1] for s in states])
    if layout == "TNHD":
        v = v.transpose(0, 1).contiguous().transpose(0, 1)
        s = s.transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.full((T, H, D), NAN, dtype=dtype, device="cuda")
    lse = torch.full((T, H), NAN, device="cuda")
    zerokv.merge_states(v, s, out=out, out_lse=lse)
    ref_out, ref_lse = reference.merge_states(f64(v), f64(s))
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, torch.float32, "lse")


@pytest.mark.gpu
def test_runs_on_the_current_torch_stream():
    T, H, D = 8192, 32, 128
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, "cuda", seed=19)
    side = torch.cuda.Stream()
    out = torch.full_like(v_a, NAN)
    a2 = torch.empty_like(v_a)
    zerokv.merge_state(a2, s_a, v_b, s_b, out=out)  # a first call on the default stream
    torch.cuda.synchronize()
    for _ in range(2):  # the second call reuses the prepared launch: it must follow the stream too
        out.fill_(NAN)
        a2.fill_(NAN)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # keep the side stream busy: a launch elsewhere would race
            a2.copy_(v_a)  # produced on the side stream
            zerokv.merge_state(a2, s_a, v_b, s_b, out=out)
        side.synchronize()
        _compare(out, None, v_a, s_a, v_b, s_b, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    T, H, D = 2048, 16, 128
    dev = torch.device("cuda", torch.cuda.current_device())
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, dev, seed=23)
    out = torch.full_like(v_a, NAN)
    lse = torch.full_like(s_a, NAN)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)  # compile and load first
    graph = torch.cuda.CUDAGraph()
    # a capture stream of the tensors' device (torch's default one is bound to the device of its
    # first use in the process, which another test may have made cuda:1)
    with torch.cuda.device(dev), torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
    fresh = make_states(T, H, D, torch.bfloat16, dev, seed=29)
    for dst, src in zip((v_a, s_a, v_b, s_b), fresh, strict=True):
        dst.copy_(src)
    out.fill_(NAN)
    lse.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    _compare(out, lse, *fresh, torch.bfloat16)


@pytest.mark.gpu
def test_zero_size_is_a_no_op_gpu():
    """Zero tokens or zero heads: the results have the right shapes and nothing is written, not
    even with given outputs (views inside poisoned buffers) or offsets that claim rows."""
    for T, H in ((0, 4), (4, 0)):
        shape = (T, H, 8)
        v = torch.empty(shape, device="cuda")
        s = torch.empty(shape[:2], device="cuda")
        out, lse = zerokv.merge_state(v, s, v, s)
        assert out.shape == shape and lse.shape == shape[:2]

        v_buf = torch.full((T + 2, H + 2, 8), NAN, device="cuda")
        s_buf = torch.full((T + 2, H + 2), NAN, device="cuda")
        o_buf = torch.full((T + 2, H + 2, 8), NAN, device="cuda")
        l_buf = torch.full((T + 2, H + 2), NAN, device="cuda")
        kept = [b.clone() for b in (v_buf, s_buf, o_buf, l_buf)]
        v, s = v_buf[1 : T + 1, 1 : H + 1], s_buf[1 : T + 1, 1 : H + 1]
        out, lse = o_buf[1 : T + 1, 1 : H + 1], l_buf[1 : T + 1, 1 : H + 1]
        cu = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
        kv = torch.zeros(2, dtype=torch.int32, device="cuda")
        zerokv.merge_state(v, s, v, s, out=out, out_lse=lse)
        zerokv.merge_state(v, s, v, s, out=out, out_lse=lse, a_empty=(cu, kv), prefix_rows=0)
        zerokv.merge_states(torch.stack([v, v]), torch.stack([s, s]), out=out, out_lse=lse)
        torch.cuda.synchronize()
        for b, k in zip((v_buf, s_buf, o_buf, l_buf), kept, strict=True):
            assert torch.equal(b.view(torch.int32), k.view(torch.int32)), f"written with T={T}, H={H}"


@pytest.mark.gpu
def test_repeated_calls_reuse_the_prepared_launch_and_see_new_data():
    T, H, D = 1000, 8, 64
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, "cuda", seed=31)
    out, lse = torch.empty_like(v_a), torch.empty_like(s_a)
    for seed in (32, 33, 34):
        fresh = make_states(T, H, D, torch.bfloat16, "cuda", seed=seed)
        for dst, src in zip((v_a, s_a, v_b, s_b), fresh, strict=True):
            dst.copy_(src)
        out.fill_(NAN)
        lse.fill_(NAN)
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)
        _compare(out, lse, *fresh, torch.bfloat16)
    # same buffers, another layout or base: not the remembered launch
    out.fill_(NAN)
    lse.fill_(NAN)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, lse_base=2)
    _compare(out, lse, v_a, s_a, v_b, s_b, torch.bfloat16, base=2)
    out.fill_(NAN)
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=None)
    _compare(out, None, v_a, s_a, v_b, s_b, torch.bfloat16)
    with pytest.raises(ValueError, match="prefix_rows"):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, prefix_rows=T + 1)
