"""An empty-rows plan's call, generated once per signature (:mod:`codegen`).

``call(objs)`` (out, lse, cu_q, lens) reads each tensor once into locals, checks the plan's
signature, then the cheap check of what may change between its calls: shapes, unit strides
of head_dim and the offsets, the offsets' lengths, writable outputs whose elements are
distinct, apart from each other and from the offsets; then the grid and the launch. True:
done; None: not a call it takes (``empty_rows_plan.run`` goes on).
"""

from __future__ import annotations

from typing import Any

from . import kernels as _kernels
from .codegen import Source, function, mixed

_LOCALS = {
    "out": "po", "out_st": "o0", "out_sh": "o1", "lse": "pl", "lse_st": "l0", "lse_sh": "l1",
    "cu_q": "pc", "lens": "pn", "batch": "nc - 1", "T": "T", "H": "H", "D": "D",
    "flat": "int(o1 == D and o0 == H * D)",
}  # fmt: skip


def generate(plan: Any, objs: tuple) -> Any:
    """The call of ``plan`` (an ``empty_rows_plan.Plan``) for calls like ``objs``, the
    signature's first (fully validated); None for a signature that mixes producers."""
    if mixed(plan, objs):
        return None

    pattern = ("rows", plan.vec > 1, plan.torch)  # what the source text depends on
    return function(pattern, plan, objs, lambda s: _write(s, plan), f"empty-rows call {plan.out_dtype}")


def _write(src: Source, plan: Any) -> None:
    """The call's source (the same for every signature of its pattern)."""
    add = src.add
    add("def call(objs):")
    add("    try:")
    src.signature(("out", "lse", "cu", "lens"), [True] * 4)
    add("        po = out.data_ptr(); T, H, D = out.shape; o0, o1, o2 = out.stride()")
    add("        pl = lse.data_ptr(); l0, l1 = lse.stride()")
    add("        pc = cu.data_ptr(); (nc,) = cu.shape; cs = cu.stride()[0] if nc else 1")
    add("        pn = lens.data_ptr(); (nl,) = lens.shape; ns = lens.stride()[0] if nl else 1")
    src.aligned(plan.vec > 1, ["po % 16", "(o0 | o1 | D) % W"])
    add("        if (o0 | o1 | o2 | l0 | l1 | cs | ns) < 0 or lse.shape != (T, H) or T >= INT32:")
    add("            return None")
    add("        if (nc < 1 or nl != nc - 1 + LENS_EXTRA or (D > 1 and o2 != 1) or (nc > 1 and cs != 1)")
    add("                or (nl > 1 and ns != 1)):")
    add("            return None")
    src.writable("out")
    src.writable("lse")
    add("        T1, H1 = T - 1, H - 1")
    src.distinct("o0", "o1", "D")
    src.distinct("l0", "l1", "1")
    add("        if not (T and H and nc > 1):")
    add("            return True  # nothing to write")
    add("        if not D:")
    add("            return None")
    add("        eo = po + (T1 * o0 + H1 * o1 + D) * OSZ; el = pl + (T1 * l0 + H1 * l1 + 1) * 4")
    add("        ec, en = pc + nc * QSZ, pn + nl * LSZ")
    for a, b in (("po", "eo"), ("pl", "el")):
        for c, d in (("pl", "el"), ("pc", "ec"), ("pn", "en")):
            if a != c:
                src.apart(a, b, c, d)
    add("    except UNREADABLE:")
    add("        return None")
    add("    if nc == 1:")
    add("        return True  # no request")
    add("    grid = GRIDS.get((T, H, D)) or P.grid(T, H, D)")
    src.pack((_kernels.EMPTY_ROWS,), _LOCALS, plan.consts)
    add("    P.launcher.fire(grid, 1, STREAM(DEVICE))")
    add("    return True")
