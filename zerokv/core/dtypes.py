"""The closed table of element types zerokv understands: one row per type, every property of it
a column.

Tensors of any producer are reduced to one of these names by ``zerokv.core.tensors``; a miss is a
``TypeError`` listing what is supported. Adding a type is a row here, its C++ type in
``kernels_cu/common.cuh`` (with its conversions), and the reference's rounding.
"""

from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    ctype: str  # the C++ type in kernels_cu/common.cuh
    size: int  # bytes per element
    kind: str  # "float" (partials, outputs), "fp8" (scaled outputs), "index" (offsets), "mask"
    dlpack: tuple[int, int]  # DLPack (type code, bits)
    numpy: str  # the module that names it for numpy: "numpy", or "ml_dtypes" (no numpy type)
    saturate: float = 0.0  # fp8: the largest finite value, where conversions saturate


TABLE = {
    "float16": DType("zk_half", 2, "float", (2, 16), "numpy"),
    "bfloat16": DType("zk_bfloat16", 2, "float", (4, 16), "ml_dtypes"),
    "float32": DType("float", 4, "float", (2, 32), "numpy"),
    "float8_e4m3fn": DType("zk_fp8_e4m3", 1, "fp8", (10, 8), "ml_dtypes", saturate=448.0),
    "int32": DType("int", 4, "index", (0, 32), "numpy"),
    "int64": DType("long long", 8, "index", (0, 64), "numpy"),
    "bool": DType("unsigned char", 1, "mask", (6, 8), "numpy"),
    "uint8": DType("unsigned char", 1, "mask", (1, 8), "numpy"),
}


def _of(kind: str) -> tuple[str, ...]:
    return tuple(n for n, d in TABLE.items() if d.kind == kind)


FLOATS = _of("float")
FP8 = _of("fp8")  # outputs written through a scale (``out_scale`` or per-group scales)
INDEX_NAMES = _of("index")
MASK_NAMES = _of("mask")
ITEMSIZE = {name: d.size for name, d in TABLE.items()}
V_IN = FLOATS  # dtypes of partial attention outputs
V_OUT = FLOATS + FP8  # dtypes a merge may write
LSE = ("float32",)


def ctype(name: str) -> str:
    return TABLE[name].ctype


def itemsize(name: str) -> int:
    return TABLE[name].size


def dlpack_code(name: str) -> int:
    """The DLPack dtype of one lane as one integer: ``code | bits << 8 | lanes << 16``."""
    code, bits = TABLE[name].dlpack
    return code | bits << 8 | 1 << 16


def require(arg: str, dtype: str, allowed: tuple[str, ...]) -> None:
    """Raise TypeError naming the argument when ``dtype`` is not one of ``allowed``."""
    if dtype not in allowed:
        raise TypeError(f"{arg}: dtype {dtype} is not supported; expected one of {', '.join(allowed)}")
