// Shared device helpers for every zerokv kernel.
//
// No CUDA headers are included: 16-bit floats are carried as raw bits and converted
// with single PTX instructions, so NVRTC compiles these sources without cuda_fp16.h /
// cuda_bf16.h on any machine (CI included), and a compile takes a fraction of a second.
#pragma once

typedef long long i64;

struct zk_half { unsigned short bits; };
struct zk_bfloat16 { unsigned short bits; };
struct zk_fp8_e4m3 { unsigned char bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(zk_half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(zk_bfloat16 x) {
  return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ zk_half from_float<zk_half>(float f) {
  zk_half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ zk_bfloat16 from_float<zk_bfloat16>(float f) {
  zk_bfloat16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
// float -> e4m3 (fp8) as `cvt.rn.satfinite.e4m3x2.f32` does it: round to nearest even, finite
// values and +-inf saturate to +-448, NaN gives 0x7f. The instruction exists from sm_89; below
// that (A100, A10, RTX 30) the same conversion runs in integer arithmetic on the float's bits, so
// -ftz=true cannot touch it (a float denormal is far below half the smallest e4m3 step: +-0).
__device__ __forceinline__ unsigned char fp8_e4m3_software(float f) {
  const unsigned u = __float_as_uint(f);
  const unsigned sign = (u >> 24) & 0x80u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;                  // NaN, whatever its sign
  if (a >= 0x43e00000u) return sign | 0x7e;          // >= 448 (inf included): saturate
  if (a <= 0x3a800000u) return sign;                 // <= 2^-10: a tie at most, to even: +-0
  const int e = (int)(a >> 23) - 127;                // unbiased exponent, -10 <= e <= 8
  unsigned m = (a & 0x7fffffu) | 0x800000u;          // 24-bit significand
  unsigned bits, shift;
  if (e >= -6) {                                     // e4m3 normal: keep 3 fraction bits
    shift = 20;
    bits = ((unsigned)(e + 7) << 3) | ((m >> 20) & 7u);
  } else {                                           // e4m3 denormal: units of 2^-9
    shift = (unsigned)(14 - e);                      // 21..24
    bits = m >> shift;
  }
  const unsigned rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  bits += (rest > half || (rest == half && (bits & 1u))) ? 1u : 0u;  // a carry moves the exponent
  return (unsigned char)(sign | bits);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ __forceinline__ unsigned char fp8_e4m3_hardware(float f) {
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
  return (unsigned char)(pair & 0xff);
}
#endif

// ZK_FP8_SOFTWARE (defined by a test) takes the software path on any GPU.
template <> __device__ __forceinline__ zk_fp8_e4m3 from_float<zk_fp8_e4m3>(float f) {
  zk_fp8_e4m3 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(ZK_FP8_SOFTWARE)
  r.bits = fp8_e4m3_hardware(f);
#else
  r.bits = fp8_e4m3_software(f);
#endif
  return r;
}

// VEC consecutive elements moved as one aligned access (16 bytes for the widest input).
template <typename T, int VEC>
struct __align__(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Packs move through memory as one access of their full width (16, 8, 4 or 2 bytes): built
// from 16-bit fields, a pack would otherwise be stored field by field.
template <int BYTES> struct Word;
template <> struct Word<16> { typedef uint4 type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<4> { typedef unsigned type; };
template <> struct Word<2> { typedef unsigned short type; };
template <> struct Word<1> { typedef unsigned char type; };

// RO: through the read-only (non-coherent) cache path, for data no thread of the kernel writes
// before this thread reads it (in-place merges write a pack only after its one read).
template <typename T, int VEC, bool RO = false>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  constexpr int B = sizeof(Pack<T, VEC>);
  Pack<T, VEC> r;
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) {
      if constexpr (RO) {
        reinterpret_cast<uint4*>(&r)[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
      } else {
        reinterpret_cast<uint4*>(&r)[i] = reinterpret_cast<const uint4*>(p)[i];
      }
    }
  } else {
    typedef typename Word<B>::type W;
    if constexpr (RO) {
      *reinterpret_cast<W*>(&r) = __ldg(reinterpret_cast<const W*>(p));
    } else {
      *reinterpret_cast<W*>(&r) = *reinterpret_cast<const W*>(p);
    }
  }
  return r;
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& x) {
  constexpr int B = sizeof(Pack<T, VEC>);
  if constexpr (B % 16 == 0) {  // one st.global.v4 per 16 bytes (the compiler alone may split it)
    const unsigned* w = reinterpret_cast<const unsigned*>(&x);
#pragma unroll
    for (int i = 0; i < B / 16; ++i)
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<char*>(p) + 16 * i),
                   "r"(w[4 * i]), "r"(w[4 * i + 1]), "r"(w[4 * i + 2]), "r"(w[4 * i + 3])
                   : "memory");
  } else if constexpr (B == 8) {
    const unsigned* w = reinterpret_cast<const unsigned*>(&x);
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  } else {
    *reinterpret_cast<typename Word<B>::type*>(p) = *reinterpret_cast<const typename Word<B>::type*>(&x);
  }
}

// store_pack as predicated instructions: no branch for the compiler to build around the store
// (straight-line code is what small, latency-bound kernels run fastest).
template <typename T, int VEC>
__device__ __forceinline__ void store_pack_if(bool pred, T* p, const Pack<T, VEC>& x) {
  constexpr int B = sizeof(Pack<T, VEC>);
  const unsigned* w = reinterpret_cast<const unsigned*>(&x);
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i)
      asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n @q st.global.v4.u32 [%0], {%1, %2, %3, %4};\n}"
                   ::"l"(reinterpret_cast<char*>(p) + 16 * i), "r"(w[4 * i]), "r"(w[4 * i + 1]), "r"(w[4 * i + 2]),
                   "r"(w[4 * i + 3]), "r"((int)pred) : "memory");
  } else if constexpr (B == 8) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q st.global.v2.u32 [%0], {%1, %2};\n}"
                 ::"l"(p), "r"(w[0]), "r"(w[1]), "r"((int)pred) : "memory");
  } else if constexpr (B == 4) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.u32 [%0], %1;\n}"
                 ::"l"(p), "r"(w[0]), "r"((int)pred) : "memory");
  } else if constexpr (B == 2) {
    const unsigned short u = *reinterpret_cast<const unsigned short*>(&x);
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.u16 [%0], %1;\n}"
                 ::"l"(p), "h"(u), "r"((int)pred) : "memory");
  } else {
    static_assert(B == 1, "a pack of 1, 2, 4, 8 or 16k bytes");
    const unsigned short u = *reinterpret_cast<const unsigned char*>(&x);
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.u8 [%0], %1;\n}"
                 ::"l"(p), "h"(u), "r"((int)pred) : "memory");
  }
}

// base[i] = x when pred, as one predicated store. The address is formed as an integer: base may be
// null when pred is false.
__device__ __forceinline__ void store_float_if(bool pred, float* base, i64 i, float x) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(base) + 4ull * (unsigned long long)i;
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.global.f32 [%0], %1;\n}"
               ::"l"(a), "f"(x), "r"((int)pred) : "memory");
}

template <typename T> struct is_fp8 { static constexpr bool value = false; };
template <> struct is_fp8<zk_fp8_e4m3> { static constexpr bool value = true; };

template <typename T> struct is_bf16 { static constexpr bool value = false; };
template <> struct is_bf16<zk_bfloat16> { static constexpr bool value = true; };

// A bf16 pack's values as floats, or zeros when !keep, in one byte permutation per value (the
// zero bytes come from the second operand): the widening and the drop of an input that is not
// used (it may hold NaN/Inf, so its bits go, never multiplied by zero) in one instruction.
template <int VEC>
__device__ __forceinline__ void bf16_floats_if(bool keep, const Pack<zk_bfloat16, VEC>& p, float* x) {
  static_assert(VEC % 2 == 0, "whole 32-bit words");
  const unsigned* w = reinterpret_cast<const unsigned*>(p.v);
  const unsigned sel_lo = keep ? 0x1044u : 0x4444u, sel_hi = keep ? 0x3244u : 0x4444u;
#pragma unroll
  for (int j = 0; j < VEC / 2; ++j) {
    x[2 * j] = __uint_as_float(__byte_perm(w[j], 0u, sel_lo));
    x[2 * j + 1] = __uint_as_float(__byte_perm(w[j], 0u, sel_hi));
  }
}

// Two floats to two packed 16-bit values in one instruction (lo in the low half).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<zk_bfloat16>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ unsigned pack2<zk_half>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// VEC floats to a Pack of T: fp8 outputs are scaled (merged / out_scale) and saturated, the
// 16-bit ones converted in pairs, float copied.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> convert_pack(const float* x, float scale) {
  Pack<T, VEC> o;
  if constexpr (is_fp8<T>::value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(ZK_FP8_SOFTWARE)
    if constexpr (VEC % 4 == 0) {  // two values an instruction, built as whole 32-bit words
      unsigned* w = reinterpret_cast<unsigned*>(o.v);  // (as bytes, 20 instructions more a pack of 8)
#pragma unroll
      for (int j = 0; j < VEC / 4; ++j)
        asm("{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
            " cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n mov.b32 %0, {lo, hi};\n}"
            : "=r"(w[j])
            : "f"(x[4 * j] * scale), "f"(x[4 * j + 1] * scale), "f"(x[4 * j + 2] * scale), "f"(x[4 * j + 3] * scale));
      return o;
    }
#endif
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_float<T>(x[j] * scale);
  } else if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
    unsigned* w = reinterpret_cast<unsigned*>(o.v);
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) w[j] = pack2<T>(x[2 * j], x[2 * j + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_float<T>(x[j]);
  }
  return o;
}

// Offsets (cu_seqlens, kv_lens) come as int32 or int64; all index math is 64-bit.
__device__ __forceinline__ i64 load_index(const void* p, int is64, i64 i) {
  return is64 ? static_cast<const i64*>(p)[i] : (i64) static_cast<const int*>(p)[i];
}

// An offset clipped to the rows of the tensor, [0, T]: offsets are trusted for meaning, never
// for memory.
__device__ __forceinline__ i64 clip_row(i64 x, i64 T) { return x < 0 ? 0 : (x > T ? T : x); }

// Whether row t belongs to a request flagged empty by lens[q] == 0. The request is the one a
// binary search over cu (B + 1 entries) finds; for non-decreasing offsets, the r with
// cu[r] <= t < cu[r + 1]. Its span is clipped to [0, T): a row no request covers is not empty.
// B = 0 reads nothing. The CPU path (zerokv/core/cpu_path.py) applies the same search.
__device__ __forceinline__ bool row_in_empty_request(const void* cu, const void* lens, int is64, i64 B, i64 T,
                                                     i64 t) {
  if (B <= 0) return false;
  i64 lo = 0, hi = B;
  while (hi - lo > 1) {
    const i64 mid = (lo + hi) >> 1;
    if (load_index(cu, is64, mid) <= t) lo = mid; else hi = mid;
  }
  const i64 start = clip_row(load_index(cu, is64, lo), T), end = clip_row(load_index(cu, is64, lo + 1), T);
  return start <= t && t < end && load_index(lens, is64, lo) == 0;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }
// An LSE of -inf or +inf marks an empty state (FA2 writes +inf for empty rows).
__device__ __forceinline__ bool is_empty_lse(float s) { return fabsf(s) == __int_as_float(0x7f800000); }

// One-instruction special functions (relative error ~2^-22): the merge needs a handful per row,
// and the full-precision library versions cost more instructions than the row's memory traffic.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// n / d for n < 2^31 by a multiply-high and a shift instead of a division (~25 dependent
// instructions before the first load of a small, latency-bound kernel). mul and shr come from
// the host (zerokv.core.kernels.fast_divisor); mul == 0 stands for d == 1.
__device__ __forceinline__ unsigned fast_div(unsigned n, unsigned mul, int shr) {
  return mul ? __umulhi(n, mul) >> shr : n;
}

// (row / H, row % H) with 32-bit division when the operands allow (the common case).
__device__ __forceinline__ void split_row(i64 row, i64 H, i64 rows, i64& t, i64& h) {
  if (rows <= 0x7fffffffLL) {
    const unsigned q = (unsigned)row / (unsigned)H;
    t = q;
    h = (unsigned)row - q * (unsigned)H;
  } else {
    t = row / H;
    h = row - t * H;
  }
}

