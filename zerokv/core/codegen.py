"""The pieces every generated call is made of (:mod:`two_call`, :mod:`rows_call`).

A plan's call is generated once per signature as one straight-line function over locals:
the checks written for that signature's tensors only cost a third of the same rules
interpreted per call (bench/NOTES.md). Each piece appends lines to the function's source;
``build`` compiles it. A generated call returns None for anything it does not take: the op
then finds the plan of the call's signature or runs its full validation, whose messages name
the arguments.
"""

from __future__ import annotations

import math
from typing import Any

from . import launch as _launch
from . import outputs as _outputs
from .forms import launch_grid
from .generic_tensors import _Generic, generic, writable_cheap
from .layout import INT32, VECTOR_BYTES, distinct
from .tensors import torch_tensor_type

_compiled: dict[tuple, tuple] = {}  # pattern -> (code object, static names, source text)
_COMPILED_LIMIT = 256
UNREADABLE = (AttributeError, TypeError, ValueError, RuntimeError)  # an argument not as the signature's


def function(pattern: tuple, plan: Any, objs: tuple, write: Any, title: str) -> Any:
    """The generated call of ``plan`` for calls like ``objs``: ``write(source)`` writes its
    lines, once per ``pattern`` (what the text depends on: which tensors are given, layout
    flags); the signature's values (dtypes, devices, sizes, constants) are names of its scope,
    so a new signature of a known pattern costs a dict and an ``exec``, not a compile."""
    done = _compiled.get(pattern)
    if done is None:
        src = Source(plan.torch)
        write(src)
        text = "\n".join(src.lines)
        if len(_compiled) >= _COMPILED_LIMIT:
            _compiled.clear()
        done = _compiled[pattern] = (compile(text, f"<{title}>", "exec"), src.static, text)
    code, static, text = done
    scope = _scope(plan, objs)
    scope.update(static)
    exec(code, scope)
    fn = scope["call"]
    fn.source = text  # what a signature runs, for a reader
    return fn


def _scope(plan: Any, objs: tuple) -> dict[str, Any]:
    """The names a generated call reads that depend on its signature."""
    size = getattr(plan, "in_size", None) or plan.out_size
    scope = {
        "TT": torch_tensor_type(), "GEN": _Generic, "generic": generic, "writable_cheap": writable_cheap,
        "distinct": distinct, "prod": math.prod, "P": plan, "INT32": INT32, "UNREADABLE": UNREADABLE,
        "ARENA": _launch._arena, "STREAM": plan.stream, "DEVICE": plan.device, "ptr": _outputs.ptr,
        "launch_grid": launch_grid, "FORMS": getattr(plan, "forms", None), "GRIDS": getattr(plan, "grids", None),
        "ISZ": size, "OSZ": plan.out_size, "W": pack_width(size),
        "IDX": getattr(plan, "idx_size", 0), "MASK": getattr(plan, "mask_size", 0),
        "GROUP": getattr(plan, "quant_group", 0) or getattr(plan, "group", 0),
        "LENS_EXTRA": getattr(plan, "lens_extra", 0), "QSZ": getattr(plan, "q_size", 0),
        "LSZ": getattr(plan, "lens_size", 0),
    }  # fmt: skip
    consts = plan.consts
    scope.update({f"C_{n}": getattr(consts, n) for n in consts.__slots__ if hasattr(consts, n)})
    # the signature's dtypes and devices as the objects report them (a test that reads host
    # tensors as device 0 keeps the host's -1 here)
    for i, x in enumerate(objs):
        if x is not None:
            t = generic(x)
            scope[f"DT{i}"], scope[f"DV{i}"] = t.dtype, t.get_device()
    return scope


class Source:
    """A generated function's lines and the names of its scope that every signature shares
    (``static``: the kernels and their packers)."""

    def __init__(self, torch: bool) -> None:
        self.lines: list[str] = []
        self.torch = torch
        self.static: dict[str, Any] = {}

    def add(self, line: str) -> None:
        self.lines.append(line)

    def signature(self, names: tuple[str, ...], given: list[bool]) -> None:
        """The call's objects unpacked; the signature's absent ones None, the given ones of its
        producer (torch tensors, or another producer's read as ``generic``), dtypes, devices."""
        add = self.add
        add(f"        {', '.join(names)} = objs")
        # which are given first: a call of another signature with the same scalars fails here
        presence = [f"{nm} is {'' if g else 'not '}None" for nm, g in zip(names, given, strict=True)]
        add(f"        if {' or '.join(presence)}:")
        add("            return None")
        present = [(nm, i) for i, (nm, g) in enumerate(zip(names, given, strict=True)) if g]
        if not self.torch:
            for nm, _ in present:
                add(f"        {nm} = generic({nm})")
        kind, ne = ("TT", "is not") if self.torch else ("GEN", "!=")
        conds = [
            f"type({nm}) is not {kind} or {nm}.dtype {ne} DT{i} or {nm}.get_device() != DV{i}"
            for nm, i in present
        ]
        add("        if (" + "\n            or ".join(conds) + "):")
        add("            return None")

    def writable(self, nm: str) -> None:
        """``checks.writable``'s cheap half (``writable_cheap``), its common case first."""
        if self.torch:
            self.add(f"        if ({nm}.requires_grad or {nm}.is_inference()) and not writable_cheap({nm}):")
        else:
            self.add(f"        if not writable_cheap({nm}.obj):")
        self.add("            return None")

    def distinct(self, s0: str, s1: str, inner: str) -> None:
        """A ``[T, H, inner]`` output gives each element its own address (``layout.distinct``,
        its row-major case first)."""
        self.add(f"        if not ((H1 == 0 or {s1} >= {inner}) and (T1 == 0 or {s0} >= H1 * {s1} + {inner})")
        self.add(f"                or distinct(T, {s0}, H, {s1}, {inner})):")
        self.add("            return None")

    def aligned(self, aligned: bool, terms: list[str]) -> None:
        """The signature's alignment: an aligned plan takes aligned calls only, an unaligned one
        the others (the facts readers' rule: pointers of 16 bytes, strides of whole packs)."""
        self.add(f"        if {'' if aligned else 'not '}({' or '.join(terms)}):")
        self.add("            return None")

    def apart(self, lo: str, hi: str, lo2: str, hi2: str, unless: str = "") -> None:
        """Two byte ranges share no byte (``layout.apart``), or ``unless`` holds."""
        self.add(f"        if {lo} < {hi2} and {lo2} < {hi}{f' and not ({unless})' if unless else ''}:")
        self.add("            return None")

    def outputs(self, plan: Any, out_index: int, given: list) -> bool:
        """``out`` and ``out_lse`` (objects ``out_index`` and the next): the caller's, or those
        the signature leaves None allocated (the LSE where it asks for one) with their locals
        ``po, o0, o1`` / ``pl, l0, l1``; True when the call writes an LSE."""
        add, ptr = self.add, ("{}.data_ptr()" if plan.torch else "ptr({})")
        if given[out_index]:
            add(f"    out = objs[{out_index}]")
        else:
            add("    out = P.new(objs[0], (T, H, D), False)")
            add(f"    po, o0, o1 = {ptr.format('out')}, H * D, D")
        if given[out_index + 1] or not plan.allocate_lse:
            add(f"    out_lse = objs[{out_index + 1}]")
            return given[out_index + 1]
        add("    out_lse = P.new(objs[0], (T, H), True)")
        add(f"    pl, l0, l1 = {ptr.format('out_lse')}, H, 1")
        return True

    def launch(self) -> None:
        """The form's grid for T and the launch of the packed arguments on the caller's stream."""
        self.add("    grid, grid_y = launch_grid(form, T)")
        self.add("    launcher.fire(grid, grid_y, STREAM(DEVICE))")
        self.add("    return out, out_lse")

    def block_scale(self, spans: list) -> None:
        """out_block_scale (per-group fp8 scales): ``[T, H * D / group]``, non-negative strides,
        writable, its elements distinct, apart from every other tensor of the call (``spans``);
        ``xbs``: its span in elements."""
        add = self.add
        add("        pbs = bscale.data_ptr(); bs0, bs1 = bscale.stride()")
        add("        G = H * D // GROUP")
        add("        if (D % GROUP or bscale.shape != (T, G) or bs0 < 0 or bs1 < 0")
        add("                or not distinct(T, bs0, G, bs1, 1)):")
        add("            return None")
        self.writable("bscale")
        add("        xbs = T1 * bs0 + (G - 1) * bs1 + 1; ebs = pbs + 4 * xbs")
        for lo, hi in spans:
            self.apart("pbs", "ebs", lo, hi)

    def pack(
        self, kernels: tuple, values: dict[str, str], consts: Any, per_kernel: dict | None = None
    ) -> None:
        """Every parameter of the launch's kernel (``kernel``, among ``kernels``) packed by name
        into this thread's launch buffer: a call's local (``per_kernel[kernel]``, then
        ``values``), the plan's constant, or the form's field (``form.name``)."""
        c = {n: f"C_{n}" for n in getattr(consts, "__slots__", ()) if hasattr(consts, n)}
        indent = "    "
        for i, k in enumerate(kernels):
            self.static[f"K{i}"], self.static[f"PACK{i}"] = k, k.packer.pack_into
            own = {**values, **(per_kernel or {}).get(k, {})}
            args = [own.get(n) or c.get(n) or f"form.{n}" for n, _ in k.params]
            if len(kernels) > 1:
                self.add(f"{indent}{'if' if i == 0 else 'elif'} kernel is K{i}:")
                self.add(f"{indent}    PACK{i}(ARENA.buf, 0, {', '.join(args)})")
            else:
                self.add(f"{indent}PACK{i}(ARENA.buf, 0, {', '.join(args)})")
        if len(kernels) > 1:
            self.add(f"{indent}else:")
            self.add(f"{indent}    raise RuntimeError(f'zerokv: no packer for {{kernel.name}}')")


def forget_sources() -> None:
    """Forget every compiled source (the next signature of each pattern compiles its own)."""
    _compiled.clear()


def mixed(plan: Any, objs: tuple) -> bool:
    """A signature of torch tensors beside another producer's (its validation rejects it on a
    GPU): no generated call."""
    return not plan.torch and any(type(generic(x)) is not _Generic for x in objs if x is not None)


def pack_width(itemsize: int) -> int:
    """Elements per 16-byte pack, whether the plan packs or not (the alignment rule's width)."""
    return VECTOR_BYTES // itemsize
