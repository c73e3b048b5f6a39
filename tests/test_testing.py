"""zerokv.testing.record_launches: CPU torch tensors down the GPU path, each launch recorded with
its kernel, grid and parameters by name, or only counted; outside the block the CPU path."""

from __future__ import annotations

import pytest
import torch

import zerokv
import zerokv.testing as zt
from zerokv.compat import vllm

T, H, D = 37, 4, 64


def _states(T=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = [torch.randn(T, H, D, generator=g).to(torch.bfloat16) for _ in range(2)]
    s = [torch.randn(T, H, generator=g) for _ in range(2)]
    return v[0], s[0], v[1], s[1]


def test_a_merge_is_recorded_with_its_arguments_by_name_and_nothing_written():
    v_a, s_a, v_b, s_b = _states()
    out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16)
    out_lse = torch.full((T, H), float("nan"))
    with zt.record_launches() as log:
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    (launch,) = log.launches
    assert log.count == 1 and log.executor in ("c", "python")
    assert launch.kernel.startswith("merge_") and "zk_bfloat16" in launch.kernel
    p = launch.params
    assert (p["va"], p["vb"], p["sa"], p["sb"], p["out"], p["olse"]) == tuple(
        x.data_ptr() for x in (v_a, v_b, s_a, s_b, out, out_lse)
    )
    assert p["H"] == H and p["va_st"] == H * D and p["sa_st"] == H
    assert launch.block[0] > 0 and launch.grid[0] > 0
    assert out.isnan().all() and out_lse.isnan().all()  # recorded, not run


def test_a_new_t_every_call_is_recorded_with_that_t():
    with zt.record_launches() as log:
        for t in (5, 300, 17):
            v_a, s_a, v_b, s_b = _states(t, seed=t)
            zerokv.merge_state(v_a, s_a, v_b, s_b, out=torch.empty(t, H, D, dtype=torch.bfloat16))
    assert [launch.params.get("prefix_rows") for launch in log.launches] == [5, 300, 17]


def test_launches_only_counted_and_the_cpu_path_outside():
    v_a, s_a, v_b, s_b = _states()
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    with zt.record_launches(keep=False) as log:
        for _ in range(7):
            zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)
        vllm.merge_attn_states(out, v_a, s_a.T.contiguous(), v_b, s_b.T.contiguous(), None)
        zerokv.fixup_zero_kv_rows(out, s_a.clone(), torch.tensor([0, 3]), torch.tensor([0, 5, T]))
    assert log.count == 9 and log.launches == []
    out.fill_(float("nan"))
    zerokv.merge_state(v_a, s_a, v_b, s_b, out=out)  # outside: the float64 reference writes it
    assert not out.isnan().any()


@pytest.mark.parametrize("executor", ["python", None])
def test_the_executor_can_be_chosen(executor):
    v_a, s_a, v_b, s_b = _states()
    with zt.record_launches(executor=executor) as log:
        zerokv.merge_state(v_a, s_a, v_b, s_b)
    assert log.count == 1
    assert log.executor == (executor or zerokv.launcher()[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"executor": "cuda"}, ValueError, "executor must be"),
        ({"keep": 1}, TypeError, "keep must be a bool"),
        ({"sm_count": 0}, ValueError, "sm_count must be a positive int"),
        ({"l2_bytes": 1.5}, ValueError, "l2_bytes must be a positive int"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match), zt.record_launches(**kwargs):
        pass


def test_a_rejected_call_records_nothing():
    v_a, s_a, v_b, s_b = _states()
    with zt.record_launches() as log, pytest.raises(ValueError, match="s_b"):
        zerokv.merge_state(v_a, s_a, v_b, s_b[:-1])
    assert log.count == 0


def test_the_gpu_size_chooses_the_grid():
    """The empty-rows kernel's persistent grid is a whole number of blocks per multiprocessor
    of the GPU given, the same number for any size of GPU."""
    T_ = 4096
    v, s = torch.randn(T_, H, D).to(torch.bfloat16), torch.randn(T_, H)
    per_sm = []
    for sms in (132, 16, 7):
        with zt.record_launches(sm_count=sms) as log:
            zerokv.fixup_zero_kv_rows(v, s, torch.tensor([0, 3]), torch.tensor([0, 5, T_]))
        (launch,) = log.launches
        assert launch.grid[0] % sms == 0 and launch.params["T"] == T_
        per_sm.append(launch.grid[0] // sms)
    assert per_sm[0] == per_sm[1] == per_sm[2] >= 1
