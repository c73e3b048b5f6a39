"""Bad inputs to every public function and adapter: a clear error, and nothing written.

Every tensor of a case (inputs and outputs) is a view into a larger buffer poisoned with NaN (or
a sentinel integer); after the rejected call every byte of every buffer must be as before, on
the CPU path (torch and numpy) as on the GPU. Each case states the exception type and the
caller's argument names its message must contain (as whole words): the adapters speak their
engine's language (``prefix_output``, ``query_start_loc``, ``v_merged``, ...).

A *family* is one function with valid arguments (its base call, which a control test runs);
a *case* is a family with one argument made wrong. The same case runs with torch CPU tensors,
with numpy arrays (views of the same memory) and, marked ``gpu``, with CUDA tensors.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import oracles
import pytest
import torch
from conftest import assert_close

import zerokv
from zerokv.compat import flashinfer, sglang, vllm

NAN = float("nan")
PAD = 19  # poisoned elements on each side of every buffer's usable middle
INT_POISON = -77
T, H, D, N = 6, 3, 8, 3  # T != H: a transposed LSE has another shape
CU = [0, 2, 4, 6]  # query offsets of B = 3 requests
KV = [0, 3, 0]  # requests 0 and 2 have no KV ...
CU_KV = [0, 0, 4, 4]  # ... nor context
F16, F32, F64, FP8 = torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn
I16, I32, I64, BOOL = torch.int16, torch.int32, torch.int64, torch.bool

ALL = frozenset({"torch", "numpy", "cuda"})
TORCH = frozenset({"torch", "cuda"})  # requires grad, inference tensors, fp8, torch.ops
NUMPY = frozenset({"numpy"})  # read-only arrays
CUDA = frozenset({"cuda"})  # tensors on two devices
HOST = frozenset({"torch", "numpy"})


class ReadOnly:
    """A tensor to hand over as a read-only numpy array (numpy cases only)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Arena:
    """Tensors as views into poisoned buffers, all remembered and compared after the call."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        self.device = "cuda" if kind == "cuda" else "cpu"
        self.g = torch.Generator().manual_seed(seed)
        self.buffers: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []

    def buffer(self, n: int, dtype=F32, *, requires_grad=False, inference=False, device=None):
        """The usable middle ``n`` elements of a fresh 1-D buffer poisoned on both sides."""
        poison = NAN if dtype.is_floating_point else INT_POISON
        with torch.inference_mode(inference):
            buf = torch.full((n + 2 * PAD,), poison, device=device or self.device).to(dtype)
        buf.requires_grad_(requires_grad)
        self.buffers.append(buf)
        return buf[PAD : PAD + n]

    def nan(self, shape, dtype=F32, **kw) -> torch.Tensor:
        """An output: NaN (or the integer poison) inside a poisoned buffer."""
        return self.buffer(int(np.prod(shape)), dtype, **kw).view(shape)

    def rand(self, shape, dtype=F32, device=None) -> torch.Tensor:
        """An input: fresh random values (spread like an LSE) inside a poisoned buffer."""
        x = self.nan(shape, dtype, device=device)
        x.copy_((torch.randn(shape, generator=self.g) * 4).to(dtype))
        return x

    def lse(self, tokens=T, heads=H, ht=False, *, out=False, dtype=F32, **kw):
        """An LSE as the caller passes it: ``[H, T]`` when ``ht`` (vLLM), else ``[T, H]``."""
        shape = (heads, tokens) if ht else (tokens, heads)
        return self.nan(shape, dtype, **kw) if out else self.rand(shape, dtype, **kw)

    def idx(self, values, dtype=I32, device=None) -> torch.Tensor:
        x = self.buffer(len(values), dtype, device=device)
        x.copy_(torch.tensor(values, dtype=dtype))
        return x

    def fill(self, x: torch.Tensor, values) -> torch.Tensor:
        x.copy_(torch.as_tensor(values, dtype=x.dtype) if not isinstance(values, torch.Tensor) else values)
        return x

    def arg(self, x):
        """What the caller hands over: numpy views of the same memory for the numpy kind."""
        if isinstance(x, ReadOnly):
            arr = x.t.numpy()
            arr.flags.writeable = False
            return arr
        if isinstance(x, dict):
            return {k: self.arg(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(self.arg(v) for v in x)
        if self.kind == "numpy" and isinstance(x, torch.Tensor):
            return x.numpy()
        return x

    def freeze(self) -> None:
        self.kept = [b.detach().clone() for b in self.buffers]

    def assert_unchanged(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        for i, (b, k) in enumerate(zip(self.buffers, self.kept, strict=True)):
            changed = (b.detach().view(torch.uint8) != k.view(torch.uint8)).nonzero().flatten()
            assert changed.numel() == 0, (
                f"buffer {i}: bytes {changed[:8].tolist()} changed by a rejected call"
            )


# --- families: one function each, with valid arguments ----------------------------------------


@dataclass(frozen=True)
class Family:
    id: str
    base: Callable  # Arena -> role dict (valid arguments)
    call: Callable  # role dict -> (function, args, kwargs)
    names: dict  # role -> the caller's name (roles not listed are named as they are)
    kinds: frozenset = ALL
    ht: bool = False  # LSEs are [H, T] (vLLM)
    lens: tuple = ()  # empty-row families: kv_lens (per request) or context offsets


def _two(a: Arena, fam: Family) -> dict:
    return {
        "v_a": a.rand((T, H, D)),
        "s_a": a.lse(ht=fam.ht),
        "v_b": a.rand((T, H, D)),
        "s_b": a.lse(ht=fam.ht),
        "out": a.nan((T, H, D)),
        "out_lse": a.lse(ht=fam.ht, out=True),
    }


def _rows(a: Arena, fam: Family) -> dict:
    return {"out": a.rand((T, H, D)), "lse": a.lse(ht=fam.ht), "cu": a.idx(CU), "lens": a.idx(list(fam.lens))}


def _pick(r: dict, positional: tuple, keyword: tuple = ()) -> tuple:
    """Positional roles in order; keyword roles only when the case set them."""
    return tuple(r.get(k) for k in positional), {k: r[k] for k in keyword if k in r}


def _calls(fn, positional, keyword=(), **fixed):
    def call(r):
        args, kw = _pick(r, positional, keyword)
        return fn, args, {**kw, **fixed}

    return call


_TWO = ("v_a", "s_a", "v_b", "s_b")
_OPTS = ("out", "out_lse", "lse_base", "prefix_rows", "a_empty", "out_scale", "sinks")
_VLLM = {"v_a": "prefix_output", "s_a": "prefix_lse", "v_b": "suffix_output", "s_b": "suffix_lse"}
_VLLM |= {"out": "output", "out_lse": "output_lse"}
_OPS_OPTS = ("lse_base", "prefix_rows", "a_cu_seqlens_q", "a_kv_lens", "out_scale", "sinks")
ops = torch.ops.zerokv

MERGE_STATE = Family("merge_state", _two, _calls(zerokv.merge_state, _TWO, _OPTS), {})
VLLM_MERGE = Family(
    "vllm.merge_attn_states",
    _two,
    _calls(
        vllm.merge_attn_states,
        ("out", *_TWO, "out_lse"),
        ("prefill_tokens_with_context", "output_scale"),
    ),
    _VLLM,
    ht=True,
)
SGLANG_MERGE = Family(
    "sglang.merge_state_v2",
    _two,
    _calls(sglang.merge_state_v2, (*_TWO, "out", "out_lse")),
    {"out": "v_merged", "out_lse": "s_merged"},
)
OPS_MERGE_OUT = Family(
    "torch.ops.merge_state_out",
    _two,
    _calls(ops.merge_state_out, (*_TWO, "out", "out_lse"), _OPS_OPTS),
    {},
    TORCH,
)
OPS_MERGE = Family("torch.ops.merge_state", _two, _calls(ops.merge_state, _TWO, _OPS_OPTS), {}, TORCH)
FI_MERGE = Family("flashinfer.merge_state", _two, _calls(flashinfer.merge_state, _TWO), {})


def _in_place(a: Arena, fam: Family) -> dict:
    return {"v": a.rand((T, H, D)), "s": a.lse(), "v_other": a.rand((T, H, D)), "s_other": a.lse()}


FI_IN_PLACE = Family(
    "flashinfer.merge_state_in_place",
    _in_place,
    _calls(flashinfer.merge_state_in_place, ("v", "s", "v_other", "s_other"), ("mask",)),
    {},
)


def _n(a: Arena, fam: Family) -> dict:
    return {
        "v": a.rand((N, T, H, D)),
        "s": a.rand((N, T, H)),
        "out": a.nan((T, H, D)),
        "out_lse": a.lse(out=True),
    }


def _tn(a: Arena, fam: Family) -> dict:
    return {"v": a.rand((T, N, H, D)), "s": a.rand((T, N, H))}


_N_OPTS = ("out", "out_lse", "lse_base", "out_scale", "sinks")
MERGE_STATES = Family("merge_states", _n, _calls(zerokv.merge_states, ("v", "s"), _N_OPTS), {})
OPS_MERGE_STATES = Family(
    "torch.ops.merge_states", _n, _calls(ops.merge_states, ("v", "s"), ("lse_base", "sinks")), {}, TORCH
)
OPS_MERGE_STATES_OUT = Family(
    "torch.ops.merge_states_out",
    _n,
    _calls(ops.merge_states_out, ("v", "s", "out", "out_lse"), ("lse_base", "out_scale", "sinks")),
    {},
    TORCH,
)
FI_STATES = Family("flashinfer.merge_states", _tn, _calls(flashinfer.merge_states, ("v", "s")), {})

_FIXUP_NAMES = {"cu": "cu_seqlens_q", "lens": "kv_lens"}
_MASK_NAMES = {"cu": "cu_seqlens_q", "lens": "cu_seqlens_kv"}
FIXUP = Family(
    "fixup_zero_kv_rows",
    _rows,
    _calls(zerokv.fixup_zero_kv_rows, ("out", "lse", "lens", "cu"), ("max_seqlen_q",)),
    _FIXUP_NAMES,
    lens=tuple(KV),
)
MASK = Family(
    "mask_empty_context",
    _rows,
    _calls(zerokv.mask_empty_context, ("out", "lse", "cu", "lens")),
    _MASK_NAMES,
    lens=tuple(CU_KV),
)
SGLANG_FIXUP = Family(
    "sglang.fixup_zero_kv_rows",
    _rows,
    lambda r: (
        sglang.fixup_zero_kv_rows,
        (r["out"], r["lse"], r["lens"], r["cu"], r.get("max_seq_len", 2)),
        {},
    ),
    {"cu": "cum_seq_lens", "lens": "kv_lens"},
    lens=tuple(KV),
)
VLLM_MASK = Family(
    "vllm.mask_empty_context",
    _rows,
    _calls(vllm.mask_empty_context, ("lse", "out", "cu", "lens")),
    {"out": "output", "cu": "query_start_loc", "lens": "context_start_loc"},
    ht=True,
    lens=tuple(CU_KV),
)
OPS_FIXUP = Family(
    "torch.ops.fixup_zero_kv_rows",
    _rows,
    _calls(ops.fixup_zero_kv_rows, ("out", "lse", "lens", "cu")),
    _FIXUP_NAMES,
    TORCH,
    lens=tuple(KV),
)
OPS_MASK = Family(
    "torch.ops.mask_empty_context",
    _rows,
    _calls(ops.mask_empty_context, ("out", "lse", "cu", "lens")),
    _MASK_NAMES,
    TORCH,
    lens=tuple(CU_KV),
)


def _plan(a: Arena, fam: Family) -> dict:
    return {"query_lens": [1, 2], "context_lens": [3, 4], "chunk_tokens": 64}


def _plan_call(r: dict):
    def lengths(x):  # CPU lengths inside poisoned buffers; anything else as it is
        if not isinstance(x, list) or not x or not all(type(v) is int for v in x):
            return x
        return r["arena"].fill(r["arena"].buffer(len(x), I64, device="cpu"), x)

    args = (lengths(r["query_lens"]), lengths(r["context_lens"]), r["chunk_tokens"])
    return zerokv.plan_context_chunks, args, {"align": r["align"]} if "align" in r else {}


PLAN = Family("plan_context_chunks", _plan, _plan_call, {})

FAMILIES = [
    MERGE_STATE, VLLM_MERGE, SGLANG_MERGE, OPS_MERGE_OUT, OPS_MERGE, FI_MERGE, FI_IN_PLACE, MERGE_STATES,
    OPS_MERGE_STATES, OPS_MERGE_STATES_OUT, FI_STATES, FIXUP, MASK, SGLANG_FIXUP, VLLM_MASK, OPS_FIXUP, OPS_MASK, PLAN,
]  # fmt: skip


# --- cases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    family: Family
    mutate: Callable  # (Arena, role dict, Family) -> role overrides
    exc: type
    roles: tuple  # the roles (or caller names) the message must name
    kinds: frozenset
    also: tuple = ()  # further text the message must hold

    def build(self, a: Arena):
        r = self.family.base(a, self.family)
        r["arena"] = a
        r.update(self.mutate(a, r, self.family) or {})
        return self.family.call(r)

    def names(self) -> list[str]:
        return [self.family.names.get(role, role) for role in self.roles]


CASES: list[Case] = []


def cases(families, table, kinds=ALL):
    """``table`` rows: (id, exception, roles named, mutation[, kinds[, also]])."""
    for fam in families:
        for row in table:
            id, exc, roles, mutate, *rest = row
            row_kinds = rest[0] if rest else ALL
            also = rest[1] if len(rest) > 1 else ()
            roles = (roles,) if isinstance(roles, str) else tuple(roles)
            CASES.append(Case(f"{fam.id}-{id}", fam, mutate, exc, roles, fam.kinds & kinds & row_kinds, also))


def _values(role, exc, values):
    """Rows that set one scalar argument to each of ``values``."""
    return [(f"{role}-{v}", exc, role, lambda a, r, f, v=v: {role: v}) for v in values]


def _tok(x, sl, ht):  # a slice along the token dimension of an LSE in the caller's layout
    return x[:, sl] if ht else x[sl]


def _head(x, sl, ht):
    return x[sl] if ht else x[:, sl]


def _row_shift(a, r, f):
    big = a.rand((T + 1, H, D))
    return {"v_a": big[:T], "out": big[1:]}


def _head_shift(a, r, f):
    big = a.rand((T, H + 1, D))
    return {"v_b": big[:, :H], "out": big[:, 1:]}


def _lse_token_shift(a, r, f):
    big = a.lse(T + 1, H, f.ht)
    return {"s_a": _tok(big, slice(0, T), f.ht), "out_lse": _tok(big, slice(1, None), f.ht)}


def _lse_head_shift(a, r, f):
    big = a.lse(T, H + 1, f.ht)
    return {"s_b": _head(big, slice(0, H), f.ht), "out_lse": _head(big, slice(1, None), f.ht)}


def _lse_transposed(a, r, f):
    sq = a.rand((T, T))  # s_a is a corner of it; out_lse the transposed corner
    return {"s_a": sq[:H] if f.ht else sq[:, :H], "out_lse": sq.T[:H] if f.ht else sq.T[:, :H]}


def _share(a, r, f):
    buf = a.buffer(T * H * D)
    return {"out": buf.view(T, H, D), "out_lse": buf[5 : 5 + T * H].view((H, T) if f.ht else (T, H))}


def _out_over_s_b(a, r, f):
    buf = a.buffer(T * H * D)
    s_b = a.fill(buf[: T * H], torch.randn(T * H, generator=a.g)).view((H, T) if f.ht else (T, H))
    return {"s_b": s_b, "out": buf.view(T, H, D)}


def _expanded_lse(a, r, f):
    return a.nan((1, T)).expand(H, T) if f.ht else a.nan((1, H)).expand(T, H)


# fmt: off
# Every two-way merge that writes given outputs (inputs and outputs in the caller's layout).
cases([MERGE_STATE, VLLM_MERGE, SGLANG_MERGE, OPS_MERGE_OUT], [
    ("v_b-int32", TypeError, "v_b", lambda a, r, f: {"v_b": a.rand((T, H, D), I32)}),
    ("v_a-bool", TypeError, "v_a", lambda a, r, f: {"v_a": a.rand((T, H, D), BOOL)}),
    ("s_a-int32", TypeError, "s_a", lambda a, r, f: {"s_a": a.lse(ht=f.ht, dtype=I32)}),
    ("v_a-2d", ValueError, "v_a", lambda a, r, f: {"v_a": a.rand((T, H * D))}),
    ("s_b-3d", ValueError, "s_b", lambda a, r, f: {"s_b": a.rand((T, H, 1))}),
    ("s_a-1d", ValueError, "s_a", lambda a, r, f: {"s_a": a.rand((T * H,))}),
    ("v_b-fewer-tokens", ValueError, "v_b", lambda a, r, f: {"v_b": a.rand((T - 1, H, D))}),
    ("s_a-more-heads", ValueError, "s_a", lambda a, r, f: {"s_a": a.lse(T, H + 1, f.ht)}),
    ("out-wrong-shape", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, D + 1))}),
    ("out_lse-wrong-shape", ValueError, "out_lse", lambda a, r, f: {"out_lse": a.lse(T + 1, H, f.ht, out=True)}),
    ("out-head_dim-stride-2", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, 2 * D))[..., ::2]}),
    ("v_a-head_dim-stride-2", ValueError, "v_a", lambda a, r, f: {"v_a": a.rand((T, H, 2 * D))[..., ::2]}),
    ("out-int32", TypeError, "out", lambda a, r, f: {"out": a.nan((T, H, D), I32)}),
    ("out_lse-float16", TypeError, "out_lse", lambda a, r, f: {"out_lse": a.lse(ht=f.ht, out=True, dtype=F16)}),
    ("out-shifted-a-row-over-v_a", ValueError, ["out", "v_a"], _row_shift),
    ("out-shifted-a-head-over-v_b", ValueError, ["out", "v_b"], _head_shift),
    ("out_lse-shifted-a-token-over-s_a", ValueError, ["out_lse", "s_a"], _lse_token_shift),
    ("out_lse-shifted-a-head-over-s_b", ValueError, ["out_lse", "s_b"], _lse_head_shift),
    ("out_lse-transposed-over-s_a", ValueError, ["out_lse", "s_a"], _lse_transposed),
    ("out-and-out_lse-share-bytes", ValueError, ["out", "out_lse"], _share),
    ("out-over-s_b", ValueError, ["out", "s_b"], _out_over_s_b),
    ("out-float16-view-of-v_b", ValueError, ["out", "v_b"], lambda a, r, f: {"out": r["v_b"].view(F16)[..., :D]}),
    ("out_lse-read-only", ValueError, "out_lse", lambda a, r, f: {"out_lse": ReadOnly(r["out_lse"])}, NUMPY),
    ("out-read-only", ValueError, "out", lambda a, r, f: {"out": ReadOnly(r["out"])}, NUMPY),
    ("out_lse-requires-grad", ValueError, "out_lse",
     lambda a, r, f: {"out_lse": a.lse(ht=f.ht, out=True, requires_grad=True)}, TORCH),
    ("out-requires-grad", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, D), requires_grad=True)}, TORCH),
    ("out-inference-tensor", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, D), inference=True)}, TORCH),
    ("out_lse-expanded", ValueError, "out_lse", lambda a, r, f: {"out_lse": _expanded_lse(a, r, f)}),
    ("s_b-on-the-cpu", ValueError, "s_b", lambda a, r, f: {"s_b": a.lse(ht=f.ht, device="cpu")}, CUDA),
    ("out-on-the-cpu", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, D), device="cpu")}, CUDA),
])
# Non-tensors are the schema's business for torch.ops; SGLang converts a float64 LSE.
cases([MERGE_STATE, VLLM_MERGE, SGLANG_MERGE, FI_MERGE], [
    ("v_a-a-list", TypeError, "v_a", lambda a, r, f: {"v_a": [[1.0]]}),
    ("s_b-None", TypeError, "s_b", lambda a, r, f: {"s_b": None}),
])
cases([MERGE_STATE, VLLM_MERGE, OPS_MERGE_OUT], [  # FlashInfer converts a float64 LSE, as SGLang
    ("s_b-float64", TypeError, "s_b", lambda a, r, f: {"s_b": a.lse(ht=f.ht, dtype=F64)}),
])


def _a_empty(cu=CU, kv=KV, cu_dtype=I32, kv_dtype=I32, device=None):
    return lambda a, r, f: {"a_empty": (a.idx(cu, cu_dtype, device), a.idx(kv, kv_dtype, device))}


def _lse_over_kv_lens(a, r, f):
    buf = a.fill(a.buffer(T * H), torch.randn(T * H, generator=a.g))
    kv = a.fill(buf[: len(KV)].view(I32), KV)
    return {"a_empty": (a.idx(CU), kv), "out_lse": buf.view(T, H)}


def _lse_over(role, n):
    def mutate(a, r, f):
        buf = a.fill(a.buffer(T * H), torch.randn(T * H, generator=a.g))
        extra = {"out_scale": {"out": a.nan((T, H, D), FP8)}}.get(role, {})
        return {role: buf[-n:], "out_lse": buf.view(T, H), **extra}

    return mutate


cases([MERGE_STATE], [
    *_values("lse_base", ValueError, (10, "ten", None, 2.5)),
    *_values("prefix_rows", TypeError, (True, 1.5, "3")),
    *_values("prefix_rows", ValueError, (-1, T + 1)),
    ("a_empty-half-pair", ValueError, "a_empty", lambda a, r, f: {"a_empty": (a.idx(CU), None)}),
    ("a_empty-not-a-pair", TypeError, "a_empty", lambda a, r, f: {"a_empty": a.idx(CU)}),
    ("a_empty-cu-float32", TypeError, "a_empty", _a_empty(cu_dtype=F32)),
    ("a_empty-kv_lens-one-too-many", ValueError, "a_empty", _a_empty(kv=KV + [1])),
    ("a_empty-cu-empty", ValueError, "a_empty", _a_empty(cu=[], kv=[])),
    ("a_empty-mixed-index-dtypes", TypeError, "a_empty", _a_empty(kv_dtype=I64)),
    ("a_empty-kv_lens-bool", TypeError, "a_empty", _a_empty(kv=[False, True, False], kv_dtype=BOOL)),
    ("a_empty-cu-2d", ValueError, "a_empty", lambda a, r, f: {"a_empty": (a.idx(CU).view(2, 2), a.idx(KV))}),
    ("a_empty-cu-strided", ValueError, "a_empty",
     lambda a, r, f: {"a_empty": (a.idx([0, 9, 2, 9, 4, 9, 6])[::2], a.idx(KV))}),
    ("a_empty-on-the-cpu", ValueError, "a_empty", _a_empty(device="cpu"), CUDA),
    ("out_lse-over-a_empty-kv_lens", ValueError, ["out_lse", "a_empty"], _lse_over_kv_lens),
    ("out_scale-with-a-float32-out", ValueError, "out_scale", lambda a, r, f: {"out_scale": a.rand((1,))}),
    ("fp8-out-without-out_scale", ValueError, "out_scale", lambda a, r, f: {"out": a.nan((T, H, D), FP8)}, TORCH),
    ("out_scale-two-elements", ValueError, "out_scale",
     lambda a, r, f: {"out": a.nan((T, H, D), FP8), "out_scale": a.rand((2,))}, TORCH),
    ("out_scale-float16", TypeError, "out_scale",
     lambda a, r, f: {"out": a.nan((T, H, D), FP8), "out_scale": a.rand((1,), F16)}, TORCH),
    ("out_lse-over-out_scale", ValueError, ["out_lse", "out_scale"], _lse_over("out_scale", 1), TORCH),
    ("sinks-float16", TypeError, "sinks", lambda a, r, f: {"sinks": a.rand((H,), F16)}),
    ("sinks-one-too-many", ValueError, "sinks", lambda a, r, f: {"sinks": a.rand((H + 1,))}),
    ("sinks-2d", ValueError, "sinks", lambda a, r, f: {"sinks": a.rand((1, H))}),
    ("sinks-on-the-cpu", ValueError, "sinks", lambda a, r, f: {"sinks": a.rand((H,), device="cpu")}, CUDA),
    ("out_lse-over-sinks", ValueError, ["out_lse", "sinks"], _lse_over("sinks", H)),
])

cases([VLLM_MERGE], [
    ("output-None", TypeError, "out", lambda a, r, f: {"out": None}),
    ("prefix_lse-given-[T,H]", ValueError, "s_a", lambda a, r, f: {"s_a": a.rand((T, H))}, ALL,
     (f"({H}, {T})", f"got ({T}, {H})", "num_heads, num_tokens")),
    ("output_lse-given-[T,H]", ValueError, "out_lse", lambda a, r, f: {"out_lse": a.nan((T, H))}, ALL,
     (f"({H}, {T})", f"got ({T}, {H})")),
    *_values("prefill_tokens_with_context", TypeError, (True, 1.5)),
    *_values("prefill_tokens_with_context", ValueError, (-1, T + 1)),
    ("output_scale-with-a-float32-output", ValueError, "output_scale",
     lambda a, r, f: {"output_scale": a.rand((1,))}),
    ("fp8-output-without-output_scale", ValueError, "output_scale",
     lambda a, r, f: {"out": a.nan((T, H, D), FP8)}, TORCH),
    ("output_scale-two-elements", ValueError, "output_scale",
     lambda a, r, f: {"out": a.nan((T, H, D), FP8), "output_scale": a.rand((2,))}, TORCH),
])

cases([SGLANG_MERGE], [
    ("s_b-bool", TypeError, "s_b", lambda a, r, f: {"s_b": a.lse(dtype=BOOL)}),
    ("s_a-int64", TypeError, "s_a", lambda a, r, f: {"s_a": a.lse(dtype=I64)}),
    ("s_a-a-list", TypeError, "s_a", lambda a, r, f: {"s_a": [[0.0] * H] * T}),
    ("v_b-float64", TypeError, "v_b", lambda a, r, f: {"v_b": a.rand((T, H, D), F64)}),
])

cases([FI_MERGE], [
    ("s_a-int32", TypeError, "s_a", lambda a, r, f: {"s_a": a.lse(dtype=I32)}),
    ("v_b-fewer-tokens", ValueError, "v_b", lambda a, r, f: {"v_b": a.rand((T - 1, H, D))}),
    ("s_b-given-[H,T]", ValueError, "s_b", lambda a, r, f: {"s_b": a.rand((H, T))}),
])


def _fi_shift(a, r, f):
    big = a.rand((T + 1, H, D))
    return {"v": big[:T], "v_other": big[1:]}


def _fi_lse_shift(a, r, f):
    big = a.rand((T, H + 1))
    return {"s": big[:, :H], "s_other": big[:, 1:]}


cases([FI_IN_PLACE], [
    ("v_other-shifted-a-row-over-v", ValueError, ["v", "v_other"], _fi_shift),
    ("s_other-shifted-a-head-over-s", ValueError, ["s", "s_other"], _fi_lse_shift),
    ("mask-float32", TypeError, "mask", lambda a, r, f: {"mask": a.idx([1.0] * T, F32)}),
    ("mask-one-too-many", ValueError, "mask", lambda a, r, f: {"mask": a.idx([True] * (T + 1), BOOL)}),
    ("mask-strided", ValueError, "mask", lambda a, r, f: {"mask": a.idx([True] * (2 * T), BOOL)[::2]}),
    ("mask-on-the-cpu", ValueError, "mask", lambda a, r, f: {"mask": a.idx([True] * T, BOOL, "cpu")}, CUDA),
    ("s-read-only", ValueError, "s", lambda a, r, f: {"s": ReadOnly(r["s"])}, NUMPY),
    ("v-read-only", ValueError, "v", lambda a, r, f: {"v": ReadOnly(r["v"])}, NUMPY),
    ("s-requires-grad", ValueError, "s", lambda a, r, f: {"s": a.nan((T, H), requires_grad=True)}, TORCH),
    ("v-inference-tensor", ValueError, "v", lambda a, r, f: {"v": a.nan((T, H, D), inference=True)}, TORCH),
    ("v-expanded-over-tokens", ValueError, "v", lambda a, r, f: {"v": a.rand((1, H, D)).expand(T, H, D)}),
    ("s-int32", TypeError, "s", lambda a, r, f: {"s": a.rand((T, H), I32)}),
    ("v_other-wrong-shape", ValueError, "v_other", lambda a, r, f: {"v_other": a.rand((T, H, D + 1))}),
])


def _states_share(a, r, f):
    buf = a.buffer(T * H * D)
    return {"out": buf.view(T, H, D), "out_lse": buf[7 : 7 + T * H].view(T, H)}


cases([MERGE_STATES, OPS_MERGE_STATES_OUT], [
    ("out-is-v[0]", ValueError, ["out", "v"], lambda a, r, f: {"out": r["v"][0]}),
    ("out_lse-is-s[1]", ValueError, ["out_lse", "s"], lambda a, r, f: {"out_lse": r["s"][1]}),
    ("out-shifted-inside-v", ValueError, ["out", "v"],
     lambda a, r, f: {"out": r["v"].reshape(-1)[3 : 3 + T * H * D].view(T, H, D)}),
    ("out-and-out_lse-share-bytes", ValueError, ["out", "out_lse"], _states_share),
    ("out-wrong-shape", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H + 1, D))}),
    ("no-states", ValueError, "v", lambda a, r, f: {"v": a.rand((0, T, H, D)), "s": a.rand((0, T, H))}),
    ("out_scale-with-a-float32-out", ValueError, "out_scale", lambda a, r, f: {"out_scale": a.rand((1,))}),
    ("out_lse-read-only", ValueError, "out_lse", lambda a, r, f: {"out_lse": ReadOnly(r["out_lse"])}, NUMPY),
    ("out_lse-requires-grad", ValueError, "out_lse",
     lambda a, r, f: {"out_lse": a.nan((T, H), requires_grad=True)}, TORCH),
    ("out-inference-tensor", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, D), inference=True)}, TORCH),
    ("out_lse-expanded", ValueError, "out_lse", lambda a, r, f: {"out_lse": a.nan((1, H)).expand(T, H)}),
    ("v-int32", TypeError, "v", lambda a, r, f: {"v": a.rand((N, T, H, D), I32)}),
    ("s-on-the-cpu", ValueError, "s", lambda a, r, f: {"s": a.rand((N, T, H), device="cpu")}, CUDA),
])
cases([MERGE_STATES, OPS_MERGE_STATES, OPS_MERGE_STATES_OUT], [
    ("v-3d", ValueError, "v", lambda a, r, f: {"v": a.rand((T, H, D))}),
    ("s-wrong-shape", ValueError, "s", lambda a, r, f: {"s": a.rand((N, T, H + 1))}),
    ("lse_base-ten", ValueError, "lse_base", lambda a, r, f: {"lse_base": "ten"}),
    ("sinks-float16", TypeError, "sinks", lambda a, r, f: {"sinks": a.rand((H,), F16)}),
    ("sinks-wrong-shape", ValueError, "sinks", lambda a, r, f: {"sinks": a.rand((H - 1,))}),
])

cases([FI_STATES], [
    ("v-3d", ValueError, "v", lambda a, r, f: {"v": a.rand((T, H, D))}),
    ("s-one-head-too-many", ValueError, "s", lambda a, r, f: {"s": a.rand((T, N, H + 1))}),
    ("s-given-[N,T,H]", ValueError, "s", lambda a, r, f: {"s": a.rand((N, T, H))}),
    ("v-a-list", TypeError, "v", lambda a, r, f: {"v": [[[[1.0]]]]}),
    ("s-None", TypeError, "s", lambda a, r, f: {"s": None}),
    ("s-int32", TypeError, "s", lambda a, r, f: {"s": a.rand((T, N, H), I32)}),
    ("v-head_dim-stride-2", ValueError, "v", lambda a, r, f: {"v": a.rand((T, N, H, 2 * D))[..., ::2]}),
])

_PAIR = ["a_cu_seqlens_q", "a_kv_lens"]
cases([OPS_MERGE, OPS_MERGE_OUT], [
    ("a_kv_lens-alone", ValueError, _PAIR, lambda a, r, f: {"a_kv_lens": a.idx(KV)}),
    ("a_cu_seqlens_q-alone", ValueError, _PAIR, lambda a, r, f: {"a_cu_seqlens_q": a.idx(CU)}),
    ("a_cu_seqlens_q-float32", TypeError, "a_cu_seqlens_q",
     lambda a, r, f: {"a_cu_seqlens_q": a.idx(CU, F32), "a_kv_lens": a.idx(KV)}),
    ("a_kv_lens-one-too-many", ValueError, "a_kv_lens",
     lambda a, r, f: {"a_cu_seqlens_q": a.idx(CU), "a_kv_lens": a.idx(KV + [0])}),
    ("sinks-float16", TypeError, "sinks", lambda a, r, f: {"sinks": a.rand((H,), F16)}),
    ("lse_base-ten", ValueError, "lse_base", lambda a, r, f: {"lse_base": "ten"}),
    ("prefix_rows-past-T", ValueError, "prefix_rows", lambda a, r, f: {"prefix_rows": T + 1}),
    ("prefix_rows-negative", ValueError, "prefix_rows", lambda a, r, f: {"prefix_rows": -1}),
])
cases([OPS_MERGE_OUT], [
    ("out_scale-with-a-float32-out", ValueError, "out_scale", lambda a, r, f: {"out_scale": a.rand((1,))}),
])


def _rows_share(a, r, f):
    buf = a.fill(a.buffer(T * H * D), torch.randn(T * H * D, generator=a.g))
    return {"out": buf.view(T, H, D), "lse": buf[11 : 11 + T * H].view((H, T) if f.ht else (T, H))}


def _lse_over_lens(a, r, f):
    buf = a.fill(a.buffer(T * H), torch.randn(T * H, generator=a.g))
    return {"lens": a.fill(buf[: len(f.lens)].view(I32), f.lens), "lse": buf.view((H, T) if f.ht else (T, H))}


def _out_over_cu(a, r, f):
    buf = a.fill(a.buffer(T * H * D), torch.randn(T * H * D, generator=a.g))
    return {"cu": a.fill(buf[5 : 5 + len(CU)].view(I32), CU), "out": buf.view(T, H, D)}


ROWS = [FIXUP, MASK, SGLANG_FIXUP, VLLM_MASK, OPS_FIXUP, OPS_MASK]
cases(ROWS, [
    ("out-int32", TypeError, "out", lambda a, r, f: {"out": a.rand((T, H, D), I32)}),
    ("out-2d", ValueError, "out", lambda a, r, f: {"out": a.rand((T, H * D + 1))}),
    ("lse-one-head-too-many", ValueError, "lse", lambda a, r, f: {"lse": a.lse(T, H + 1, f.ht)}),
    ("lse-3d", ValueError, "lse", lambda a, r, f: {"lse": a.rand((T, H, 1))}),
    ("lse-float64", TypeError, "lse", lambda a, r, f: {"lse": a.lse(ht=f.ht, dtype=F64)}),
    ("lens-one-too-many", ValueError, "lens", lambda a, r, f: {"lens": a.idx([*f.lens, 0])}),
    ("lens-one-too-few", ValueError, "lens", lambda a, r, f: {"lens": a.idx(f.lens[:-1])}),
    ("lens-float32", TypeError, "lens", lambda a, r, f: {"lens": a.idx(f.lens, F32)}),
    ("lens-on-the-cpu", ValueError, "lens", lambda a, r, f: {"lens": a.idx(f.lens, device="cpu")}, CUDA),
    ("cu-float32", TypeError, "cu", lambda a, r, f: {"cu": a.idx(CU, F32)}),
    ("cu-int16", TypeError, "cu", lambda a, r, f: {"cu": a.idx(CU, I16)}),
    ("cu-2d", ValueError, "cu", lambda a, r, f: {"cu": a.idx(CU).view(2, 2)}),
    ("cu-strided", ValueError, "cu", lambda a, r, f: {"cu": a.idx([0, 9, 2, 9, 4, 9, 6])[::2]}),
    ("cu-empty", ValueError, "cu", lambda a, r, f: {"cu": a.idx([]), "lens": a.idx([])}),
    ("out-and-lse-share-bytes", ValueError, ["out", "lse"], _rows_share),
    ("lse-over-lens", ValueError, ["lse", "lens"], _lse_over_lens),
    ("out-over-cu", ValueError, ["out", "cu"], _out_over_cu),
    ("lse-read-only", ValueError, "lse", lambda a, r, f: {"lse": ReadOnly(r["lse"])}, NUMPY),
    ("out-read-only", ValueError, "out", lambda a, r, f: {"out": ReadOnly(r["out"])}, NUMPY),
    ("lse-requires-grad", ValueError, "lse", lambda a, r, f: {"lse": a.lse(ht=f.ht, out=True, requires_grad=True)},
     TORCH),
    ("out-requires-grad", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, D), requires_grad=True)}, TORCH),
    ("out-inference-tensor", ValueError, "out", lambda a, r, f: {"out": a.nan((T, H, D), inference=True)}, TORCH),
    ("lse-expanded", ValueError, "lse", lambda a, r, f: {"lse": _expanded_lse(a, r, f)}),
    ("out-expanded-over-tokens", ValueError, "out", lambda a, r, f: {"out": a.nan((1, H, D)).expand(T, H, D)}),
    ("out-head_dim-stride-2", ValueError, "out", lambda a, r, f: {"out": a.rand((T, H, 2 * D))[..., ::2]}),
])
cases([FIXUP, MASK, SGLANG_FIXUP, VLLM_MASK], [
    ("cu-a-list", TypeError, "cu", lambda a, r, f: {"cu": list(CU)}),
])
cases([FIXUP], [
    *_values("max_seqlen_q", TypeError, (1.5, "4", True)),
])
cases([SGLANG_FIXUP], [
    *_values("max_seq_len", TypeError, (1.5, None, "4")),
])
cases([VLLM_MASK], [
    ("lse-given-[T,H]", ValueError, "lse", lambda a, r, f: {"lse": a.rand((T, H))}, ALL,
     (f"({H}, {T})", f"got ({T}, {H})")),
    ("flat-output-and-lse-given-[T,H]", ValueError, "lse",
     lambda a, r, f: {"out": a.rand((T, H * D)), "lse": a.rand((T, H))}),
    ("flat-output-width-not-a-multiple-of-heads", ValueError, "out",
     lambda a, r, f: {"out": a.rand((T, H * D + 1))}),
    ("flat-output-head_dim-stride-2", ValueError, "out", lambda a, r, f: {"out": a.rand((T, 2 * H * D))[:, ::2]}),
    ("flat-output-requires-grad", ValueError, "out",
     lambda a, r, f: {"out": a.nan((T, H * D), requires_grad=True)}, TORCH),
])

cases([PLAN], [
    ("query_lens-uint64-2^63", ValueError, "query_lens",
     lambda a, r, f: {"query_lens": np.array([2**63, 1], np.uint64)}),
    ("context_lens-10^12", ValueError, "context_lens",
     lambda a, r, f: {"query_lens": [1], "context_lens": [10**12], "chunk_tokens": 1}),
    ("query_lens-float", TypeError, "query_lens", lambda a, r, f: {"query_lens": [1.0, 2.0]}),
    ("context_lens-bool", TypeError, "context_lens", lambda a, r, f: {"context_lens": [True, False]}),
    ("context_lens-2d", ValueError, "context_lens", lambda a, r, f: {"context_lens": [[3, 4]]}),
    ("query_lens-negative", ValueError, "query_lens", lambda a, r, f: {"query_lens": [1, -2]}),
    ("query_lens-total-past-int32", ValueError, "query_lens", lambda a, r, f: {"query_lens": [2**31 - 1, 1]}),
    ("batch-sizes-differ", ValueError, ["query_lens", "context_lens"], lambda a, r, f: {"context_lens": [3]}),
    ("query_lens-None", TypeError, "query_lens", lambda a, r, f: {"query_lens": None}),
    *_values("chunk_tokens", ValueError, (0, 2**64)),
    *_values("chunk_tokens", TypeError, (True, 2.5)),
    ("align-0", ValueError, "align", lambda a, r, f: {"align": 0}),
    ("align-float", TypeError, "align", lambda a, r, f: {"align": 4.0}),
], kinds=HOST)  # lengths live on the CPU: the GPU run has one case of its own
cases([PLAN], [
    ("query_lens-on-the-gpu", ValueError, "query_lens", lambda a, r, f: {"query_lens": a.idx([1, 2])}, CUDA),
])
# fmt: on


# --- the tests ---------------------------------------------------------------------------------

KINDS = ("torch", "numpy", "cuda")


def _params(items, kinds_of, id_of):
    return [
        pytest.param(item, k, id=f"{k}-{id_of(item)}", marks=[pytest.mark.gpu] if k == "cuda" else [])
        for item in items
        for k in KINDS
        if k in kinds_of(item)
    ]


def _names_word(msg: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", msg) is not None


@pytest.mark.parametrize("case, kind", _params(CASES, lambda c: c.kinds, lambda c: c.id))
def test_a_rejected_call_names_the_argument_and_writes_nothing(case: Case, kind: str):
    a = Arena(kind, zlib.crc32(case.id.encode()))
    fn, args, kwargs = case.build(a)
    args, kwargs = a.arg(args), a.arg(kwargs)
    a.freeze()
    with pytest.raises(case.exc) as info:
        fn(*args, **kwargs)
    a.assert_unchanged()
    msg = str(info.value)
    for name in case.names():
        assert _names_word(msg, name), f"the message does not name {name!r}: {msg}"
    for text in case.also:
        assert text in msg, f"the message lacks {text!r}: {msg}"


@pytest.mark.parametrize("family, kind", _params(FAMILIES, lambda f: f.kinds, lambda f: f.id))
def test_the_base_call_of_every_family_is_accepted(family: Family, kind: str):
    """Controls: without the mutation the call goes through, so each error is the mutation's."""
    a = Arena(kind, 1)
    r = family.base(a, family)
    r["arena"] = a
    if family is FI_IN_PLACE:
        r["mask"] = a.idx([True, False] * (T // 2), BOOL)
    fn, args, kwargs = family.call(r)
    fn(*a.arg(args), **a.arg(kwargs))


def test_there_are_enough_cases():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.family.id for c in CASES} == {f.id for f in FAMILIES}


# --- numpy through the adapters: the native path, not an AttributeError deep inside ------------


def test_numpy_through_the_adapters_matches_the_oracle():
    g = np.random.default_rng(7)
    v_a, v_b = (g.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
    s_a, s_b = (g.standard_normal((T, H)) * 4 for _ in range(2))  # float64: SGLang converts
    ref_v, ref_s = oracles.merge2(v_a, s_a.astype(np.float32), v_b, s_b.astype(np.float32))  # what both read
    v, s = sglang.merge_state_v2(v_a, s_a, v_b, s_b)
    assert isinstance(v, np.ndarray) and s.dtype == np.float32
    assert_close(v, ref_v, torch.float32)
    assert_close(s, ref_s, torch.float32)

    out = np.full((T, H, D), NAN, np.float32)
    out_lse = np.full((H, T), NAN, np.float32)
    vllm.merge_attn_states(out, v_a, s_a.T.astype(np.float32), v_b, s_b.T.astype(np.float32), out_lse)
    assert_close(out, ref_v, torch.float32)
    assert_close(out_lse.T, ref_s, torch.float32)

    v = g.standard_normal((T, N, H, D)).astype(np.float32)  # FlashInfer's [T, N, H, D], base 2
    s = (g.standard_normal((T, N, H)) * 4).astype(np.float32)
    V, S = flashinfer.merge_states(v, s)
    ref_v, ref_s = oracles.merge(v.swapaxes(0, 1), s.swapaxes(0, 1), base=2)
    assert_close(V, ref_v, torch.float32)
    assert_close(S, ref_s, torch.float32)

    flat = g.standard_normal((T, H * D)).astype(np.float32)  # vLLM's [T, H * D] output
    lse = g.standard_normal((H, T)).astype(np.float32)
    kept = flat.copy(), lse.copy()
    vllm.mask_empty_context(lse, flat, np.array(CU, np.int32), np.array(CU_KV, np.int64))
    rows = np.array([True, True, False, False, True, True])  # requests 0 and 2: empty context
    assert (flat[rows] == 0).all() and (lse[:, rows] == -np.inf).all()
    assert (flat[~rows] == kept[0][~rows]).all() and (lse[:, ~rows] == kept[1][:, ~rows]).all()
