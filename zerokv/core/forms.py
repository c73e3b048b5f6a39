"""Which kernel form runs a call: pure functions of the call's facts and the device's
properties, their thresholds in one table.

A merge form family is a row of ``MERGE_FORMS``: its rule (the call's facts -> a ``Form``:
kernel description, template arguments, grid, geometry; or None) and the options (features) its
code takes. ``merge_two`` walks
the rows in order and takes the first whose features cover the call's and whose rule gives a
form; the "rows" row (merge_state_kernel) takes every feature and layout, so it ends the walk.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from typing import Any, NamedTuple

from . import dtypes as _dtypes
from . import kernels as _kernels
from . import spec as _spec
from .layout import INT32

# Every threshold of form selection, each measured on an H200 (bench/NOTES.md keeps the runs).
THRESHOLDS = {
    # one thread per pack from here on: the 512-thread form that gathers the output LSE
    "gathered_threads": 1 << 19,
    # up to this many packs, with rows of a power of two of at most a block of packs: blocks
    # of heads of one token
    "heads_packs": 2048,
    # grids of at most this many blocks per SM (one wave of 128-thread blocks): SMALL = 1
    "small_blocks_per_sm": 16,
    # the row-group kernel: two packs per thread for batches of a tenth to six tenths of L2
    "rows_mid_l2": (1, 10, 6, 10),
    # merge_states: two packs per lane from this many elements per SM
    "n_two_packs_per_sm": 1 << 16,
    # the empty-row ops' persistent grid
    "empty_rows_blocks_per_sm": 1,
    # a_empty on the gathered form in runs of spans (F_A_RUN) from this many spans of 512 packs
    # per SM (8 waves of 4 blocks; T = 1056 at H = 128, D = 128 bf16; an LSE laid [H, T]: on
    # every grid), the grid's last `a_empty_run_tail_per_sm` blocks per SM (two waves) one span
    # each
    "a_empty_runs_spans_per_sm": 32,
    "a_empty_run_tail_per_sm": 8,
}
ROW_GROUP_MAX = 128  # lanes of a row group at most: one block (kernels_cu/merge.cu)


class Device(NamedTuple):
    """The device properties form selection reads."""

    sms: int
    l2: int


class Form(NamedTuple):
    """One launch's kernel, template arguments, grid and the geometry values its parameters
    take by name (``kernels.Kernel.getter`` reads them from here)."""

    kernel: _kernels.Kernel
    targs: tuple
    grid: int
    grid_y: int = 1
    packs: int = 0
    packs_mul: int = 0
    packs_shr: int = 0
    H_mul: int = 0  # noqa: N815 - the kernel's parameter name
    H_shr: int = 0  # noqa: N815
    lanes: int = 0
    g_shr: int = 0  # per-group fp8: log2 of the packs of one group
    per_token: int = 0  # threads per token: grid = ceil(T per_token / block); 0: grid_y = T
    run_tail: int = 0  # F_A_RUN: blocks of one span at the grid's end (the others take A_RUN_SPANS)
    cap: int = 0  # per_token forms: at most this many blocks (0: no cap)


def launch_grid(form: Form, T: int) -> tuple[int, int]:
    """``(grid, grid_y)`` of ``form`` for ``T`` tokens (a form serves every T of its interval
    of ``t_breaks``)."""
    pt = form.per_token
    if not pt:
        return form.grid, T
    spans = -(-T * pt // form.kernel.block)
    if form.cap:
        return min(spans, form.cap), 1
    if form.run_tail:  # the first blocks take A_RUN_SPANS spans each (merge_flat.cuh's merge_flat_run)
        spans -= max(0, (spans - form.run_tail) // _kernels.A_RUN_SPANS) * (_kernels.A_RUN_SPANS - 1)
    return spans, 1


@lru_cache(maxsize=1024)  # shared by the plans of every signature of one shape
def t_breaks(H: int, D: int, vec: int, in_size: int, out_size: int, dev: Device) -> tuple[int, ...]:
    """The token counts around which a rule of this module may decide differently for calls of
    (H, D, vector width, element sizes) on ``dev``: every rule compares a quantity linear in T
    (``T * u``) with a limit ``X``, and ``X // u`` and ``X // u + 1`` bracket where it flips. Between
    two breaks every rule decides the same, so the form found for one T of an interval serves
    all of it (``t_class`` numbers the intervals; its grid from ``launch_grid``)."""
    per_t = H * max(D // vec, 1)  # threads (packs) per token
    a, b, x, y = THRESHOLDS["rows_mid_l2"]
    row_bytes = H * D * (2 * in_size + out_size)
    limits = [
        (THRESHOLDS["gathered_threads"], per_t),
        (THRESHOLDS["a_empty_runs_spans_per_sm"] * dev.sms * _kernels.MERGE_STATE_FLAT_GATHERED.block, per_t),
        (THRESHOLDS["heads_packs"], per_t),
        (THRESHOLDS["small_blocks_per_sm"] * dev.sms * _kernels.MERGE_STATE_FLAT.block, per_t),
        (THRESHOLDS["n_two_packs_per_sm"] * dev.sms, per_t),
        (INT32, per_t),
        (dev.l2 * a // b, row_bytes),
        (dev.l2 * x // y, row_bytes),
        *((INT32, H * (1 << i)) for i in range(ROW_GROUP_MAX.bit_length())),  # T * H * lanes
    ]
    return tuple(sorted({q + d for X, u in limits if u > 0 for q in (X // u,) for d in (0, 1)}))


def t_class(breaks: tuple[int, ...], T: int) -> int:
    """The interval of ``t_breaks`` that holds ``T``."""
    return bisect_right(breaks, T)


class MergeCall(NamedTuple):
    """The facts of a two-way merge that choose its form (cached by the plans on these)."""

    T: int
    H: int
    D: int
    vec: int  # elements per pack: the signature's vector width, 1 when not aligned
    in_dtype: str
    out_dtype: str
    features: frozenset  # options given: "a_empty", "row_mask", "sinks", "out_scale"
    inplace_lse: bool  # out_lse is s_a or s_b: a row's lanes share one warp
    fits32: bool  # every tensor's span, in elements, and T * H * D below 2^31
    strides32: bool  # every stride fits a 32-bit parameter
    lse_tiles: bool  # the LSE written (else the first read) has unit stride along tokens only
    a64: bool = False  # a_empty's offsets are int64
    quant_group: int = 0  # per-group fp8: values of one group (a power of two, 16-128)
    a_many: bool = False  # a_empty with more requests than a warp's window takes (kernels.A_WINDOW)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def flat_family(c: MergeCall, dev: Device, ctypes: tuple, flags: tuple = ()) -> Form | None:
    """The flat kernel's forms (flat, heads, gathered, 64-bit gathered), or None where none
    applies: an LSE written in place, D = 0, or a size that needs the row-group kernel.
    ``flags``: template arguments after each form's own (the options' code, by feature)."""
    if c.inplace_lse or not c.D:
        return None
    packs = c.D // c.vec
    threads = c.T * c.H * packs
    extra = (threads, packs)
    if not c.fits32 or (not c.strides32 and "group_fp8" in c.features):  # per-group fp8: its 64-bit form
        if threads >= INT32 or c.vec == 1:
            return None
        k = _kernels.MERGE_STATE_FLAT64_GATHERED
        return _flat_form(k, (*ctypes, c.vec, *flags), extra, c.H)
    if not c.strides32:
        return None
    if threads >= THRESHOLDS["gathered_threads"] and c.vec > 1:
        k = _kernels.MERGE_STATE_FLAT_GATHERED
        return _flat_form(k, (*ctypes, c.vec, int(c.lse_tiles), *flags), extra, c.H)
    if threads <= THRESHOLDS["heads_packs"] and c.vec > 1:
        heads = _heads(c, ctypes, flags)
        if heads is not None:
            return heads
    small = int(threads <= THRESHOLDS["small_blocks_per_sm"] * dev.sms * _kernels.MERGE_STATE_FLAT.block)
    return _flat_form(_kernels.MERGE_STATE_FLAT, (*ctypes, c.vec, small, *flags), extra, c.H)


def _flat_form(k: _kernels.Kernel, targs: tuple, extra: tuple, H: int) -> Form:
    threads, packs = extra
    pm, ps = _kernels.fast_divisor(packs)
    hm, hs = _kernels.fast_divisor(H)
    return Form(k, targs, _ceil(threads, k.block), 1, packs, pm, ps, hm, hs, per_token=H * packs)


def _heads(c: MergeCall, ctypes: tuple, flags: tuple) -> Form | None:
    """Blocks of heads of one token: rows of a power of two of at most a block of packs;
    bf16 in packs of 8 bytes unless a row would pass a block of them."""
    k = _kernels.MERGE_STATE_HEADS
    vec = max(c.vec // 2, 1) if c.in_dtype == "bfloat16" else c.vec
    if c.D // vec > k.block:
        vec = c.vec
    packs = c.D // vec
    if packs > k.block or packs & (packs - 1):
        return None
    return Form(
        k,
        (*ctypes, vec, *flags),
        _ceil(c.H * packs, k.block),
        c.T,
        packs=packs,
        packs_shr=packs.bit_length() - 1,
    )


def _rows(c: MergeCall, dev: Device, ctypes: tuple) -> Form:
    """merge_state_kernel: a row's packs over ``lanes`` threads, ``ppt`` packs each; the lean
    code (``full`` 0) without options (``full`` takes every one), 32-bit indices where every
    offset fits."""
    packs = c.D // c.vec
    nbytes = c.T * c.H * c.D * (2 * _dtypes.itemsize(c.in_dtype) + _dtypes.itemsize(c.out_dtype))
    a, b, x, y = THRESHOLDS["rows_mid_l2"]
    mid = dev.l2 * a // b <= nbytes <= dev.l2 * x // y
    lanes, ppt = row_geometry(packs, mid, c.inplace_lse)
    full = int(bool(c.features) or c.out_dtype in _dtypes.FP8)
    narrow = not full and c.fits32 and c.T * c.H * lanes < INT32
    targs = (*ctypes, c.vec, ppt, full, "int" if narrow else "long long")
    k = _kernels.MERGE_STATE
    return Form(k, targs, _ceil(c.T * c.H * lanes, k.block), lanes=lanes, per_token=c.H * lanes)


def row_geometry(packs: int, mid: bool, inplace_lse: bool) -> tuple[int, int]:
    """``(lanes, packs per thread)`` of merge_state's row groups: one pack per thread over
    ``lanes`` threads, except: batches that stay in L2 (``mid``) two packs per thread; a row
    of more than 32 packs whose LSE is written in place keeps its lanes in one warp (two
    packs each); a row wider than one block, two per round."""
    lanes = _pow2_at_least(packs)
    if packs > 32:
        if inplace_lse:
            return 32, 2
        return min(lanes, ROW_GROUP_MAX), 1 if packs <= ROW_GROUP_MAX else 2
    if mid and packs >= 4:
        return lanes // 2, 2
    return lanes, 1


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# An option on the flat family: its feature bit (kernels_cu/merge_rows.cuh, FEAT); the options with an
# fp8 output, and those whose kernels exist for inputs and output of one dtype.
_FEATURE_BITS = {
    "a_empty": _kernels.F_A_EMPTY,
    "sinks": _kernels.F_SINKS,
    "row_mask": _kernels.F_ROW_MASK,
    "out_scale": _kernels.F_OUT_SCALE,
    "group_fp8": _kernels.F_GROUP_FP8,
}
_FP8_FEATURES = frozenset({"out_scale", "group_fp8"})


def flat_options(c: MergeCall, dev: Device, ctypes: tuple) -> Form | None:
    """The flat family with one option compiled in (FEAT): every size class, both index
    widths, both LSE layouts. Inputs and output of one dtype (an fp8 output for out_scale and
    per-group fp8); None otherwise (several options: the row-group kernel)."""
    if len(c.features) != 1:
        return None
    (name,) = c.features
    fp8 = name in _FP8_FEATURES
    if fp8 != (c.out_dtype in _dtypes.FP8) or (not fp8 and c.in_dtype != c.out_dtype):
        return None
    feat = _FEATURE_BITS[name] | (_kernels.F_A64 if name == "a_empty" and c.a64 else 0)
    form = flat_family(c, dev, ctypes, (feat,))
    if form is None:
        return None
    if form.kernel is _kernels.MERGE_STATE_FLAT:  # with options, SMALL = 1 stands for both
        form = form._replace(targs=(*form.targs[:3], 1, feat))
    if name == "a_empty" and form.kernel is _kernels.MERGE_STATE_FLAT_GATHERED:
        form = _a_empty_runs(c, dev, form, feat)
    if name == "group_fp8":  # the group's size in FEAT, in packs of the form's width (targs[2])
        group = _kernels.group_feature(c.quant_group, form.targs[2])
        form = form._replace(targs=(*form.targs[:-1], group), g_shr=group >> _kernels.F_GROUP_SHIFT & 7)
    return form


def _a_empty_runs(c: MergeCall, dev: Device, form: Form, feat: int) -> Form:
    """The gathered a_empty form in runs of spans (F_A_RUN): a row of an empty request skips its
    v_a load there. Taken on every grid with an LSE laid [H, T] (the one-pass form's tiles are
    slower there), with int64 offsets (the one-pass form spills its loads in flight) and past
    the window's requests (the one-pass form searches global memory); [T, H] with int32 offsets
    and at most A_WINDOW requests on grids of many waves; ``form`` below."""
    block = _kernels.MERGE_STATE_FLAT_GATHERED.block
    few = c.T * c.H * (c.D // c.vec) < THRESHOLDS["a_empty_runs_spans_per_sm"] * dev.sms * block
    if few and not c.lse_tiles and not feat & _kernels.F_A64 and not c.a_many:
        return form
    form = form._replace(
        targs=(*form.targs[:-1], feat | _kernels.F_A_RUN),
        run_tail=THRESHOLDS["a_empty_run_tail_per_sm"] * dev.sms,
    )
    return form._replace(grid=launch_grid(form, c.T)[0])


class MergeForm(NamedTuple):
    """A row of the merge form table: the form's rule, and the options its kernels take."""

    name: str
    rule: Any  # (MergeCall, Device, ctypes) -> Form | None
    features: frozenset


MERGE_FORMS: tuple[MergeForm, ...] = (
    MergeForm("flat", flat_family, frozenset()),
    MergeForm("flat, one option", flat_options, frozenset(_FEATURE_BITS)),
    # merge_state_kernel: every option of the spec that its generic kernel takes
    MergeForm("rows", _rows, frozenset(o.feature for o in _spec.MERGE_STATE.options if o.generic)),
)


def merge_two(c: MergeCall, dev: Device, ctypes: tuple) -> Form:
    """The form of a two-way merge (``ctypes``: the C element types, input and output)."""
    for row in MERGE_FORMS:
        if c.features <= row.features:
            form = row.rule(c, dev, ctypes)
            if form is not None:
                return form
    if "group_fp8" in c.features:  # the row-group kernel has no per-group fp8
        raise ValueError(
            "out_block_scale: no kernel form takes this call (per-group fp8 output with other options,"
            " or unaligned tensors past 2^31 elements)"
        )
    raise AssertionError("MERGE_FORMS: the last row takes every call")  # pragma: no cover


def merge_states_lanes(packs: int, rows: int, dev: Device) -> int:
    """Threads per row of merge_states: as merge_state's, two packs per lane for large batches."""
    lanes = min(32, _pow2_at_least(packs))
    if lanes > 1 and rows * packs >= THRESHOLDS["n_two_packs_per_sm"] * dev.sms:
        lanes //= 2
    return lanes


def merge_states(N: int, T: int, H: int, D: int, vec: int, dev: Device, targs: tuple, group: int = 0) -> Form:
    """merge_states_kernel's launch (N = 2 without options takes ``merge_two``'s forms).
    ``group``: per-group fp8, its values a group; a row group holds at least a group's packs
    (at most a warp of them: ValueError past it, unaligned calls with groups over 32 values)."""
    lanes = merge_states_lanes(D // vec, T * H, dev)
    g_shr = 0
    if group:
        packs = group // vec
        if packs > 32:
            raise ValueError(
                f"quant_group: merge_states of states not aligned to 16 bytes takes groups of at most 32 values,"
                f" got {group}"
            )
        lanes, g_shr = max(lanes, packs), packs.bit_length() - 1
    k = _kernels.MERGE_STATES
    return Form(k, targs, _ceil(T * H * lanes, k.block), lanes=lanes, g_shr=g_shr, per_token=H * lanes)


def empty_rows_form(H: int, D: int, vec: int, dev: Device, targs: tuple) -> Form:
    """The empty-rows kernel's form for any T: a persistent grid of blocks per SM, or fewer when
    even every row empty would not give each thread one store (small batches: less to launch,
    the same scan)."""
    k = _kernels.EMPTY_ROWS
    return Form(
        k, targs, 0, per_token=H * max(1, D // vec), cap=THRESHOLDS["empty_rows_blocks_per_sm"] * dev.sms
    )
