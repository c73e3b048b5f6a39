"""How far a merge's output may sit from float64, per output dtype: derived once, here.

A kernel (or the CPU path) computes in float32 (float64 on the CPU) and rounds once to the output
dtype. So the distance to the float64 value ``e`` of the same inputs is at most

    |out - e| <= ACC + U[dtype] * |e|

- ``U[dtype]``: one rounding to nearest, half an ULP relative: ``2^-p`` for a significand of p
  bits (float32 24, float16 11, bfloat16 8), plus ``4 * 2^-24`` for the float32 products and the
  one division of the normalisation, which are relative to ``|e|``. float16 values below its
  smallest normal (6.1e-5) round by at most 2^-25 absolute, inside ``ACC``.
- ``ACC``: the float32 error of the weights, absolute on values of order one (the tests' V are
  N(0, 1), so ``|v| <= 6``). A weight is ``2^(s_i log2(e) - m log2(e))``: each product rounds by
  half an ULP of ``|s log2(e)| <= 32`` (2^-20), the approximate ``exp2`` adds 2^-22 relative, so
  each weight is off by ``delta <= 2e-6`` relative; the output moves by at most
  ``delta * max|v_i - v_j| <= 2e-6 * 12 = 2.4e-5`` in the worst row, and by less than
  ``2e-6 * 6`` once the normalised weights' errors, which sum to zero, are paired. 2e-5.

Two outputs that each went through one rounding (a GPU result against the CPU path's) differ by
two: ``roundings=2`` in :func:`conftest.assert_close`. The LSE is float32 output: ``U[float32]``
and ``ACC`` (``log2`` of a sum of weights adds ``delta``).

**The CPU path** computes the merge in float64 (the reference) and casts the result to the output
dtype, so against an oracle computing the same rule in float64 by another formula

    |out - e| <= ACC64 + SUB[dtype] + (U[dtype] + EPS32) * |e|

- ``ACC64``: two float64 computations of one merge differ by a few float64 ULPs of the largest
  term they add. The tests' LSEs reach ``|s| = 1e4`` (the huge-gap cases): ``s_i - S`` is then off
  by ``8 * 2^-53 * 1e4 ~ 1e-11``, a weight by as much relative, V (``|v| <= 6``) by ``6e-11``.
  ``1e-10``.
- ``U[dtype] + EPS32``: the cast rounds to nearest; torch casts float64 to float16 and
  bfloat16 through float32 (two roundings: ``2^-p + 2^-24``). ``roundings=k`` counts ``k``
  such casts of values the test took from an output.
- ``SUB[dtype]``: a value below the dtype's smallest normal rounds by half a subnormal step,
  absolute (float16: ``2^-25``).
"""

from __future__ import annotations

EPS32 = 2.0**-24  # float32's unit roundoff
ACC = 2e-5  # float32 accumulation, absolute on values of order one (above)
ARITH = 4 * EPS32  # float32 products and the division, relative to |e|

ACC64 = 1e-10  # the CPU path's float64 arithmetic against the oracle's (above)

# significand bits of each output dtype, by name (torch's and numpy's names)
BITS = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8}
# half the step between subnormals of each dtype: the absolute rounding below the smallest normal
SUB = {"float64": 2.0**-1075, "float32": 2.0**-150, "float16": 2.0**-25, "bfloat16": 2.0**-134}


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.").removeprefix("<class 'numpy.").removesuffix("'>")


def unit_roundoff(dtype) -> float:
    """Half an ULP relative (``2^-p``) for an output dtype given as torch/numpy dtype or name."""
    return 2.0 ** -BITS[_name(dtype)]


def tolerance(dtype, roundings: int = 1, arithmetic: str = "float32") -> tuple[float, float]:
    """``(atol, rtol)`` for outputs of ``dtype`` that went through ``roundings`` output roundings,
    computed in ``arithmetic``: "float32" (a kernel) or "float64" (the CPU path)."""
    if _name(dtype) == "float64":  # float64 results compared as they are
        return 1e-12, 1e-12
    if arithmetic == "float64":
        return ACC64 + roundings * SUB[_name(dtype)], roundings * (unit_roundoff(dtype) + EPS32)
    return ACC, roundings * unit_roundoff(dtype) + ARITH
