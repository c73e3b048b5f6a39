"""Layout facts of strided tensors, each stated once: vector width and alignment, the bytes a
tensor spans, overlap of spans, and what fits a signed 32-bit index.

Strides are in elements; pointers and spans in bytes.
"""

from __future__ import annotations

INT32 = 1 << 31  # the first value a signed 32-bit index cannot hold
VECTOR_BYTES = 16  # one vector access of the kernels (a "pack")


def vec(itemsize: int) -> int:
    """Elements of ``itemsize`` bytes per 16-byte access: the vector width of an aligned call."""
    return VECTOR_BYTES // itemsize


def aligned(ptr: int, itemsize: int, width: int, strides_or_inner: int) -> bool:
    """A tensor allows accesses of ``width`` elements: its pointer on a ``width * itemsize``
    boundary and every stride and the inner extent, OR-ed together in ``strides_or_inner``
    (non-negative), multiples of ``width``."""
    return not (ptr % (width * itemsize) or strides_or_inner % width)


def extent(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` that a tensor's elements cover (strides of any sign);
    ``(ptr, ptr)``, empty, for a zero-size tensor."""
    lo = hi = 0
    for n, s in zip(shape, strides, strict=True):
        if n == 0:
            return ptr, ptr
        d = (n - 1) * s
        if d < 0:
            lo += d
        else:
            hi += d
    return ptr + lo * itemsize, ptr + (hi + 1) * itemsize


def apart_all(lo: int, hi: int, spans: list[tuple[int, int]]) -> bool:
    """``[lo, hi)`` shares no byte with any of ``spans``."""
    for lo2, hi2 in spans:  # noqa: SIM110 - a loop: no generator per call
        if lo2 < hi and lo < hi2:
            return False
    return True


def distinct(n0: int, s0: int, n1: int, s1: int, inner: int) -> bool:
    """A sufficient test that a ``[n0, n1, inner]`` layout (``inner`` unit-stride elements;
    1 for a 2-D tensor) gives each element its own address: rows placed one after another,
    either dimension outer (``checks.writable`` decides every other layout exactly)."""
    return ((n1 <= 1 or s1 >= inner) and (n0 <= 1 or s0 >= (n1 - 1) * s1 + inner)) or (
        (n0 <= 1 or s0 >= inner) and (n1 <= 1 or s1 >= (n0 - 1) * s0 + inner)
    )
