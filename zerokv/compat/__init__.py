"""Drop-in adapters: the exact signatures and conventions of the engines' own kernels.

* :mod:`zerokv.compat.vllm` — LSE ``[H, T]``, natural log.
* :mod:`zerokv.compat.sglang` — LSE ``[T, H]``, natural log.
* :mod:`zerokv.compat.flashinfer` — LSE ``[T, H]``, **base 2**.

Each reproduces its engine's behaviour, departing only where the engine yields NaN from
valid inputs (two empty states merge to ``(0, -inf)``).
"""
