"""Which executor runs zerokv's calls in this process, and why."""

from __future__ import annotations


def launcher() -> tuple[str, str]:
    """``("c", why)`` when the compiled executor runs the calls (built at first use with the
    host C compiler, reading torch tensors through DLPack's C exchange API), ``("python", why)``
    otherwise; ``why`` says what decided it. Chosen once per process by ``ZEROKV_LAUNCHER``
    (``auto``, ``c`` or ``python``); ``c`` raises RuntimeError when it cannot build."""
    from .core import executor

    return executor.choose()
