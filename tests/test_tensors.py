"""The tensor adapter on the CPU: the torch fast path reads what DLPack would carry; numpy arrays
read what numpy itself reports."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from zerokv.core import tensors as _tensors

TORCH_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.bool,
)


def _filled(shape, dtype) -> torch.Tensor:
    return torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape).to(dtype)


def _facts(t: _tensors.Tensor) -> tuple:
    return t.ptr, t.shape, t.strides, t.dtype, t.device


def _torch_cases() -> dict[str, torch.Tensor]:
    base = _filled((5, 6), torch.float32)
    cases = {f"contiguous-{str(d).removeprefix('torch.')}": _filled((3, 4), d) for d in TORCH_DTYPES}
    cases.update(
        {
            "view": base.view(6, 5),
            "rows-from-1": base[1:],
            "cols-from-2": base[:, 2:],
            "every-3rd-row": _filled((10, 4), torch.float32)[::3],
            "transpose": base.T,
            "permute-4d": _filled((2, 3, 4, 5), torch.bfloat16).permute(1, 0, 3, 2),
            "padded-heads": _filled((7, 4, 80), torch.float16)[:, :, :72],
            "lse-T-view": _filled((4, 9), torch.float32).T,
            "expand-rows": _filled((1, 6), torch.float32).expand(4, 6),
            "expand-cols": _filled((6,), torch.float16)[:, None].expand(6, 3),
            "zero-size": torch.empty(0, 4),
            "zero-size-middle": torch.empty(3, 0, 5, dtype=torch.bfloat16),
            "one-element": torch.ones(1),
            "one-element-3d": torch.ones(1, 1, 1, dtype=torch.int64),
            "zero-d": torch.tensor(3.0),
        }
    )
    return cases


TORCH_CASES = _torch_cases()


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_fast_path_matches_dlpack(name):
    t = TORCH_CASES[name]
    fast = _tensors.torch_view(t)
    slow = _tensors.dlpack_view(t)
    assert _facts(fast) == _facts(slow)
    assert fast.is_torch and not slow.is_torch
    assert fast.obj is t and slow.obj is t
    # and both are what torch itself says
    assert fast.shape == tuple(t.shape)
    assert fast.strides == t.stride()
    assert fast.dtype == str(t.dtype).removeprefix("torch.")
    assert fast.device == -1
    assert fast.numel == t.numel()
    if t.numel():
        assert fast.ptr == t.data_ptr()


def test_view_dispatches_torch_to_the_fast_path():
    t = _filled((4, 6), torch.bfloat16)[1:, 2:]
    v = _tensors.view(t, "x")
    assert v.is_torch
    assert _facts(v) == _facts(_tensors.dlpack_view(t))


def test_torch_fast_path_reads_tensors_dlpack_refuses():
    t = torch.ones(3, 4, requires_grad=True)
    with pytest.raises((BufferError, RuntimeError), match="require gradient"):
        _tensors.dlpack_view(t)
    v = _tensors.view(t, "x")
    assert (v.ptr, v.shape, v.strides, v.dtype) == (t.data_ptr(), (3, 4), (4, 1), "float32")


def test_offsets_are_in_elements():
    t = _filled((5, 6), torch.float16)
    for view in (t[1:], t[:, 2:], t[2:, 3:]):
        assert _tensors.view(view, "x").ptr - t.data_ptr() == view.storage_offset() * t.element_size()
        assert _tensors.dlpack_view(view).ptr == _tensors.view(view, "x").ptr


# --- numpy ------------------------------------------------------------------------------------


def _numpy_cases() -> dict[str, np.ndarray]:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    return {
        "float16": a.astype(np.float16),
        "bfloat16": a.astype(ml_dtypes.bfloat16),
        "float32": a,
        "float64": a.astype(np.float64),
        "int32": np.arange(5, dtype=np.int32),
        "int64": np.arange(5, dtype=np.int64),
        "bool": np.ones(3, dtype=bool),
        "rows-from-1": a[1:],
        "cols-from-2": a[:, 2:],
        "transpose": a.T,
        "reversed": a[::-1],
        "broadcast": np.broadcast_to(np.arange(6, dtype=np.float32), (4, 6)),
        "zero-size": np.empty((0, 4), np.float32),
        "one-element": np.ones(1, np.float32),
        "zero-d": np.array(3.0, np.float32),
    }


NUMPY_CASES = _numpy_cases()


@pytest.mark.parametrize("name", list(NUMPY_CASES))
def test_numpy_view_matches_array_interface(name):
    a = NUMPY_CASES[name]
    v = _tensors.view(a, "x")
    ai = a.__array_interface__
    assert v.ptr == ai["data"][0]
    assert v.shape == ai["shape"]
    byte_strides = ai["strides"] if ai["strides"] is not None else a.strides  # None: C-contiguous
    assert v.strides == tuple(s // a.itemsize for s in byte_strides)
    assert np.dtype(ai["typestr"]).itemsize == a.itemsize
    assert v.dtype == a.dtype.name
    assert v.device == -1 and not v.is_torch and v.obj is a


@pytest.mark.parametrize("name", [n for n in NUMPY_CASES if n not in ("bfloat16", "broadcast")])
def test_numpy_view_matches_numpys_dlpack(name):
    """numpy exports DLPack too (not bfloat16, not read-only arrays): same facts either way."""
    a = NUMPY_CASES[name]
    assert _facts(_tensors.view(a, "x")) == _facts(_tensors.dlpack_view(a))


def test_view_of_a_non_tensor_names_the_argument():
    with pytest.raises(TypeError, match=r"\bx\b.*object"):
        _tensors.view(object(), "x")
    with pytest.raises(TypeError, match="v_a"):
        _tensors.view([1.0, 2.0], "v_a")
