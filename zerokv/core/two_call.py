"""A two-way merge plan's call, generated once per signature (:mod:`codegen`).

``call(objs, prefix_rows)`` reads each tensor once into locals (pointer, shape, strides),
checks that the call has the plan's signature (producer, dtypes, devices, which options are
given, alignment), then the cheap check of what may change between its calls: shapes, unit
head_dim strides, the options' lengths, ``prefix_rows``, writable outputs whose elements are
distinct and which share no byte with any other tensor of the call, or alias ``v_a`` / ``v_b``
(``s_a`` / ``s_b``) exactly. Then the outputs left None, the form of the layout, the pack by
name and the launch. None: the call is not one it takes (``merge_plans.two`` goes on).
"""

from __future__ import annotations

from typing import Any

from . import kernels as _kernels
from .codegen import Source, function, mixed

# the kernels of the two-way forms (forms.merge_two), the most common first
KERNELS = (
    _kernels.MERGE_STATE_FLAT_GATHERED, _kernels.MERGE_STATE_FLAT, _kernels.MERGE_STATE_HEADS,
    _kernels.MERGE_STATE_FLAT64_GATHERED, _kernels.MERGE_STATE,
)  # fmt: skip
# the kernels' parameters (facts.TwoFacts' names) -> the generated call's locals
_LOCALS = {
    "va": "pa", "va_st": "a0", "va_sh": "a1", "vb": "pb", "vb_st": "b0", "vb_sh": "b1",
    "sa": "psa", "sa_st": "sa0", "sa_sh": "sa1", "sb": "psb", "sb_st": "sb0", "sb_sh": "sb1",
    "out": "po", "out_st": "o0", "out_sh": "o1", "olse": "pl", "ol_st": "l0", "ol_sh": "l1",
    "T": "T", "H": "H", "D": "D", "rows": "T * H", "prefix_rows": "pr",
    "a_cu": "pc", "a_lens": "pn", "a_batch": "nc - 1", "row_mask": "pm", "sinks": "pk", "out_scale": "pq",
    "bscale": "pbs", "bs_st": "bs0", "bs_sg": "bs1",
}  # fmt: skip
_OPTION_PARAMS = {6: ("a_cu", "a_lens", "a_batch"), 8: ("row_mask",), 9: ("out_scale",), 10: ("sinks",),
                  11: ("bscale", "bs_st", "bs_sg")}  # fmt: skip
_NAMES = ("v_a", "s_a", "v_b", "s_b", "out", "out_lse", "cu", "lens", "mask", "scale", "sinks", "bscale")


def generate(plan: Any, objs: tuple, lse_ht: bool, prefix_none: bool) -> Any:
    """The call of ``plan`` (a ``TwoPlan``) for calls like ``objs``, the signature's first
    (fully validated); None for a signature that mixes producers."""
    if mixed(plan, objs):
        return None
    given = [x is not None for x in objs] + [False] * (len(_NAMES) - len(objs))
    # what the source text depends on; the rest are names of its scope
    pattern = ("two", tuple(given), len(objs), lse_ht, prefix_none, plan.vec > 1, plan.may_alias)
    pattern += (plan.torch, plan.allocate_lse)
    title = f"two-way merge call {plan.in_dtype}->{plan.out_dtype}"
    return function(
        pattern, plan, objs, lambda s: _write(s, plan, given, len(objs), lse_ht, prefix_none), title
    )


def _write(src: Source, plan: Any, given: list, n_objs: int, lse_ht: bool, prefix_none: bool) -> None:
    """The call's source (the same for every signature of its pattern)."""
    src.add("def call(objs, prefix_rows):")
    src.add("    try:")
    src.signature(_NAMES[:n_objs], given[:n_objs])
    spans, st_or, widest = _inputs(src, plan, lse_ht, given)
    if prefix_none:
        src.add("        pr = T")
    else:
        src.add("        pr = prefix_rows")
        src.add("        if type(pr) is not int or not 0 <= pr <= T:")
        src.add("            return None")
    spans += _options(src, plan, given, st_or)
    src.add(f"        st_or = {' | '.join(st_or)}")
    src.add("        if st_or < 0:")
    src.add("            return None")
    outs = []
    if given[4]:  # out: apart from every input, or exactly v_a or v_b (same dtype)
        src.writable("out")
        src.distinct("o0", "o1", "D")
        for lo, hi, tag in spans:
            exact = (
                f"po == {lo} and o0 == {tag}0 and o1 == {tag}1"
                if tag in ("a", "b") and plan.may_alias
                else ""
            )
            src.apart("po", "eo", lo, hi, exact)
        outs.append(("po", "eo"))
    if given[5]:  # out_lse: apart from every input and out, or exactly s_a or s_b
        src.writable("out_lse")
        src.distinct("l0", "l1", "1")
        for lo, hi, tag in [*spans, ("po", "eo", None)] if given[4] else spans:
            src.apart(
                "pl",
                "el",
                lo,
                hi,
                f"pl == {lo} and l0 == {tag}0 and l1 == {tag}1" if tag in ("sa", "sb") else "",
            )
        outs.append(("pl", "el"))
    if given[11]:
        src.block_scale([(lo, hi) for lo, hi, _ in spans] + outs)
        widest.append("xbs")
    src.add(f"        widest = max({', '.join(widest)})")
    src.add("    except UNREADABLE:")
    src.add("        return None")
    _launch(src, plan, given)


def _inputs(src: Source, plan: Any, ht: bool, given: list) -> tuple[list, list, list]:
    """The states' and given outputs' reads, shapes, unit head_dim strides and alignment;
    ``(spans (lo, hi, tag) of the inputs, stride names, element spans)``."""
    add = src.add
    add("        pa = v_a.data_ptr(); sh = v_a.shape; T, H, D = sh; a0, a1, a2 = v_a.stride()")
    add("        pb = v_b.data_ptr(); b0, b1, b2 = v_b.stride()")
    for nm, x in (("s_a", "sa"), ("s_b", "sb")):  # an [H, T] LSE read as its [T, H] transpose
        add(f"        p{x} = {nm}.data_ptr(); {f'{x}1, {x}0' if ht else f'{x}0, {x}1'} = {nm}.stride()")
    add(f"        th = {'(H, T)' if ht else '(T, H)'}")
    add("        T1, H1 = T - 1, H - 1")
    add("        xa, xb = T1 * a0 + H1 * a1 + D, T1 * b0 + H1 * b1 + D")
    add("        xsa, xsb = T1 * sa0 + H1 * sa1 + 1, T1 * sb0 + H1 * sb1 + 1")
    add("        ea, eb, esa, esb = pa + xa * ISZ, pb + xb * ISZ, psa + 4 * xsa, psb + 4 * xsb")
    shapes, inner = ["v_b.shape == sh", "s_a.shape == th", "s_b.shape == th"], ["a2 == 1", "b2 == 1"]
    st_or = ["a0", "a1", "b0", "b1", "sa0", "sa1", "sb0", "sb1"]
    widest = ["T * H * D", "xa", "xb", "xsa", "xsb"]
    aligned = ["(pa | pb) % 16", "(a0 | a1 | b0 | b1 | D) % W"]
    if given[4]:
        add("        po = out.data_ptr(); o0, o1, o2 = out.stride()")
        add("        xo = T1 * o0 + H1 * o1 + D; eo = po + xo * OSZ")
        shapes.append("out.shape == sh")
        inner.append("o2 == 1")
        st_or += ["o0", "o1"]
        widest.append("xo")
        aligned += ["po % (W * OSZ)", "(o0 | o1) % W"]
    if given[5]:
        add(f"        pl = out_lse.data_ptr(); {'l1, l0' if ht else 'l0, l1'} = out_lse.stride()")
        add("        xl = T1 * l0 + H1 * l1 + 1; el = pl + 4 * xl")
        shapes.append("out_lse.shape == th")
        st_or += ["l0", "l1"]
        widest.append("xl")
    add("        if not (0 < T < INT32 and 0 < H < INT32 and D > 0")
    add(f"                and {' and '.join(shapes)} and (D == 1 or {' and '.join(inner)})):")
    add("            return None")
    src.aligned(plan.vec > 1, aligned)
    spans = [("pa", "ea", "a"), ("pb", "eb", "b"), ("psa", "esa", "sa"), ("psb", "esb", "sb")]
    return spans, st_or, widest


def _options(src: Source, plan: Any, given: list, st_or: list) -> list:
    """The option tensors' reads and cheap checks (lengths, unit strides); their spans."""
    add, spans = src.add, []
    if given[6]:  # a_empty: cu_seqlens_q [B + 1], kv_lens [B]
        add("        pc = cu.data_ptr(); (nc,) = cu.shape; cs = cu.stride()[0] if nc else 1")
        add("        pn = lens.data_ptr(); (nl,) = lens.shape; ls = lens.stride()[0] if nl else 1")
        add("        if nc < 1 or nl != nc - 1 or (nc > 1 and cs != 1) or (nc > 2 and ls != 1):")
        add("            return None")
        add("        ec, en = pc + nc * IDX, pn + nl * IDX")
        st_or += ["cs", "ls"]
        spans += [("pc", "ec", None), ("pn", "en", None)]
    if given[8]:  # row_mask [T]
        add("        pm = mask.data_ptr(); (nm,) = mask.shape; ms = mask.stride()[0] if nm else 1")
        add("        if nm != T or (T > 1 and ms != 1):")
        add("            return None")
        add("        em = pm + T * MASK")
        st_or.append("ms")
        spans.append(("pm", "em", None))
    if given[9]:  # out_scale: one float32
        add("        pq = scale.data_ptr()")
        add("        if prod(scale.shape) != 1:")
        add("            return None")
        add("        eq = pq + 4")
        spans.append(("pq", "eq", None))
    if given[10]:  # sinks [H]
        add("        pk = sinks.data_ptr(); (nk,) = sinks.shape; ks = sinks.stride()[0] if nk else 1")
        add("        if nk != H or (H > 1 and ks != 1):")
        add("            return None")
        add("        ek = pk + 4 * H")
        st_or.append("ks")
        spans.append(("pk", "ek", None))
    return spans


def _launch(src: Source, plan: Any, given: list) -> None:
    """Outputs left None allocated, the form of the call's layout (``TwoPlan.finish``'s key),
    every parameter packed by name, the launch."""
    add = src.add
    lse_out = src.outputs(plan, 4, given)
    many = f", nc > {_kernels.A_WINDOW + 1}" if given[6] else ""  # a_empty: past the window (TwoPlan.finish)
    if lse_out:
        add(
            f"    key = (T, H, D, pl == psa or pl == psb, widest < INT32, st_or < INT32, l0 == 1 and l1 != 1{many})"
        )
    else:
        add(f"    key = (T, H, D, False, widest < INT32, st_or < INT32, sa0 == 1 and sa1 != 1{many})")
    add("    form, launcher, _, _ = FORMS.get(key) or P.form_entry(key, H, D, P._form)")
    add("    kernel = form.kernel")
    values = dict(_LOCALS)
    if not lse_out:
        values.update(olse="0", ol_st="0", ol_sh="0")
    for i, params in _OPTION_PARAMS.items():
        if not given[i]:
            values.update(dict.fromkeys(params, "0"))
    src.pack(KERNELS, values, plan.consts)
    src.launch()
