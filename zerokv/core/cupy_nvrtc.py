"""The NVRTC calls of the offline compile (cuda-bindings' names and return tuples) over CuPy's
own NVRTC bindings, which need no GPU either: ``python -m zerokv compile`` then works where
CuPy is installed without cuda-bindings. Output buffers are ``bytearray``s filled in place, as
cuda-bindings fills them.
"""

from __future__ import annotations

from typing import Any


class nvrtcResult:  # noqa: N801 - cuda-bindings' name
    NVRTC_SUCCESS = 0


class CupyNvrtc:
    nvrtcResult = nvrtcResult

    def __init__(self, module: Any) -> None:
        self.m = module  # cupy_backends.cuda.libs.nvrtc

    def _status(self, call: Any, *args: Any) -> tuple:
        try:
            value = call(*args)
        except self.m.NVRTCError as e:
            return (int(getattr(e, "status", 1)) or 1, None)
        return (nvrtcResult.NVRTC_SUCCESS, value)

    def nvrtcVersion(self) -> tuple:
        major, minor = self.m.getVersion()
        return (nvrtcResult.NVRTC_SUCCESS, major, minor)

    def nvrtcGetSupportedArchs(self) -> tuple:
        return self._status(lambda: list(self.m.getSupportedArchs()))

    def nvrtcCreateProgram(self, code: bytes, name: bytes, n: int, headers: list, names: list) -> tuple:
        return self._status(self.m.createProgram, code.decode(), name.decode(), (), ())

    def nvrtcAddNameExpression(self, prog: Any, expr: bytes) -> tuple:
        return self._status(self.m.addNameExpression, prog, expr.decode())[:1]

    def nvrtcCompileProgram(self, prog: Any, n: int, options: list[bytes]) -> tuple:
        return self._status(self.m.compileProgram, prog, [o.decode() for o in options])[:1]

    def nvrtcGetProgramLogSize(self, prog: Any) -> tuple:
        return (nvrtcResult.NVRTC_SUCCESS, len(self.m.getProgramLog(prog).encode()))

    def nvrtcGetProgramLog(self, prog: Any, buf: bytearray) -> tuple:
        text = self.m.getProgramLog(prog).encode()
        buf[: len(text)] = text
        return (nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcGetCUBINSize(self, prog: Any) -> tuple:
        return self._status(lambda: len(self.m.getCUBIN(prog)))

    def nvrtcGetCUBIN(self, prog: Any, buf: bytearray) -> tuple:
        status, cubin = self._status(self.m.getCUBIN, prog)
        if cubin is not None:
            buf[: len(cubin)] = cubin
        return (status,)

    def nvrtcGetLoweredName(self, prog: Any, expr: bytes) -> tuple:
        status, name = self._status(self.m.getLoweredName, prog, expr.decode())
        return (status, None if name is None else name.encode())

    def nvrtcDestroyProgram(self, prog: Any) -> tuple:
        self.m.destroyProgram(prog)
        return (nvrtcResult.NVRTC_SUCCESS,)
