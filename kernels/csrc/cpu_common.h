// Helpers shared by the CPU ops: element conversions (float, bfloat16, int8), whole rows between
// bfloat16 and fp32, AVX-512 loads of 16 values and AVX2 loads of 8 as fp32, and the walk over a block table.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__SSE__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace batchgen_cpu {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float to_f(int8_t x) { return static_cast<float>(x); }

inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(c10::BFloat16* p, int64_t i, float v) {  // round to nearest even, as c10::BFloat16 does
  uint32_t b;
  std::memcpy(&b, &v, 4);
  b += 0x7FFFu + ((b >> 16) & 1u);
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(b >> 16);
}

// Whole rows between bf16 and fp32 (AVX-512 or AVX2 where compiled for it), so math loops can run on
// plain float arrays and vectorise, exp included (libmvec).
inline void row_to_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void row_to_f32(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}
// A row to read as fp32: an fp32 row as it lies, a bf16 one converted into buf (n floats), so fp32
// rows skip the copy.
inline const float* f32_row(const float* p, float*, int64_t) { return p; }
inline const float* f32_row(const c10::BFloat16* p, float* buf, int64_t n) {
  row_to_f32(p, buf, n);
  return buf;
}
inline void row_from_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void row_from_f32(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (; i + 16 <= n; i += 16) {  // round to nearest even
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(b, 16), one)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
#elif defined(__AVX2__)
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  for (; i + 16 <= n; i += 16) {  // round to nearest even; packus keeps lanes, the permute orders them
    const __m256i a = _mm256_castps_si256(_mm256_loadu_ps(src + i)), b = _mm256_castps_si256(_mm256_loadu_ps(src + i + 8));
    const __m256i ra = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(a, 16), one))), 16);
    const __m256i rb = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(ra, rb), 0xD8));
  }
#endif
  for (; i < n; ++i) st(dst, i, src[i]);
}

// Calls f(slot0, count, offset, next_block) for each run of positions [lo, hi) that lies in one
// block of the table: slot0 is the run's first cache slot, offset its first position minus lo,
// next_block the physical block after it (-1 at the end). Walking runs needs no per-token division.
template <typename F>
inline void walk_blocks(const int64_t* table, int64_t lo, int64_t hi, int64_t bs, F&& f) {
  for (int64_t t = lo; t < hi;) {
    const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs);
    f(table[blk] * bs + (t - blk * bs), stop - t, t - lo, stop < hi ? table[blk + 1] : int64_t{-1});
    t = stop;
  }
}

// Flush denormals to zero (FTZ|DAZ) while in scope, on this thread: each denormal operand or
// result costs a microcode assist. Values below 1.2e-38 carry nothing a model needs.
struct FlushDenormals {
#if defined(__SSE__) || defined(__AVX512F__)
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// act(gate) * up, act SiLU or GELU-tanh (Gemma), for 16 lanes: the silu_mul / gelu_tanh_mul ops and the
// dpbf16 GEMM's fused gate/up epilogue compute the same function.
#ifdef __AVX512F__
// silu(g) * u for 16 lanes: g * sigmoid(g), sigmoid through exp(-|g|) and a refined reciprocal.
// libmvec's exp plus a true division made this op compute-bound; a polynomial and a refined
// reciprocal keep it memory-bound.
// exp(x), x <= 0: 2^k * p(r) with x = k ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial
// (relative error < 3e-8 on that range, below fp32's half-ulp).
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);
  const __m512 rr = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

inline __m512 sigmoid16(__m512 x) {
  const __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // exp(-|x|) in (0, 1]
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 inv = _mm512_rcp14_ps(den);  // 14 bits, then one Newton step: ~1 ulp
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  // sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0.
  return _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), inv, e);
}

inline __m512 silu16(__m512 g) { return _mm512_mul_ps(g, sigmoid16(g)); }

// gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3).
inline __m512 gelu_tanh16(__m512 g) {
  const __m512 g2 = _mm512_mul_ps(g, g);
  const __m512 inner = _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g2, _mm512_set1_ps(1.f)));
  return _mm512_mul_ps(g, sigmoid16(_mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608f), inner)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_neg for 8 lanes (no scalef on AVX2: 2^k through the exponent bits).
inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // k >= -126: 2^k stays a normal number
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145752f), x);
  const __m256 rr = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The mask of lanes [0, n) of 8: none for n <= 0, all for n >= 8.
inline __m256i lanes_below8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// A softmax's passes over scores s[jlo, jhi) (jlo < jhi): their max, and exp(s - m) in place,
// returning the sum (the prompt attention's online softmax, the decode ops' softmax_rows). On AVX2
// CPUs 8 lanes at a time, exp by exp_neg8's polynomial: in the prompt attention, libmvec's expf,
// which the plain loop calls through `omp simd`, and the scalar max were 11% and 2% of the op's
// time at 9,3,64 (2 x 2,000 tokens, fp32, Zen 3). AVX-512 CPUs keep the plain loops (their libmvec
// calls are 16 lanes wide; not measured against a polynomial there).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline float row_max(const float* s, int64_t jlo, int64_t jhi) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t j = jlo;
  for (; j + 8 <= jhi; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  if (j < jhi) {
    const __m256 lanes = _mm256_castsi256_ps(lanes_below8(static_cast<int>(jhi - j)));
    m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(s + j, _mm256_castps_si256(lanes)), lanes));
  }
  return hmax8(m);
}

inline float exp_sum(float* s, int64_t jlo, int64_t jhi, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 z = _mm256_setzero_ps();
  int64_t j = jlo;
  for (; j + 8 <= jhi; j += 8) {
    const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    z = _mm256_add_ps(z, e);
  }
  if (j < jhi) {
    const __m256i lanes = lanes_below8(static_cast<int>(jhi - j));
    const __m256 e = _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_maskload_ps(s + j, lanes), m)), _mm256_castsi256_ps(lanes));
    _mm256_maskstore_ps(s + j, lanes, e);
    z = _mm256_add_ps(z, e);
  }
  return hsum8(z);
}
#else
inline float row_max(const float* s, int64_t jlo, int64_t jhi) {
  float mx = s[jlo];
  for (int64_t j = jlo + 1; j < jhi; ++j) mx = s[j] > mx ? s[j] : mx;
  return mx;
}

inline float exp_sum(float* s, int64_t jlo, int64_t jhi, float mx) {
  float z = 0.f;
#pragma omp simd reduction(+ : z)
  for (int64_t j = jlo; j < jhi; ++j) {
    s[j] = std::exp(s[j] - mx);
    z += s[j];
  }
  return z;
}
#endif

// The arguments the attention ops share: q [n, heads, dim] in float32 or bfloat16 with contiguous
// heads (rows may be strided), out contiguous and like q, the caches contiguous
// [blocks, block_size, kv_heads, dim] in float32, bfloat16 or int8, and an int8 cache's scales.
inline void check_attention_args(const char* op, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                                 const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2),
              op, ": q must be float32 or bfloat16 [n, heads, dim] with contiguous heads (rows may be strided)");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), op,
              ": out must be contiguous, shaped and typed like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == q.size(2) &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              op, ": caches must be contiguous [blocks, block_size, kv_heads, dim] matching q");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 || int8, op,
              ": the cache must be float32, bfloat16 or int8");
  if (int8)
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->numel() * q.size(2) == k_cache.numel() && v_scale->numel() * q.size(2) == v_cache.numel(),
                op, ": an int8 cache needs contiguous float32 scales [blocks, block_size, kv_heads]");
}

// s[0, n) -> cap * tanh(s / cap): Gemma 2's soft-capping of attention scores.
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] * inv);
}

}  // namespace batchgen_cpu
