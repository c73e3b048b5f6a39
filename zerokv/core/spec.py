"""Each op's call, declared once: its tensor arguments and its options.

An :class:`Arg` names a tensor argument (the caller's name), its shape in symbols (``T``,
``H``, ``D``, ``N``, ``B`` for requests; ``+1`` after a symbol: one more; ``H*D/quant_group``:
a product of symbols divided by a scalar argument), the dtypes it takes, whether it is an output
and what it may alias exactly, and the names its pointer and strides have among the kernels'
parameters. A :class:`Scalar` is a non-tensor argument: the values it takes, or an int range.
An :class:`Option` is a row: its arguments and scalars, the kernel feature it turns on, the
kernel parameters it fills (0 when the option is not given), and its rules with the other
options. The full validation (:mod:`zerokv.core.validation`) and the bound call of a signature
(:mod:`zerokv.core.binding`) are derived from these rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from . import dtypes as _dtypes

QUANT_GROUPS = (16, 32, 64, 128)  # values of one group of per-group fp8


@dataclass(frozen=True)
class Arg:
    name: str  # the caller's name
    shape: tuple[str, ...]  # symbols; "B+1": one more than B
    dtypes: tuple[str, ...]
    params: tuple[str, ...]  # kernel parameter names: the pointer, then a stride per outer dim
    output: bool = False
    alias: tuple[str, ...] = ()  # arguments it may alias exactly (same pointer and strides)
    lse: bool = False  # an LSE: may be laid [H, T] (read as the transpose)
    unit_inner: bool = False  # the last dim has unit stride (unless it has size 1); index dtypes: always
    vector: bool = False  # takes part in the signature's 16-byte vector alignment
    any_shape: bool = False  # any shape of one element (a scalar tensor)
    same_dtype: str = ""  # the argument whose dtype this one must have
    optional: bool = False  # may be None (an option's arguments always may)

    def __post_init__(self) -> None:
        # offsets and lengths are contiguous by their dtype class (validation._offsets): the
        # bound call reads the rule here, so no row of index dtypes can leave it out
        if self.dtypes == _dtypes.INDEX_NAMES:
            object.__setattr__(self, "unit_inner", True)


@dataclass(frozen=True)
class Scalar:
    """A non-tensor argument: one of ``values`` (a string matches a string, a number a number
    of any type but bool: one equal to it, as a later call's key finds its bound call), said as
    ``says`` in messages (by default the values), and dividing symbol ``divides``; or, with
    ``upto``, None or an int (Python or numpy) in ``[0, upto]``. ``exact_int``: the value is
    the int of ``values`` it equals (else its string). ``required``: an option's scalar given
    exactly with the option."""

    name: str
    values: tuple = ()
    says: str = ""
    exact_int: bool = False
    divides: str = ""
    upto: str = ""
    required: bool = False

    @property
    def default(self) -> Any:
        """Its value when a call leaves it out: its first value, None if required."""
        return self.values[0] if self.values and not self.required else None


@dataclass(frozen=True)
class Option:
    name: str  # the public keyword
    args: tuple[Arg, ...]
    feature: str  # the kernel feature it turns on ("" for none)
    params: tuple[str, ...]  # kernel parameters that are 0 without it
    scalars: tuple[Scalar, ...] = ()  # its scalar arguments
    derived: tuple[str, ...] = ()  # kernel parameters its plan computes from its scalars and form
    fp8_scale: bool = False  # scales an fp8 output: such an output takes exactly one of these
    excludes: tuple[str, ...] = ()  # options it does not combine with
    no_alias: tuple[str, ...] = ()  # outputs that may alias no input when it is given
    says: str = ""  # what it is, for messages
    generic: bool = True  # the generic kernel of its op takes it (the last row of the forms)
    adapter: bool = False  # an engine adapter's option: no public keyword, not in torch.ops' schemas
    schema_names: tuple[str, ...] = ()  # its arguments' names in torch.ops' schemas (default: theirs)


@dataclass(frozen=True)
class OpSpec:
    name: str
    args: tuple[Arg, ...]
    options: tuple[Option, ...] = ()
    scalars: tuple[Scalar, ...] = ()
    limits: tuple[str, ...] = ("T",)  # symbols below 2^31
    at_least_one: tuple[tuple[str, str], ...] = ()  # (symbol, what one is): a size of at least 1
    sym_params: tuple[tuple[str, str], ...] = ()  # (kernel parameter, symbol): a size as a parameter
    derived: tuple[str, ...] = ()  # kernel parameters the op's plan computes

    def all_args(self) -> tuple[Arg, ...]:
        return self.args + tuple(a for o in self.options for a in o.args)

    def once(self, what: str, build: Callable[[OpSpec], Any]) -> Any:
        """``build(self)``, made on the first request and kept on this spec under ``what`` (a
        frozen dataclass hashes every row, too slow for a per-call cache key)."""
        got = self.__dict__.get(what)
        if got is None:
            got = build(self)
            object.__setattr__(self, what, got)
        return got


V_IN, V_OUT, LSE = _dtypes.V_IN, _dtypes.V_OUT, _dtypes.LSE
INDEX, MASK = _dtypes.INDEX_NAMES, _dtypes.MASK_NAMES

_STATE = ("T", "H", "D")
_A_EMPTY = Option(
    "a_empty",
    (
        Arg("cu_seqlens_q", ("B+1",), INDEX, ("a_cu",)),
        Arg("kv_lens", ("B",), INDEX, ("a_lens",), same_dtype="cu_seqlens_q"),
    ),
    "a_empty",
    ("a_cu", "a_lens", "a_batch"),
    schema_names=("a_cu_seqlens_q", "a_kv_lens"),
)
_OUT_SCALE = Option(
    "out_scale", (Arg("out_scale", ("1",), LSE, ("out_scale",), any_shape=True),), "out_scale", ("out_scale",),
    fp8_scale=True,
)  # fmt: skip
_SINKS = Option("sinks", (Arg("sinks", ("H",), LSE, ("sinks",), unit_inner=True),), "sinks", ("sinks",))
_BLOCK_SCALE = Option(
    "out_block_scale",
    (Arg("out_block_scale", ("T", "H*D/quant_group"), LSE, ("bscale", "bs_st", "bs_sg"), output=True),),
    "group_fp8",
    ("bscale", "bs_st", "bs_sg"),
    (
        Scalar(
            "quant_group",
            QUANT_GROUPS,
            "a power of two from 16 to 128",
            exact_int=True,
            divides="D",
            required=True,
        ),
        Scalar("scale_format", ("float32", "ue8m0")),
    ),  # fmt: skip
    ("g_shr", "ue8m0"),
    fp8_scale=True,
    says="per-group fp8 output",
)
_LSE_BASE = Scalar("lse_base", ("e", 2))

# the merges' outputs, optional (allocated when None)
_OUT = Arg("out", _STATE, V_OUT, ("out", "out_st", "out_sh"), output=True, unit_inner=True, vector=True,
           optional=True)  # fmt: skip
_OUT_LSE = Arg("out_lse", ("T", "H"), LSE, ("olse", "ol_st", "ol_sh"), output=True, optional=True)

MERGE_STATE = OpSpec(
    "merge_state",
    (
        Arg("v_a", _STATE, V_IN, ("va", "va_st", "va_sh"), unit_inner=True, vector=True),
        Arg("s_a", ("T", "H"), LSE, ("sa", "sa_st", "sa_sh"), lse=True),
        Arg("v_b", _STATE, V_IN, ("vb", "vb_st", "vb_sh"), unit_inner=True, vector=True, same_dtype="v_a"),
        Arg("s_b", ("T", "H"), LSE, ("sb", "sb_st", "sb_sh"), lse=True),
        replace(_OUT, alias=("v_a", "v_b")),
        replace(_OUT_LSE, alias=("s_a", "s_b"), lse=True),
    ),
    (
        _A_EMPTY,
        Option(
            "row_mask",
            (Arg("row_mask", ("T",), MASK, ("row_mask",), unit_inner=True),),
            "row_mask",
            ("row_mask",),
            adapter=True,
        ),  # fmt: skip
        _OUT_SCALE,
        _SINKS,
        replace(
            _BLOCK_SCALE, excludes=("a_empty", "row_mask", "sinks"), no_alias=("out_lse",), generic=False
        ),
    ),
    (_LSE_BASE, Scalar("prefix_rows", upto="T")),
    ("T", "H"),
    sym_params=(("a_batch", "B"),),
    derived=("rows", "prefix_rows"),
)

MERGE_STATES = OpSpec(
    "merge_states",
    (
        Arg("v", ("N",) + _STATE, V_IN, ("v", "v_sn", "v_st", "v_sh"), unit_inner=True, vector=True),
        Arg("s", ("N", "T", "H"), LSE, ("s", "s_sn", "s_st", "s_sh")),
        _OUT,
        _OUT_LSE,
    ),
    (_OUT_SCALE, _SINKS, _BLOCK_SCALE),
    (_LSE_BASE,),
    ("N", "T", "H"),
    (("N", "state"),),
)

_ROWS = (
    Arg("out", _STATE, V_IN, ("out", "out_st", "out_sh"), output=True, unit_inner=True, vector=True),
    Arg("lse", ("T", "H"), LSE, ("lse", "lse_st", "lse_sh"), output=True),
    Arg("cu_seqlens_q", ("B+1",), INDEX, ("cu_q",)),
)
_ROWS_PARAMS = {"sym_params": (("batch", "B"),), "derived": ("flat",)}  # flat: out is [T, H * D] compact
FIXUP_ZERO_KV_ROWS = OpSpec(
    "fixup_zero_kv_rows", _ROWS + (Arg("kv_lens", ("B",), INDEX, ("lens",)),), **_ROWS_PARAMS
)
MASK_EMPTY_CONTEXT = OpSpec(
    "mask_empty_context",
    _ROWS + (Arg("cu_seqlens_kv", ("B+1",), INDEX, ("lens",)),),
    **_ROWS_PARAMS,
)

CP_MERGE = OpSpec(  # cp_merge's local part; with a send buffer, v and s are its views (not given here)
    "cp_merge",
    (
        Arg("v", _STATE, V_IN, (), unit_inner=True, optional=True),
        Arg("s", ("T", "H"), LSE, (), optional=True),
        Arg("out", ("T", "H/ranks", "D"), V_OUT, (), output=True, unit_inner=True, optional=True),
        Arg("out_lse", ("T", "H/ranks"), LSE, (), output=True, optional=True),
    ),
    (
        _SINKS,
        _OUT_SCALE,
        Option(
            "empty_shards",
            (
                Arg("seq_lens", ("B",), INDEX, ()),
                Arg("query_start_loc", ("B+1",), INDEX, ()),
            ),
            "",
            (),
        ),
    ),
    (
        _LSE_BASE,
        Scalar("exchange", ("allgather", "a2a")),
        Scalar("scatter", ("heads", "none")),
        Scalar("ranks"),  # the ranks the heads are scattered over (1: none), as the op counts them
    ),
    ("T", "H"),
)
