"""``torch.ops.zerokv.*``: the ops registered with torch.library, for torch.compile and graphs.

Registered through ``torch.library.Library`` define/impl (the ``custom_op`` decorator adds tens
of µs per call), with the mutated arguments annotated in the schemas and fake implementations
so that torch.compile can trace them without running them::

    torch.ops.zerokv.merge_state(v_a, s_a, v_b, s_b)                    -> (out, out_lse)
    torch.ops.zerokv.merge_state_out(v_a, s_a, v_b, s_b, out, out_lse)  -> ()  (writes out, out_lse)
    torch.ops.zerokv.merge_states(v, s)                                 -> (out, out_lse)
    torch.ops.zerokv.merge_states_out(v, s, out, out_lse)               -> ()  (writes out, out_lse)
    torch.ops.zerokv.fixup_zero_kv_rows(out, lse, kv_lens, cu_seqlens_q)        -> ()  (in place)
    torch.ops.zerokv.mask_empty_context(out, lse, cu_seqlens_q, cu_seqlens_kv)  -> ()  (in place)

The merges take every option of :func:`zerokv.merge_state` / :func:`zerokv.merge_states` but
an engine adapter's, by their specs (:mod:`zerokv.core.op_schema`): ``sinks`` (float32 ``[H]``
attention-sink logits), ``a_cu_seqlens_q`` / ``a_kv_lens`` (both or neither:
the native ``a_empty`` pair), and in the ``_out`` forms fp8 outputs with ``out_scale`` or
per-group scales (``out_block_scale``, ``quant_group``, ``scale_format``). Importing
:mod:`zerokv` registers them when torch is installed.
"""

from __future__ import annotations

import torch

from . import merge as _merge
from .core import merge_plans as _merge_plans
from .core import merge_states_plan as _merge_states_plan
from .core import op_schema as _op_schema
from .core import spec as _spec
from .empty_rows import fixup_zero_kv_rows, mask_empty_context

_lib = torch.library.Library("zerokv", "DEF")

# merge_state's options, as merge_state (outputs allocated) and merge_state_out take them; the
# native a_empty pair is two arguments (both or neither)
_NAMES = _op_schema.several_names()  # the pair's halves by the schema's names, for messages
_FIXED = {"suffix_verbatim": False, "allocate_lse": None, "names": _NAMES, "lse_ht": None}
_OPTS = _op_schema.Options(_merge_plans.LAYOUT, False, _FIXED)
_OUT_OPTS = _op_schema.Options(_merge_plans.LAYOUT, True, _FIXED)
_lib.define(
    "merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, str lse_base='e', SymInt? prefix_rows=None"
    + _OPTS.schema
    + ") -> (Tensor, Tensor)"
)
_lib.define(
    "merge_state_out(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, Tensor(a!) out, Tensor(b!)? out_lse, "
    "str lse_base='e', SymInt? prefix_rows=None" + _OUT_OPTS.schema + ") -> ()"
)
_MS_OPTS = _op_schema.Keywords(_spec.MERGE_STATES, False)
_MS_OUT_OPTS = _op_schema.Keywords(_spec.MERGE_STATES, True)
_lib.define("merge_states(Tensor v, Tensor s, str lse_base='e'" + _MS_OPTS.schema + ") -> (Tensor, Tensor)")
_lib.define(
    "merge_states_out(Tensor v, Tensor s, Tensor(a!) out, Tensor(b!)? out_lse, str lse_base='e'"
    + _MS_OUT_OPTS.schema
    + ") -> ()"
)
_lib.define("fixup_zero_kv_rows(Tensor(a!) out, Tensor(b!) lse, Tensor kv_lens, Tensor cu_seqlens_q) -> ()")
_lib.define(
    "mask_empty_context(Tensor(a!) out, Tensor(b!) lse, Tensor cu_seqlens_q, Tensor cu_seqlens_kv) -> ()"
)


def _base(lse_base):
    """The schema's string base (``'e'`` or ``'2'``: a schema argument has one type) as the
    native API takes it (``"e"`` or the number 2)."""
    if lse_base == "2":
        return 2
    if lse_base == "e":
        return "e"
    raise ValueError(
        f"lse_base: expected 'e' or '2' (torch.ops.zerokv takes the base as a string), got {lse_base!r}"
    )


# torch passes the schema's arguments by position, those left at their defaults at the end
# omitted: the options come as a tuple, none in the common call
def _merge_state(v_a, s_a, v_b, s_b, lse_base="e", prefix_rows=None, *opts):
    base = _base(lse_base)
    if not opts:
        return _merge_plans.two(
            v_a, s_a, v_b, s_b, None, None, base, prefix_rows, None, None, None, None, False, None, _NAMES
        )
    return _merge_plans.two(v_a, s_a, v_b, s_b, None, None, base, prefix_rows, *_OPTS(opts))


def _merge_state_out(v_a, s_a, v_b, s_b, out, out_lse, lse_base="e", prefix_rows=None, *opts):
    base = _base(lse_base)
    if not opts:
        _merge_plans.two(
            v_a, s_a, v_b, s_b, out, out_lse, base, prefix_rows, None, None, None, None, False, None, _NAMES
        )
    else:
        _merge_plans.two(v_a, s_a, v_b, s_b, out, out_lse, base, prefix_rows, *_OUT_OPTS(opts))


def _merge_states(v, s, lse_base="e", *opts):
    if not opts:
        return _merge_states_plan.n((v, s, None, None, None, None), (_base(lse_base), True))
    return _merge.merge_states(v, s, lse_base=_base(lse_base), **_MS_OPTS(opts))


def _merge_states_out(v, s, out, out_lse, lse_base="e", *opts):
    _merge.merge_states(v, s, out=out, out_lse=out_lse, lse_base=_base(lse_base), **_MS_OUT_OPTS(opts))


for _key in ("CPU", "CUDA"):
    _lib.impl("merge_state", _merge_state, _key)
    _lib.impl("merge_state_out", _merge_state_out, _key)
    _lib.impl("merge_states", _merge_states, _key)
    _lib.impl("merge_states_out", _merge_states_out, _key)
    _lib.impl("fixup_zero_kv_rows", fixup_zero_kv_rows, _key)
    _lib.impl("mask_empty_context", mask_empty_context, _key)


@torch.library.register_fake("zerokv::merge_state", lib=_lib)
def _merge_state_fake(v_a, s_a, v_b, s_b, lse_base="e", prefix_rows=None, *opts):
    _OPTS(opts)  # an option given in part fails while tracing too
    return torch.empty_like(v_a, memory_format=torch.contiguous_format), s_a.new_empty(s_a.shape)


@torch.library.register_fake("zerokv::merge_states", lib=_lib)
def _merge_states_fake(v, s, lse_base="e", *opts):
    return v.new_empty(v.shape[1:]), s.new_empty(s.shape[1:])


@torch.library.register_fake("zerokv::merge_state_out", lib=_lib)
def _merge_state_out_fake(v_a, s_a, v_b, s_b, out, out_lse, lse_base="e", prefix_rows=None, *opts):
    _OUT_OPTS(opts)
    return None


@torch.library.register_fake("zerokv::merge_states_out", lib=_lib)
def _merge_states_out_fake(v, s, out, out_lse, lse_base="e", *opts):
    return None


@torch.library.register_fake("zerokv::fixup_zero_kv_rows", lib=_lib)
def _fixup_fake(out, lse, kv_lens, cu_seqlens_q):
    return None


@torch.library.register_fake("zerokv::mask_empty_context", lib=_lib)
def _mask_fake(out, lse, cu_seqlens_q, cu_seqlens_kv):
    return None


# --- torch's schema errors, with the zerokv function to call instead ------------------------------

# torch.ops.zerokv.<op> -> the native function that takes what the schema cannot
_NATIVE = {
    "merge_state": "zerokv.merge_state",
    "merge_state_out": "zerokv.merge_state(..., out=..., out_lse=...)",
    "merge_states": "zerokv.merge_states",
    "merge_states_out": "zerokv.merge_states(..., out=..., out_lse=...)",
    "fixup_zero_kv_rows": "zerokv.fixup_zero_kv_rows",
    "mask_empty_context": "zerokv.mask_empty_context",
}


class OpArgumentError(TypeError, RuntimeError):
    """An argument torch's schema of a ``torch.ops.zerokv`` op refuses; a ``TypeError`` that is
    still the ``RuntimeError`` torch raises, so that code catching either keeps working."""


def _explained(name: str, op):
    """``op`` (the packet's C++ entry) raising :class:`OpArgumentError` that names the zerokv
    function to call instead where torch's schema refuses an argument (numpy or CuPy arrays,
    lists, an int base); one Python frame more per call, nothing else."""
    native = _NATIVE[name]

    def call(*args, **kwargs):
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:
            text = str(e)
            if "Expected a value of type" not in text and "failed to match any schema" not in text:
                raise
            first = next((line for line in text.splitlines() if "Expected a value of type" in line), text)
            raise OpArgumentError(
                f"torch.ops.zerokv.{name}: {first.strip()} torch.ops.zerokv takes torch tensors, "
                f"Python ints and lse_base as the string 'e' or '2'; for numpy or CuPy arrays, "
                f"other DLPack producers or lse_base=2, call {native}"
            ) from e

    call.__name__ = call.__qualname__ = name
    call.__module__ = getattr(op, "__module__", __name__)
    return call


for _name in _NATIVE:
    _packet = getattr(torch.ops.zerokv, _name)
    _packet._op = _explained(_name, _packet._op)
