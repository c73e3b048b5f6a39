"""float -> fp8 e4m3 in kernels_cu/common.cuh: the software conversion (below sm_89) against
ml_dtypes on the CPU, and against the hardware instruction over every float32 on a GPU."""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import oracles
import pytest
import torch
from conftest import assert_close, f64
from states import make_states

import zerokv
from zerokv import reference
from zerokv.core import compiler as _compiler
from zerokv.core import device as _device
from zerokv.core import plans as _plans
from zerokv.core import sources as _sources

ml_dtypes = pytest.importorskip("ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn


def software_e4m3(bits: np.ndarray) -> np.ndarray:
    """The algorithm of ``fp8_e4m3_software`` step by step, on float32 bit patterns (uint32)."""
    u = bits.astype(np.uint64)  # room for the shifts below
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = (a >> 23).astype(np.int64) - 127
    m = (a & 0x7FFFFF) | 0x800000
    normal = e >= -6
    shift = np.where(normal, 20, np.clip(14 - e, 21, 24)).astype(np.uint64)
    out = np.where(normal, (np.clip(e + 7, 0, 15).astype(np.uint64) << 3) | ((m >> 20) & 7), m >> shift)
    rest = m & ((np.uint64(1) << shift) - 1)
    half = np.uint64(1) << (shift - 1)
    out = out + ((rest > half) | ((rest == half) & ((out & 1) == 1))).astype(np.uint64)
    out = sign | out
    out = np.where(a <= 0x3A800000, sign, out)  # <= 2^-10: +-0
    out = np.where(a >= 0x43E00000, sign | 0x7E, out)  # >= 448 and inf: saturate
    out = np.where(a > 0x7F800000, 0x7F, out)  # NaN
    return out.astype(np.uint8)


def satfinite_e4m3(bits: np.ndarray) -> np.ndarray:
    """ml_dtypes' e4m3fn (round to nearest even; overflow and inf give NaN there), with the
    instruction's saturation applied first: +-inf and finite values beyond +-448 give +-448."""
    f = bits.view(np.float32)
    clipped = np.where(np.isnan(f), f, np.clip(f, -448.0, 448.0)).astype(np.float32)
    with np.errstate(invalid="ignore"):  # NaN inputs
        return clipped.astype(E4M3).view(np.uint8)


def interesting_bits() -> np.ndarray:
    """Both signs, every exponent, every leading 4 fraction bits, and low fraction bits at and
    around every rounding tie (exact ties, one above, one below, all ones), plus random ones."""
    rng = np.random.default_rng(11)
    lows = [0, 1, 0x7FFFF, 0xFFFFF, 0x3FFFFF, 0x7FFFFF & ~0xFFFFF]
    for k in range(23):
        lows += [1 << k, (1 << k) - 1, (1 << k) + 1]
    lows += list(rng.integers(0, 1 << 23, 16))
    lows = np.unique(np.array(lows, dtype=np.uint32) & 0x7FFFFF)
    heads = np.arange(1 << 13, dtype=np.uint32) << 19  # sign, exponent, top 4 fraction bits
    grid = (heads[:, None] | (lows[None, :] & 0x7FFFF)).ravel()
    lead = (heads[:, None] | lows[None, :]).ravel()  # the 4 leading bits overwritten too
    rand = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.unique(np.concatenate([grid, lead, rand]))


def test_software_model_matches_ml_dtypes_with_saturation():
    bits = interesting_bits()
    assert bits.size > 500_000
    ours, theirs = software_e4m3(bits), satfinite_e4m3(bits)
    f = bits.view(np.float32)
    nan = np.isnan(f)
    assert (ours[nan] == 0x7F).all()  # the one NaN the instruction writes, whatever the sign
    assert (theirs[nan] & 0x7F == 0x7F).all()
    bad = ~nan & (ours != theirs)
    assert not bad.any(), [
        (hex(b), f"{x:.9g}", hex(o), hex(t))
        for b, x, o, t in zip(bits[bad][:8], f[bad][:8], ours[bad][:8], theirs[bad][:8], strict=True)
    ]


def test_the_oracles_e4m3_table_rounds_as_ml_dtypes_with_saturation():
    """``oracles.e4m3`` (the nearest entry of the table built from the format's definition)
    agrees with ml_dtypes, saturated, on every interesting float32."""
    bits = interesting_bits()
    f = bits.view(np.float32)
    nan = np.isnan(f)
    with np.errstate(invalid="ignore"):  # signalling NaNs among the inputs
        ours = oracles.e4m3(f)
    theirs = satfinite_e4m3(bits).view(E4M3).astype(np.float64)
    assert np.isnan(ours[nan]).all()
    bad = ~nan & (ours != theirs)
    assert not bad.any(), [
        (f"{x:.9g}", o, t) for x, o, t in zip(f[bad][:8], ours[bad][:8], theirs[bad][:8], strict=True)
    ]
    assert (np.signbit(ours[~nan]) == np.signbit(theirs[~nan])).all()


def test_software_model_edges():
    cases = [  # (float, e4m3 bits); a list: 0.0 and -0.0 are one dict key
        (0.0, 0x00),
        (-0.0, 0x80),
        (448.0, 0x7E),
        (-448.0, 0xFE),
        (464.0, 0x7E),
        (1e30, 0x7E),
        (float("inf"), 0x7E),
        (float("-inf"), 0xFE),
        (float("nan"), 0x7F),
        (-float("nan"), 0x7F),
        (2.0**-6, 0x08),
        (2.0**-9, 0x01),
        (-(2.0**-9), 0x81),
        (2.0**-10, 0x00),  # a tie to even: 0
        (2.0**-10 * (1 + 2**-23), 0x01),
        (3 * 2.0**-10, 0x02),  # 1.5 steps: a tie, to even (2)
        (1.0, 0x38),
        (1.0625, 0x38),
        (1.0625 * (1 + 2**-23), 0x39),
        (1.1875, 0x3A),  # ties to even
        (432.0, 0x7E),
        (431.9, 0x7D),
        (1e-45, 0x00),
        (-1e-45, 0x80),  # the last two: float denormals
    ]
    x = np.array([c[0] for c in cases], dtype=np.float32)
    assert software_e4m3(x.view(np.uint32)).tolist() == [c[1] for c in cases]


# --- the CUDA source: which conversion each arch compiles --------------------------------------


def _ptx(arch: str, code: str) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    _, prog = nvrtc.nvrtcCreateProgram(code.encode(), b"fp8_probe.cu", 0, [], [])
    try:
        opts = [f"-arch=compute_{arch}".encode(), b"-ftz=true", *(o.encode() for o in _sources.NVRTC_OPTIONS)]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, res
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _common() -> str:
    return (_sources.kernel_dir() / "common.cuh").read_text().replace("#pragma once\n", "")


PROBE = r"""
extern "C" __global__ void fp8_probe(const float* x, unsigned char* y) {
  y[threadIdx.x] = from_float<zk_fp8_e4m3>(x[threadIdx.x]).bits;
}
"""


@pytest.mark.parametrize(
    ("arch", "define", "hardware"),
    [
        ("80", "", False),
        ("86", "", False),
        ("89", "", True),
        ("90", "", True),
        ("90", "#define ZK_FP8_SOFTWARE\n", False),
    ],
)
def test_each_arch_compiles_the_right_conversion(arch, define, hardware):
    ptx = _ptx(arch, define + _common() + PROBE)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == hardware
    assert re.search(r"\.entry\s+fp8_probe", ptx)


# --- on a GPU: the software conversion against the instruction, every float32 ------------------

COMPARE = r"""
// Every float32 bit pattern from base on, made with no floating-point operation, so denormal
// inputs reach both conversions as they are (-ftz=true flushes only arithmetic results).
extern "C" __global__ void fp8_compare(unsigned long long base, unsigned long long n,
                                       unsigned long long* mismatches, unsigned* first) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const unsigned bits = (unsigned)(base + i);
    const float f = __uint_as_float(bits);
    const unsigned char sw = fp8_e4m3_software(f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const unsigned char hw = fp8_e4m3_hardware(f);
    const unsigned char used = from_float<zk_fp8_e4m3>(f).bits;  // what the merge kernels call
    if (sw != hw || used != hw) {
      const unsigned long long k = atomicAdd(mismatches, 1ULL);
      if (k < 16) { first[3 * k] = bits; first[3 * k + 1] = sw; first[3 * k + 2] = hw; }
    }
#endif
  }
}

// The software conversion at explicit inputs (any arch), for the CPU model.
extern "C" __global__ void fp8_software(const unsigned* bits, unsigned char* out, unsigned long long n) {
  const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fp8_e4m3_software(__uint_as_float(bits[i]));
}
"""


def _gpu_module():
    cupy = pytest.importorskip("cupy")
    return cupy, cupy.RawModule(code=_common() + COMPARE, options=_sources.NVRTC_OPTIONS)


@pytest.mark.parametrize("arch", ["80", "90"])
def test_the_gpu_tests_kernels_compile(arch):
    ptx = _ptx(arch, _common() + COMPARE)
    assert re.search(r"\.entry\s+fp8_compare", ptx) and re.search(r"\.entry\s+fp8_software", ptx)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (arch == "90")


@pytest.mark.gpu
def test_gpu_software_conversion_matches_the_cpu_model():
    cupy, mod = _gpu_module()
    bits = interesting_bits()
    out = cupy.full(bits.size, 0xAA, dtype=cupy.uint8)  # poison: 0xAA is no result of these inputs
    n = bits.size
    mod.get_function("fp8_software")(((n + 255) // 256,), (256,), (cupy.asarray(bits), out, np.uint64(n)))
    got = cupy.asnumpy(out)
    expected = software_e4m3(bits)
    bad = got != expected
    assert not bad.any(), [
        (hex(b), hex(g), hex(e))
        for b, g, e in zip(bits[bad][:8], got[bad][:8], expected[bad][:8], strict=True)
    ]


@pytest.mark.gpu
def test_gpu_software_and_hardware_conversions_agree_on_every_float32():
    cupy, mod = _gpu_module()
    major, minor = _device.capability(torch.cuda.current_device())
    if (major, minor) < (8, 9):
        pytest.skip(f"the e4m3 instruction needs sm_89+ (this GPU: sm_{major}{minor})")
    kernel = mod.get_function("fp8_compare")
    mismatches = cupy.zeros(1, dtype=cupy.uint64)
    first = cupy.zeros(48, dtype=cupy.uint32)
    chunk = 1 << 30
    blocks = 32 * _device.sm_count(torch.cuda.current_device())
    for base in range(0, 1 << 32, chunk):  # four launches; the count stays on the device
        kernel((blocks,), (256,), (np.uint64(base), np.uint64(chunk), mismatches, first))
    count = int(mismatches.get()[0])
    examples = cupy.asnumpy(first).reshape(16, 3)[: min(count, 16)]
    assert count == 0, f"{count} mismatches; (float bits, software, hardware): " + ", ".join(
        f"({b:#010x}, {s:#04x}, {h:#04x})" for b, s, h in examples
    )


@pytest.mark.gpu
def test_fp8_merge_output_is_the_same_through_both_paths(monkeypatch):
    """The merge's fp8 output through the instruction and through the software conversion
    (ZK_FP8_SOFTWARE prepended to the source): bit-identical, and within one fp8 step of the
    float64 reference."""
    fp8 = torch.float8_e4m3fn
    v_a, s_a, v_b, s_b = make_states(777, 8, 72, torch.bfloat16, "cuda", seed=23, edges=False)
    scale = torch.tensor([1 / 64], device="cuda")

    def run():
        out = torch.full((777, 8, 72), float("nan"), device="cuda").to(fp8)  # NaN poison: 0x7f
        zerokv.merge_state(v_a, s_a, v_b, s_b, out=out, out_scale=scale)
        torch.cuda.synchronize()
        return out

    first = run()
    _plans.clear_cache()
    kernel_source = _sources.kernel_source
    monkeypatch.setattr(_sources, "kernel_source", lambda k: "#define ZK_FP8_SOFTWARE 1\n" + kernel_source(k))
    built = _compiler._modules_built
    try:
        second = run()
        assert _compiler._modules_built > built, "the software path was not compiled: a launch was reused"
    finally:
        monkeypatch.undo()
        _plans.clear_cache()
    assert torch.equal(first.view(torch.uint8), second.view(torch.uint8))
    ref, _ = reference.merge_state(*(f64(x) for x in (v_a, s_a, v_b, s_b)))
    expected = torch.from_numpy(np.clip(ref * 64, -448, 448)).float()
    assert not second.float().isnan().any()
    torch.testing.assert_close(second.float().cpu(), expected, rtol=1 / 16, atol=2**-9)


# --- per-group fp8 output (vLLM's rule) on the CPU path, against a hand-written computation ----


def _f32(x: float) -> float:
    """x rounded to float32 (to nearest, ties to even), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _e4m3_table() -> list[tuple[float, int]]:
    """Every finite non-negative e4m3 value with its bits, from the format's definition."""
    table = []
    for bits in range(0x7F):  # 0x7f is NaN
        e, m = bits >> 3, bits & 7
        table.append((m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), bits))
    return table


E4M3_TABLE = _e4m3_table()


def _to_e4m3(q: float) -> float:
    """The nearest e4m3 value to q (ties to the even bit pattern), saturating at 448."""
    if math.isnan(q):
        return math.nan
    a = min(abs(q), 448.0)
    best = min(E4M3_TABLE, key=lambda vb: (abs(vb[0] - a), vb[1] & 1))
    return math.copysign(best[0], q)


def _hand_group_fp8(x: np.ndarray, group: int, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-group rule in plain Python floats, one group at a time."""
    T, H, D = x.shape
    values = np.zeros((T, H, D))
    scales = np.zeros((T, H * D // group))
    for t in range(T):
        for h in range(H):
            for g in range(D // group):
                xs = [_f32(float(v)) for v in x[t, h, g * group : (g + 1) * group]]
                absmax = max(abs(v) for v in xs)
                scale = _f32(max(absmax, _f32(1e-10)) / 448.0)
                if ue8m0:
                    scale = 2.0 ** math.ceil(math.log2(scale))
                scales[t, h * (D // group) + g] = scale
                for i, v in enumerate(xs):
                    values[t, h, g * group + i] = _to_e4m3(_f32(v / scale))
    return values, scales


@pytest.mark.parametrize("group", [16, 32, 64])
@pytest.mark.parametrize("fmt", ["float32", "ue8m0"])
@pytest.mark.parametrize("layout", ["rows", "cols", "padded"])
def test_cpu_group_fp8_matches_a_hand_written_computation(group, fmt, layout):
    T, H, D = 5, 3, 64
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.float32, seed=31, edges=False)
    v_a = v_a * torch.logspace(-3, 3, D)  # groups of very different magnitudes
    s_a[1, 2] = float("-inf")
    s_b[1, 2] = float("inf")  # an empty row: zeros and the smallest scale
    v_a[1, 2] = float("nan")
    G = H * D // group
    bs = {"rows": torch.full((T, G), float("nan")), "cols": torch.full((G, T), float("nan")).T,
          "padded": torch.full((T, G + 2), float("nan"))[:, :G]}[layout]  # fmt: skip
    out = torch.full((T, H, D), float("nan")).to(torch.float8_e4m3fn)
    lse = torch.full((T, H), float("nan"))
    zerokv.merge_state(
        v_a, s_a, v_b, s_b, out=out, out_lse=lse, out_block_scale=bs, quant_group=group, scale_format=fmt
    )
    merged, want_lse = oracles.merge2(v_a, s_a, v_b, s_b)
    values, scales = _hand_group_fp8(merged, group, fmt == "ue8m0")
    assert np.array_equal(f64(out), values)
    assert np.array_equal(f64(bs), scales)
    # the empty row (token 1, head 2): zeros, and the smallest scale in each of its groups
    smallest = _f32(_f32(1e-10) / 448)  # 2.2e-13, in (2^-43, 2^-42]: ue8m0 rounds it up to 2^-42
    assert 2.0**-43 < smallest <= 2.0**-42
    per_head = D // group
    assert (f64(out)[1, 2] == 0).all()
    assert (f64(bs)[1, 2 * per_head : 3 * per_head] == (2.0**-42 if fmt == "ue8m0" else smallest)).all()
    assert_close(lse, want_lse, torch.float32, "LSE")
    r_values, r_scales = reference.fp8_group_scales(merged, group, fmt == "ue8m0")  # the reference's rule
    assert np.array_equal(r_values, values) and np.array_equal(r_scales, scales)
    o_values, o_scales = oracles.group_fp8(merged, group, fmt == "ue8m0")  # the oracle's, vectorised
    assert np.array_equal(o_values, values) and np.array_equal(o_scales, scales)


def test_cpu_group_fp8_through_merge_states():
    T, H, D = 4, 2, 32
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.bfloat16, seed=32, edges=True)
    out = torch.zeros(T, H, D).to(torch.float8_e4m3fn)
    bs = torch.zeros(T, H * D // 16)
    zerokv.merge_states(
        torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), out=out, out_block_scale=bs, quant_group=16
    )
    merged, _ = oracles.merge2(v_a, s_a, v_b, s_b)
    values, scales = _hand_group_fp8(merged, 16, False)
    assert np.array_equal(f64(out), values, equal_nan=True) and np.array_equal(
        f64(bs), scales, equal_nan=True
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quant_group": 128}, "quant_group"),  # no out_block_scale
        ({"out_block_scale": "bs"}, "quant_group: required"),
        ({"out_block_scale": "bs", "quant_group": 24}, "power of two"),
        ({"out_block_scale": "bs", "quant_group": 256}, "power of two"),
        ({"out_block_scale": "bs8", "quant_group": 8}, "power of two"),
        ({"out_block_scale": "bs", "quant_group": 32, "scale_format": "e8m0"}, "scale_format"),
        ({"out_block_scale": "bs", "quant_group": 32, "out_scale": "one"}, "give one fp8 scale"),
        ({"out_block_scale": "bs", "quant_group": 32, "out": "bf16"}, "float8_e4m3fn"),
        ({"out_block_scale": "bad_shape", "quant_group": 32}, "out_block_scale"),
        ({"out_block_scale": "f16", "quant_group": 32}, "out_block_scale"),
        ({"out_block_scale": "bs", "quant_group": 32, "sinks": "sinks"}, "does not combine"),
        ({"out_block_scale": "alias", "quant_group": 32}, "out_block_scale"),
    ],
)
def test_cpu_group_fp8_rejects_bad_arguments_and_writes_nothing(kwargs, match):
    T, H, D = 3, 2, 64
    v_a, s_a, v_b, s_b = make_states(T, H, D, torch.float32, seed=33, edges=False)
    out = torch.zeros(T, H, D).to(torch.float8_e4m3fn)
    lse = torch.zeros(T, H)
    made = {
        "bs": torch.zeros(T, H * D // 32), "bs8": torch.zeros(T, H * D // 8), "one": torch.ones(1),
        "bf16": torch.zeros(T, H, D, dtype=torch.bfloat16), "bad_shape": torch.zeros(T, 3),
        "f16": torch.zeros(T, H * D // 32, dtype=torch.float16), "sinks": torch.zeros(H),
        "alias": lse.view(-1)[: T * 2].view(T, 2)[:, :1].expand(T, H * D // 32),
    }  # fmt: skip
    args = {k: made.get(v, v) if isinstance(v, str) and k != "scale_format" else v for k, v in kwargs.items()}
    args.setdefault("out", out)
    before = [x.clone() for x in (out.view(torch.uint8), lse)]
    with pytest.raises((TypeError, ValueError), match=match):
        zerokv.merge_state(v_a, s_a, v_b, s_b, out_lse=lse, **args)
    assert torch.equal(out.view(torch.uint8), before[0]) and torch.equal(lse, before[1])


def test_cpu_group_fp8_of_three_states_with_sinks():
    T, H, D = 4, 2, 32
    g = torch.Generator().manual_seed(34)
    v, s = torch.randn(3, T, H, D, generator=g), torch.randn(3, T, H, generator=g)
    s[1, 0] = float("-inf")
    v[1, 0] = float("nan")
    sinks = torch.randn(H, generator=g)
    out = torch.zeros(T, H, D).to(torch.float8_e4m3fn)
    bs = torch.zeros(H * D // 16, T).T
    zerokv.merge_states(v, s, out=out, sinks=sinks, out_block_scale=bs, quant_group=16, scale_format="ue8m0")
    merged, _ = oracles.merge(v, s, sinks=sinks)
    values, scales = _hand_group_fp8(merged, 16, True)
    assert np.array_equal(f64(out), values) and np.array_equal(f64(bs), scales)


def test_fp8_saturation_is_the_formats_largest_finite_value():
    """The dtype table's saturation column, the reference's constant and ml_dtypes' largest
    finite e4m3fn agree (the table feeds the kernels' checks; the reference is its own oracle)."""
    from zerokv.core import dtypes as _dtypes

    top = float(ml_dtypes.finfo(E4M3).max)
    assert _dtypes.TABLE["float8_e4m3fn"].saturate == top == reference.FP8_E4M3_MAX
