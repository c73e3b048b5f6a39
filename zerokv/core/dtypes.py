"""The closed table of element types zerokv understands.

Each entry maps a canonical name to the C++ type the kernels use. Tensors of any producer are
reduced to one of these names by ``zerokv.core.tensors``; a miss is a ``TypeError`` listing what is
supported.
"""

from __future__ import annotations

# canonical name -> (C++ type in kernels_cu/common.cuh, bytes per element)
FLOATS = {
    "float16": ("zk_half", 2),
    "bfloat16": ("zk_bfloat16", 2),
    "float32": ("float", 4),
}
FP8 = {"float8_e4m3fn": ("zk_fp8_e4m3", 1)}
INDEX = {"int32": ("int", 4), "int64": ("long long", 8)}
MASK = {"bool": ("unsigned char", 1), "uint8": ("unsigned char", 1)}

ALL = {**FLOATS, **FP8, **INDEX, **MASK}

ITEMSIZE = {name: size for name, (_, size) in ALL.items()}
V_IN = tuple(FLOATS)  # dtypes of partial attention outputs
V_OUT = tuple(FLOATS) + tuple(FP8)  # dtypes a merge may write
LSE = ("float32",)
INDEX_NAMES = tuple(INDEX)
MASK_NAMES = tuple(MASK)


def ctype(name: str) -> str:
    return ALL[name][0]


def itemsize(name: str) -> int:
    return ALL[name][1]


def require(arg: str, dtype: str, allowed: tuple[str, ...]) -> None:
    """Raise TypeError naming the argument when ``dtype`` is not one of ``allowed``."""
    if dtype not in allowed:
        raise TypeError(f"{arg}: dtype {dtype} is not supported; expected one of {', '.join(allowed)}")
