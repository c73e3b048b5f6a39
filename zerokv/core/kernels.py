"""Every kernel zerokv launches, described once.

A :class:`Kernel` names its source stem (``kernels_cu/<stem>.cu``), its ``__global__`` function,
its template instantiations, its block size and its parameters by name and C type. From that
description come the instantiation list (what the offline compile and ``precompile`` build),
the packing of the arguments (natural C alignment, in the kernel's own order) and the block
size, which reaches the kernel's ``__launch_bounds__`` as ``ZK_BLOCK_<name>`` (defined at the
top of the source handed to NVRTC). ``tests/test_kernels.py`` holds each description against
the C parameter list in ``kernels_cu/`` (or, for a kernel that takes one struct, its fields):
names, types and order.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

from . import dtypes as _dtypes
from . import layout as _layout
from . import spec as _spec
from .kernel_params import params as _params

# C type -> (struct code, bytes); the alignment of each is its size.
CTYPES = {"ptr": ("Q", 8), "i64": ("q", 8), "i32": ("i", 4), "u32": ("I", 4), "f32": ("f", 4)}


@dataclass(frozen=True)
class Kernel:
    stem: str  # kernels_cu/<stem>.cu
    name: str  # the __global__ function (a template)
    instances: tuple[tuple[str, ...], ...]  # template arguments of every instantiation
    block: int  # threads per block, also the kernel's __launch_bounds__
    params: tuple[tuple[str, str], ...]  # (name, C type) in the kernel's order
    code: str | None = None  # source text for kernels outside kernels_cu/ (bench baselines)

    def __post_init__(self) -> None:
        for n, c in self.params:
            if c not in CTYPES:
                raise ValueError(f"{self.name}: parameter {n} has unknown C type {c!r}")

    def expr(self, *targs: object) -> str:
        """The name expression of one instantiation, e.g. ``merge_state_kernel<float, float, 4>``."""
        return f"{self.name}<{', '.join(str(a) for a in targs)}>"

    @cached_property
    def expressions(self) -> list[str]:
        return [self.expr(*t) for t in self.instances]

    @cached_property
    def packer(self) -> struct.Struct:
        """``struct`` layout of the parameter buffer: each value at its natural C alignment."""
        fmt, offset = "<", 0
        for _, c in self.params:
            code, size = CTYPES[c]
            pad = -offset % size
            fmt += "x" * pad + code
            offset += pad + size
        return struct.Struct(fmt)

    def getter(self, *sources: type) -> Callable[..., list]:
        """``get(*records)``: every parameter's value in the kernel's order, each from the first
        record (of the classes ``sources``, with ``__slots__`` or NamedTuple fields) whose class
        holds that name. A name no class holds fails here, once."""
        where = []
        for name, _ in self.params:
            i = next((i for i, cls in enumerate(sources) if name in _slots(cls)), None)
            if i is None:
                raise TypeError(f"{self.name}: no record among {[c.__name__ for c in sources]} holds {name}")
            where.append((i, name))

        def get(*records: object) -> list:
            return [getattr(records[i], name) for i, name in where]

        return get

    @cached_property
    def names(self) -> tuple[str, ...]:
        """The parameters' names, in the kernel's order."""
        return tuple(n for n, _ in self.params)

    def check_names(self, given: object) -> None:
        """TypeError unless ``given`` names every parameter and nothing else."""
        want, got = set(self.names), set(given)
        if want != got:
            raise TypeError(f"{self.name}: missing {sorted(want - got)}, unknown {sorted(got - want)}")

    def pack(self, **values: float) -> bytes:
        """Pack by parameter name (slow, for tests and one-off launches); every name required."""
        self.check_names(values)
        return self.packer.pack(*(values[n] for n in self.names))


def _slots(cls: type) -> set[str]:
    """Attribute names of a record class: its ``__slots__`` (any base's too), or a NamedTuple's fields."""
    return {n for c in cls.__mro__ for n in (*getattr(c, "__slots__", ()), *getattr(c, "_fields", ()))}


def vec(dtype: str) -> int:
    """Elements of ``dtype`` per 16-byte access: the vector width of an aligned call."""
    return _layout.vec(_dtypes.itemsize(dtype))


@lru_cache(maxsize=256)
def fast_divisor(d: int) -> tuple[int, int]:
    """``(mul, shr)`` such that ``n // d == (n * mul >> 32) >> shr`` for every ``0 <= n < INT32``
    (the kernels' ``fast_div``); ``(0, 0)`` for ``d == 1``. ``mul = ceil(2**p / d)`` with
    ``p = 31 + ceil(log2 d)``: its error ``mul * d - 2**p < d`` stays below ``2**p / n``."""
    if not 1 <= d < _layout.INT32:
        raise ValueError(f"fast_divisor: d must be in [1, 2**31), got {d}")
    if d == 1:
        return 0, 0
    p = 31 + (d - 1).bit_length()
    return -(-(1 << p) // d), p - 32


_V = [(_dtypes.ctype(i), i) for i in _dtypes.V_IN]
_FP8_CTYPES = {_dtypes.ctype(n) for n in _dtypes.FP8}  # outputs that always take the full kernel
_O = [_dtypes.ctype(o) for o in _dtypes.V_OUT]

# PPT: packs of V per thread per round (1 or 2). FULL = 0: the common call compiled without the
# code of a_empty, row masks, sinks and the fp8 scale (an fp8 output always needs FULL = 1).
# The index type: int where every offset fits in 32 bits (lean kernels only), else long long.
MERGE_STATE = Kernel(
    stem="merge",
    name="merge_state_kernel",
    instances=tuple(
        (ci, co, v, ppt, full, index)
        for ci, i in _V
        for co in _O
        for v in (1, vec(i))
        for ppt in (1, 2)
        for full in ((1,) if co in _FP8_CTYPES else (0, 1))
        for index in (("long long",) if full else ("int", "long long"))
    ),
    block=128,
    params=_params(
        "ptr va, i64 va_st, i64 va_sh, ptr vb, i64 vb_st, i64 vb_sh, ptr out, i64 out_st, i64 out_sh,"
        " ptr sa, i64 sa_st, i64 sa_sh, ptr sb, i64 sb_st, i64 sb_sh, ptr olse, i64 ol_st, i64 ol_sh,"
        " i64 T, i64 H, i64 D, i64 lanes, i64 prefix_rows, i64 suffix_verbatim,"
        " @a_empty, i64 a_is64, @row_mask, @sinks, f32 k, f32 inv_k, @out_scale, @*",
        _spec.MERGE_STATE,
    ),
)

# Option features of the tuned merge forms (FEAT, their last template argument; kernels_cu/merge_rows.cuh):
# a bitmask, absent (0) for the plain call. Each feature comes alone on the forms of every size
# class, for inputs and output of one dtype (fp8 outputs: from each input dtype); calls with
# several options, or another pair of dtypes, take merge_state_kernel.
F_A_EMPTY, F_A64, F_SINKS, F_ROW_MASK, F_OUT_SCALE, F_GROUP_FP8 = 1, 2, 4, 8, 16, 32
# with F_A_EMPTY, the gathered form: blocks take runs of A_RUN_SPANS spans of packs and search
# their tokens once, before their loads; a row of an empty request does not load v_a
# (merge_flat.cuh's merge_flat_run; forms.py picks it)
F_A_RUN = 64
A_RUN_SPANS = 4  # merge_flat.cuh's A_RUN_SPANS
# a_empty's requests that a warp's window takes (merge_flat_rows.cuh's A_WINDOW); past them the
# one-pass form searches global memory, one round trip a level, and the runs a shared copy
# (forms.py)
A_WINDOW = 64
# with F_GROUP_FP8: log2 of the packs of one group in bits 7-9, so that the kernel's shuffles and
# scale index are compiled for the group's size (the g_shr parameter goes unused there)
F_GROUP_SHIFT = 7
SAME_DTYPE_FEATURES = (F_A_EMPTY, F_A_EMPTY | F_A64, F_SINKS, F_ROW_MASK)
RUN_FEATURES = (F_A_EMPTY | F_A_RUN, F_A_EMPTY | F_A64 | F_A_RUN)
_FP8 = _dtypes.ctype(_dtypes.FP8[0])


def group_feature(group: int, vec: int) -> int:
    """FEAT of per-group fp8 with groups of ``group`` values in packs of ``vec``."""
    packs = group // vec
    if group % vec or packs & (packs - 1) or not 1 <= packs <= 128:  # 3 bits: 1 to 128 packs
        raise ValueError(f"group_feature: no kernel takes groups of {group} values in packs of {vec}")
    return F_GROUP_FP8 | (packs.bit_length() - 1) << F_GROUP_SHIFT


def feature_pairs(ci: str, vec: int, runs: bool = False) -> list[tuple[str, int]]:
    """(output C type, FEAT) of every option feature instantiated for input C type ``ci`` in
    packs of ``vec`` (``runs``: with a_empty's F_A_RUN forms); per-group fp8 once per group."""
    same = SAME_DTYPE_FEATURES + (RUN_FEATURES if runs else ())
    groups = [group_feature(g, vec) for g in _spec.QUANT_GROUPS if g % vec == 0]
    return [(ci, f) for f in same] + [(_FP8, f) for f in (F_OUT_SCALE, *groups)]


# the options the flat family takes (their feature bits above), in the kernels' order
_FLAT_OPTIONS = "@a_empty, @row_mask, @sinks, @out_scale, @out_block_scale"

# The common call in its smallest form: one thread per pack, 32-bit parameters (kernels_cu/merge_flat.cuh).
# The flat kernels take their parameters as the fields of one struct (merge_rows.cuh's FlatArgs; the
# heads kernel's HeadsArgs): these descriptions are its fields by name, type and order, and the
# packing by natural alignment is the struct's layout.
MERGE_STATE_FLAT = Kernel(
    stem="merge",
    name="merge_state_flat_kernel",
    # plain: no fp8 output; SMALL: 1 for grids of one wave (merge.py picks); then the options
    instances=tuple(
        (ci, co, v, small) for ci, i in _V for co, _ in _V for v in (1, vec(i)) for small in (0, 1)
    )
    # with option features (FEAT, nonzero) no thread returns early: SMALL = 1 stands for both
    + tuple((ci, co, v, 1, f) for ci, i in _V for v in (1, vec(i)) for co, f in feature_pairs(ci, v)),
    block=128,
    params=_params(
        "ptr va, ptr vb, ptr sa, ptr sb, ptr out, ptr olse, i32 rows, i32 H, i32 packs,"
        " u32 packs_mul, i32 packs_shr, u32 H_mul, i32 H_shr,"
        " i32 sa_st, i32 sa_sh, i32 sb_st, i32 sb_sh, i32 va_st, i32 va_sh, i32 vb_st, i32 vb_sh,"
        " i32 out_st, i32 out_sh, i32 ol_st, i32 ol_sh, i32 prefix_rows, i32 suffix_verbatim,"
        " f32 k, f32 inv_k, " + _FLAT_OPTIONS,
        _spec.MERGE_STATE,
        "i32",
    ),
)


# The flat kernel's smallest calls (merge.py picks them by their packs): a block per group of
# heads of one token, grid (groups, T), no division (rows of a power-of-two number of packs);
# aligned calls only, 16-bit inputs also in 8-byte packs (VEC 4)
MERGE_STATE_HEADS = Kernel(
    stem="merge",
    name="merge_state_heads_kernel",
    instances=tuple(
        (ci, co, v)
        for ci, i in _V
        for co, _ in _V
        for v in (vec(i), *((vec(i) // 2,) if vec(i) == 8 else ()))
    )
    + tuple(
        (ci, co, v, f)
        for ci, i in _V
        for v in (vec(i), *((vec(i) // 2,) if i == "bfloat16" else ()))
        for co, f in feature_pairs(ci, v)
    ),
    block=128,
    params=tuple(
        (n, c) for n, c in MERGE_STATE_FLAT.params if n not in ("rows", "packs_mul", "H_mul", "H_shr")
    ),
)

# The many-waves form of the flat kernel (merge.py picks it by the call's threads): blocks of
# 512, the output LSE gathered through shared memory; aligned calls only (16-byte packs), every
# pair of element types; TILE (rows in tiles of 8 tokens) 1 for an out_lse laid [H, T].
MERGE_STATE_FLAT_GATHERED = Kernel(
    stem="merge",
    name="merge_state_flat_gathered_kernel",
    instances=tuple((ci, co, vec(i), tile) for ci, i in _V for co, _ in _V for tile in (0, 1))
    + tuple(
        (ci, co, vec(i), tile, f)
        for ci, i in _V
        for co, f in feature_pairs(ci, vec(i), runs=True)
        for tile in (0, 1)
        # a_empty in one pass: int32 offsets with the rows in token order only (else runs; forms.py)
        if not ((tile or f & F_A64) and f in SAME_DTYPE_FEATURES[:2])
    ),
    block=512,
    params=MERGE_STATE_FLAT.params,
)
# ... for tensors past 2^31 elements: 64-bit strides and offsets, the thread index still 32-bit;
# rows in the natural order for either layout
MERGE_STATE_FLAT64_GATHERED = Kernel(
    stem="merge",
    name="merge_state_flat64_gathered_kernel",
    instances=tuple((ci, co, vec(i)) for ci, i in _V for co, _ in _V)
    + tuple((ci, co, vec(i), f) for ci, i in _V for co, f in feature_pairs(ci, vec(i))),
    block=512,
    params=tuple((n, "i64" if n.endswith(("_st", "_sh", "_sg")) else c) for n, c in MERGE_STATE_FLAT.params),
)

MERGE_STATES = Kernel(
    stem="merge",
    name="merge_states_kernel",
    instances=tuple((ci, co, v) for ci, i in _V for co in _O for v in (1, vec(i))),
    block=128,
    params=_params(
        "ptr v, i64 v_sn, i64 v_st, i64 v_sh, ptr s, i64 s_sn, i64 s_st, i64 s_sh,"
        " ptr out, i64 out_st, i64 out_sh, ptr olse, i64 ol_st, i64 ol_sh,"
        " i64 N, i64 T, i64 H, i64 D, i64 lanes, @sinks, f32 k, f32 inv_k, @out_scale, @out_block_scale, @*",
        _spec.MERGE_STATES,
    ),
)

# The emptiness rule is the third template argument: 0 = kv_lens[i] == 0 (fixup),
# 1 = cu_kv[i + 1] == cu_kv[i] (mask).
RULE_KV_LENS_ZERO, RULE_CONTEXT_SPAN_EMPTY = 0, 1

EMPTY_ROWS = Kernel(
    stem="empty_rows",
    name="empty_rows_kernel",
    # lens64: the width of the scanned offsets (kv_lens / cu_seqlens_kv), int32 or int64
    instances=tuple(
        (ci, v, rule, lens64)
        for ci, i in _V
        for v in (1, vec(i))
        for rule in (RULE_KV_LENS_ZERO, RULE_CONTEXT_SPAN_EMPTY)
        for lens64 in (0, 1)
    ),
    block=256,
    params=_params(
        "ptr out, i64 out_st, i64 out_sh, ptr lse, i64 lse_st, i64 lse_sh,"
        " ptr cu_q, i64 q_is64, ptr lens, i64 batch, i64 T, i64 H, i64 D, i64 flat"
    ),
)

# Context-parallel combine (kernels_cu/cp_merge.cu): the LSE into the all-gather buffer (template:
# 1 = with vLLM's empty-shard mask), the global LSE with this rank's rescaled V in the collective's
# layout (input dtype, wire dtype, vector width), and the reduced sum to the output.
CP_PACK_LSE = Kernel(
    stem="cp_merge",
    name="cp_pack_lse_kernel",
    instances=((0,), (1,)),
    block=256,
    params=_params(
        "ptr s, i64 s_st, i64 s_sh, ptr dst, i64 T, i64 H,"
        " ptr seq_lens, i64 sl_is64, ptr qsl, i64 q_is64, i64 batch"
    ),
)

CP_COMBINE = Kernel(
    stem="cp_merge",
    name="cp_combine_kernel",
    instances=tuple((ci, _dtypes.ctype(w), v) for ci, i in _V for w in _dtypes.V_IN for v in (1, vec(i))),
    block=128,
    params=_params(
        "ptr v, i64 v_st, i64 v_sh, ptr lses, i64 l_sn, ptr wire, ptr olse, i64 ol_st, i64 ol_sh,"
        " ptr sinks, i64 N, i64 rank, i64 T, i64 H, i64 D, i64 Hn, i64 lse_h0, i64 lse_hn,"
        " i64 lanes, i64 tile_rows, i64 nan_empty, f32 k, f32 inv_k"
    ),
)


def cp_finalize_vec(wire: str, out: str) -> int:
    """Elements per step of the finalize kernel: 16 bytes of the narrower of the two dtypes."""
    return _layout.vec(min(_dtypes.itemsize(wire), _dtypes.itemsize(out)))


CP_FINALIZE = Kernel(
    stem="cp_merge",
    name="cp_finalize_kernel",
    instances=tuple(
        (cw, _dtypes.ctype(o), v) for cw, w in _V for o in _dtypes.V_OUT for v in (1, cp_finalize_vec(w, o))
    ),
    block=256,
    params=_params("ptr src, ptr out, i64 o_st, i64 o_sh, i64 T, i64 Hn, i64 D, i64 lanes, ptr out_scale"),
)

# The all-to-all combine's pack (kernels_cu/cp_merge.cu): this rank's V and LSE into one chunk per
# peer (input dtype, wire dtype, vector width of the input, 1 = with the empty-shard mask). The
# merge of the received chunks is merge_states' kernel.
CP_A2A_PACK = Kernel(
    stem="cp_merge",
    name="cp_a2a_pack_kernel",
    instances=tuple(
        (ci, _dtypes.ctype(w), v, m)
        for ci, i in _V
        for w in _dtypes.V_IN
        for v in (1, vec(i))
        for m in (0, 1)
    ),
    block=256,
    params=_params(
        "ptr v, i64 v_st, i64 v_sh, ptr s, i64 s_st, i64 s_sh, ptr send, i64 chunk, i64 lse_off,"
        " i64 T, i64 H, i64 Hn, i64 D, i64 lanes_log2, i64 nan_empty,"
        " ptr seq_lens, i64 sl_is64, ptr qsl, i64 q_is64, i64 batch"
    ),
)

KERNELS: tuple[Kernel, ...] = (
    MERGE_STATE,
    MERGE_STATE_FLAT,
    MERGE_STATE_HEADS,
    MERGE_STATE_FLAT_GATHERED,
    MERGE_STATE_FLAT64_GATHERED,
    MERGE_STATES,
    EMPTY_ROWS,
    CP_PACK_LSE,
    CP_COMBINE,
    CP_FINALIZE,
    CP_A2A_PACK,
)


def instantiations() -> dict[str, list[str]]:
    """stem -> every name expression of that stem's kernels, in description order."""
    out: dict[str, list[str]] = {}
    for k in KERNELS:
        out.setdefault(k.stem, []).extend(k.expressions)
    return out


def block_defines(stem: str, kernels: tuple[Kernel, ...] | None = None) -> str:
    """``#define ZK_BLOCK_<name> <threads>`` for the kernels of ``stem`` (top of its source)."""
    ks = KERNELS if kernels is None else kernels
    return "".join(f"#define ZK_BLOCK_{k.name} {k.block}\n" for k in ks if k.stem == stem)
