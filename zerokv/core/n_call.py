"""A merge_states plan's call, generated once per signature (:mod:`codegen`).

``call(objs)`` (v, s, out, out_lse, out_scale, sinks[, out_block_scale]) reads each tensor
once into locals, checks the plan's signature, then the cheap check of what may change
between its calls: shapes, unit head_dim strides, the options' lengths, writable outputs
whose elements are distinct and which share no byte with any other tensor of the call. Then
the outputs left None, the form, the pack by name (two states on a two-way form: states 0
and 1 as its a and b) and the launch. None: not a call it takes.
"""

from __future__ import annotations

from typing import Any

from . import kernels as _kernels
from .codegen import Source, function, mixed
from .two_call import KERNELS as TWO_WAY

# merge_states_kernel's parameters (facts.NFacts' names) -> the generated call's locals
_LOCALS = {
    "v": "pv", "v_sn": "v0", "v_st": "v1", "v_sh": "v2", "s": "ps", "s_sn": "s0", "s_st": "s1", "s_sh": "s2",
    "out": "po", "out_st": "o0", "out_sh": "o1", "olse": "pl", "ol_st": "l0", "ol_sh": "l1",
    "N": "N", "T": "T", "H": "H", "D": "D", "sinks": "pk", "out_scale": "pq",
    "bscale": "pbs", "bs_st": "bs0", "bs_sg": "bs1",
}  # fmt: skip
_NAMES = ("v", "s", "out", "out_lse", "scale", "sinks", "bscale")


def _as_two() -> dict[str, str]:
    """A two-way form's parameters for states 0 and 1 (``merge_states_plan._as_two``)."""
    return {
        "va": "pv", "va_st": "v1", "va_sh": "v2", "vb": "pv + v0 * ISZ", "vb_st": "v1", "vb_sh": "v2",
        "sa": "ps", "sa_st": "s1", "sa_sh": "s2", "sb": "ps + s0 * 4", "sb_st": "s1", "sb_sh": "s2",
        "rows": "T * H", "prefix_rows": "T", "a_cu": "0", "a_lens": "0", "a_batch": "0", "row_mask": "0",
    }  # fmt: skip


def generate(plan: Any, objs: tuple) -> Any:
    """The call of ``plan`` (an ``NPlan``) for calls like ``objs``, the signature's first
    (fully validated); None for a signature that mixes producers."""
    if mixed(plan, objs):
        return None
    given = [x is not None for x in objs] + [False] * (len(_NAMES) - len(objs))
    pattern = ("n", tuple(given), len(objs), plan.vec > 1, plan.torch, plan.allocate_lse)  # the text's
    title = f"N-way merge call {plan.in_dtype}->{plan.out_dtype}"
    return function(pattern, plan, objs, lambda s: _write(s, plan, given, len(objs)), title)


def _write(src: Source, plan: Any, given: list, n_objs: int) -> None:
    """The call's source (the same for every signature of its pattern)."""
    add = src.add
    add("def call(objs):")
    add("    try:")
    src.signature(_NAMES[:n_objs], given[:n_objs])
    add("        pv = v.data_ptr(); N, T, H, D = v.shape; v0, v1, v2, v3 = v.stride()")
    add("        ps = s.data_ptr(); s0, s1, s2 = s.stride()")
    add(
        "        if not (0 < N < INT32 and 0 < T < INT32 and 0 < H < INT32 and D > 0 and s.shape == (N, T, H)"
    )
    add("                and (D == 1 or v3 == 1)):")
    add("            return None")
    add("        T1, H1 = T - 1, H - 1")
    add("        xv = (N - 1) * v0 + T1 * v1 + H1 * v2 + D; xs = (N - 1) * s0 + T1 * s1 + H1 * s2 + 1")
    add("        ev, es = pv + xv * ISZ, ps + 4 * xs")
    aligned = ["pv % 16", "(v0 | v1 | v2 | D) % W"]
    st_or, neg, widest = ["v1", "v2", "s1", "s2"], ["v0", "v3", "s0"], ["T * H * D", "xv", "xs"]
    spans = [("pv", "ev"), ("ps", "es")]
    if given[5]:
        add("        pk = sinks.data_ptr(); (nk,) = sinks.shape; ks = sinks.stride()[0] if nk else 1")
        add("        if nk != H or (H > 1 and ks != 1):")
        add("            return None")
        add("        ek = pk + 4 * H")
        neg.append("ks")
        spans.append(("pk", "ek"))
    if given[4]:
        add("        pq = scale.data_ptr()")
        add("        if prod(scale.shape) != 1:")
        add("            return None")
        add("        eq = pq + 4")
        spans.append(("pq", "eq"))
    if given[2]:  # the outputs: apart from every input and each other (no alias in an N-way merge)
        wrong = "out.shape != (T, H, D) or (D > 1 and o2 != 1)"
        _output(src, "out", "po", ("o0", "o1", "o2"), wrong, "D", "OSZ", spans)
        aligned += ["po % (W * OSZ)", "(o0 | o1) % W"]
        st_or += ["o0", "o1"]
        neg.append("o2")
        widest.append("xo")
    if given[3]:
        _output(src, "out_lse", "pl", ("l0", "l1"), "out_lse.shape != (T, H)", "1", "4", spans)
        st_or += ["l0", "l1"]
        widest.append("xl")
    src.aligned(plan.vec > 1, aligned)
    add(f"        st_or = {' | '.join(st_or)}")
    add(f"        if (st_or | {' | '.join(neg)}) < 0:")
    add("            return None")
    if given[6]:
        src.block_scale(spans)
        widest.append("xbs")
    add(f"        widest = max({', '.join(widest)})")
    add("    except UNREADABLE:")
    add("        return None")
    _launch(src, plan, given)


def _output(
    src: Source, nm: str, p: str, strides: tuple, wrong: str, inner: str, size: str, spans: list
) -> None:
    """An output read into ``p`` (pointer) and ``strides``, its shape (``wrong``: the test that
    refuses it), writability, distinct elements, bytes apart from ``spans`` (then one of them);
    ``x<o|l>`` / ``e<o|l>``: its span in elements and its byte end."""
    s0, s1 = strides[:2]
    x, e = f"x{p[1]}", f"e{p[1]}"
    src.add(f"        {p} = {nm}.data_ptr(); {', '.join(strides)} = {nm}.stride()")
    src.add(f"        if {wrong}:")
    src.add("            return None")
    src.writable(nm)
    src.distinct(s0, s1, inner)
    src.add(f"        {x} = T1 * {s0} + H1 * {s1} + {inner}; {e} = {p} + {x} * {size}")
    for lo, hi in spans:
        src.apart(p, e, lo, hi)
    spans.append((p, e))


def _launch(src: Source, plan: Any, given: list) -> None:
    """Outputs left None allocated, the form (``NPlan.__call__``'s key), the pack by name of
    the form's kernel (N states, or states 0 and 1 on a two-way form), the launch."""
    add = src.add
    lse_out = src.outputs(plan, 2, given)
    tiles = "l0 == 1 and l1 != 1" if lse_out else "s1 == 1 and s2 != 1"
    add(f"    key = (T, N, H, D, widest < INT32, st_or < INT32, {tiles})")
    add("    form, launcher, _, _ = FORMS.get(key) or P.form_entry(key, H, D, P._form)")
    add("    kernel = form.kernel")
    values = dict(_LOCALS)
    if not lse_out:
        values.update(olse="0", ol_st="0", ol_sh="0")
    for i, params in ((5, ("sinks",)), (4, ("out_scale",)), (6, ("bscale", "bs_st", "bs_sg"))):
        if not given[i]:
            values.update(dict.fromkeys(params, "0"))
    src.pack((_kernels.MERGE_STATES, *TWO_WAY), values, plan.consts, dict.fromkeys(TWO_WAY, _as_two()))
    src.launch()
