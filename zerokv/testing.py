"""Testing without a GPU: CPU torch tensors down the GPU path, launches recorded, not made.

::

    with zerokv.testing.record_launches() as log:
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse)   # CPU tensors
    (launch,) = log.launches
    launch.kernel, launch.grid, launch.block, launch.params["T"]

Inside the block, host torch tensors take the path a GPU call takes: the full validation on a
signature's first call, its plan, the form chosen for a GPU of ``sm_count`` multiprocessors and
``l2_bytes`` of L2, the bound call run by the chosen executor (``"c"``, ``"python"``, or None
for the process's own); each launch is recorded with its kernel's instantiation, grid, block,
shared memory and parameters by name (pointers as integers) instead of reaching the driver. With
``keep=False`` launches are only counted (``log.count``), so the block can time the host path.
Nothing is compiled and nothing runs on a device; the outputs are not written.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

_lock = threading.Lock()


@dataclass(frozen=True)
class Launch:
    kernel: str  # the instantiation, e.g. ``merge_flat_kernel<zk_bfloat16, zk_bfloat16, 8, 0>``
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    params: dict[str, Any]  # parameter name -> value (pointers as integers)


@dataclass
class LaunchLog:
    launches: list[Launch] = field(default_factory=list)
    executor: str = ""  # "c" or "python": the one that ran the bound calls
    counted: int = 0  # launches seen on the Python side
    module: Any = None  # the compiled executor, which counts its own when launches are not kept

    @property
    def count(self) -> int:
        """Launches made in the block (recorded or only counted)."""
        own = self.module.launches() if self.module is not None and not self.launches_kept else 0
        return self.counted + own

    launches_kept: bool = True


class _Recorder:
    """Stands for a loaded instantiation: what its launches would launch goes to the log."""

    handle = 0
    context = 0

    def __init__(self, kernel: Any, targs: tuple, log: LaunchLog, keep: bool) -> None:
        self.kernel, self.expr, self.log, self.keep = kernel, kernel.expr(*targs), log, keep
        self.block = kernel.block

    def launch_values(self, grid: int, grid_y: int, stream: int, values: Sequence[Any]) -> None:
        if not self.keep:
            self.log.counted += 1
            return
        self.record(grid, grid_y, self.kernel.packer.pack(*values))

    def __call__(self, grid: int, stream: int, *args: Any, grid_y: int = 1) -> None:
        self.record(grid, grid_y, self.kernel.packer.pack(*args))

    def record(self, grid: int, grid_y: int, params: bytes) -> None:
        self.log.counted += 1
        if self.keep:
            values = self.kernel.packer.unpack_from(params)
            names = (n for n, _ in self.kernel.params)
            self.log.launches.append(
                Launch(
                    self.expr, (grid, grid_y, 1), (self.block, 1, 1), 0, dict(zip(names, values, strict=True))
                )
            )


def _on_device(facts_of: Any) -> Any:
    def on_device(*args: Any) -> Any:
        f = facts_of(*args)
        f.device = 0  # a host tensor's facts as a GPU call's (its plan keeps the host's -1)
        return f

    return on_device


@contextlib.contextmanager
def record_launches(
    executor: str | None = None, keep: bool = True, sm_count: int = 132, l2_bytes: int = 50 << 20
) -> Iterator[LaunchLog]:
    """Record (``keep=True``) or count the launches of zerokv calls on CPU torch tensors made in
    the block; ``executor``: ``"c"``, ``"python"`` or None (the process's choice). One block at a
    time per process; plans built inside are forgotten on leaving."""
    if executor not in (None, "c", "python"):
        raise ValueError(f"executor must be 'c', 'python' or None, got {executor!r}")
    if type(keep) is not bool:
        raise TypeError(f"keep must be a bool, got {keep!r}")
    for name, v in (("sm_count", sm_count), ("l2_bytes", l2_bytes)):
        if type(v) is not int or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    from .core import device as _device
    from .core import executor as _executor
    from .core import facts as _facts
    from .core import plans as _plans

    log = LaunchLog(launches_kept=keep)
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if not _lock.acquire(blocking=False):
        raise RuntimeError("record_launches: another block is recording in this process")
    try:
        _plans.clear_plans()
        patch(_plans, "launcher", lambda kernel, targs, device: _Recorder(kernel, targs, log, keep))
        patch(_device, "sm_count", lambda device: sm_count)
        patch(_device, "l2_bytes", lambda device: l2_bytes)
        patch(_device, "torch_stream", lambda device: 0)
        patch(_device, "cupy_stream", lambda device: 0)
        patch(_facts, "of", _on_device(_facts.of))
        name = executor or _executor.choose()[0]
        log.executor = name
        module = _executor.module_of(name)
        if module is not None:
            module.set_recorder(_c_recorder() if keep else None, keep)
            log.module = module
        patch(_executor, "run", _executor.runner(name))
        try:
            yield log
        finally:
            if module is not None:
                log.counted += module.launches() if not keep else 0
                log.module = None
                module.set_recorder(None, True)
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        _plans.clear_plans()
        _lock.release()


def _c_recorder() -> Any:
    """The compiled executor's hook: ``(entry, grid, grid_y, params)`` of each launch."""

    def record(entry: Any, grid: int, grid_y: int, params: bytes) -> None:
        entry.launcher.record(grid, grid_y, params)

    return record
