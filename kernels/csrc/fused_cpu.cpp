// Fused elementwise ops of the decoder layer for the CPU fast paths (oneDNN fp32 and bf16).
//
// In torch each of these is 3-8 separate ops, each a full pass over the activations with its own
// dispatch; on SmolLM2 in bf16 they took ~11 s of a 93 s ShareGPT run. Here each is one pass,
// rows in parallel, math in fp32 and one rounding at the end (torch rounds after every op in
// bf16, so results differ in the last bf16 bit now and then; the plain fp32 path, the exact
// reference, keeps torch's ops).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using namespace batchgen_cpu;

template <typename T>
inline float ld(const T* p, int64_t i) { return to_f(p[i]); }

// h [n, d] (rows may be strided); delta: h += delta first (in place). out = weight * norm(h).
template <typename T>
void add_rms_norm_impl(T* out, T* h, const T* delta, const T* w, int64_t n, int64_t d, int64_t h_stride,
                       int64_t delta_stride, float eps) {
  std::vector<float> wf(d);
  row_to_f32(w, wf.data(), d);
  // fp32 rows are worked on where they lie; bf16 ones through fp32 copies (five row copies a row
  // in fp32 were ~1% of a SmolLM2 fp32 run on Zen 3, perf)
  constexpr bool kF32 = std::is_same_v<T, float>;
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    FlushDenormals ftz;
    std::vector<float> hf(kF32 ? 0 : d), df(kF32 ? 0 : d);
    for (int64_t r = b; r < e; ++r) {
      T* hr = h + r * h_stride;
      // not f32_row: through it GCC vectorised the fp32 sum of squares below in another order,
      // moving some outputs by 1 ulp
      float* hp;
      if constexpr (kF32) hp = hr;
      else {
        row_to_f32(hr, hf.data(), d);
        hp = hf.data();
      }
      if (delta) {
        const float* dp;
        if constexpr (kF32) dp = delta + r * delta_stride;
        else {
          row_to_f32(delta + r * delta_stride, df.data(), d);
          dp = df.data();
        }
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) hp[i] += dp[i];
        if constexpr (!kF32) {
          row_from_f32(hp, hr, d);
          row_to_f32(hr, hp, d);  // the stored (rounded) residual, as the next layer sees it
        }
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) ss += hp[i] * hp[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      const float* wp = wf.data();
      if constexpr (kF32) {
        float* o = out + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] = wp[i] * (hp[i] * inv);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) hp[i] = wp[i] * (hp[i] * inv);
        row_from_f32(hp, out + r * d, d);
      }
    }
  });
}

// x [n, heads, dim] in place (row stride x_stride, heads contiguous); cos/sin [n, dim].
// x' = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]).
template <typename T>
void rope_impl(T* x, const T* cos, const T* sin, int64_t n, int64_t heads, int64_t dim, int64_t x_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    FlushDenormals ftz;
    for (int64_t r = b; r < e; ++r) {
      const T* c = cos + r * dim;
      const T* s = sin + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = x + r * x_stride + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = ld(xr, i), bb = ld(xr, i + half);
          st(xr, i, a * ld(c, i) - bb * ld(s, i));
          st(xr, i + half, bb * ld(c, i + half) + a * ld(s, i + half));
        }
      }
    }
  });
}

// gate_up [n, 2 * inter] -> out [n, inter] = act(gate) * up, act SiLU or GELU-tanh (Gemma).
// The AVX-512 activations (silu16, gelu_tanh16) are in cpu_common.h: the dpbf16 GEMM's gate/up epilogue
// computes the same ones.

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The same for 8 lanes on AVX2 CPUs (exp_neg8 in cpu_common.h, and a true division, which is off
// the critical path of a memory-bound op).
#define BATCHGEN_ACT8 1
inline __m256 sigmoid8(__m256 x) {
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_setzero_ps(), ax));  // exp(-|x|) in (0, 1]
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  // sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0.
  return _mm256_blendv_ps(inv, _mm256_mul_ps(inv, e), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

inline __m256 silu8(__m256 g) { return _mm256_mul_ps(g, sigmoid8(g)); }

inline __m256 gelu_tanh8(__m256 g) {
  const __m256 g2 = _mm256_mul_ps(g, g);
  const __m256 inner = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g2, _mm256_set1_ps(1.f)));
  return _mm256_mul_ps(g, sigmoid8(_mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608f), inner)));
}
#endif

// Scalar sigmoid through exp(-|x|) <= 1: no overflow to inf, which -ffast-math assumes away.
inline float sigmoid1(float x) {
  const float e = std::exp(-std::fabs(x)), inv = 1.f / (1.f + e);
  return x < 0.f ? e * inv : inv;
}

struct Silu {
#ifdef __AVX512F__
  static __m512 v(__m512 g) { return silu16(g); }
#endif
#ifdef BATCHGEN_ACT8
  static __m256 v8(__m256 g) { return silu8(g); }
#endif
  static float s(float g) { return g * sigmoid1(g); }
};

struct GeluTanh {  // g sigmoid(2 z), as gelu_tanh16
#ifdef __AVX512F__
  static __m512 v(__m512 g) { return gelu_tanh16(g); }
#endif
#ifdef BATCHGEN_ACT8
  static __m256 v8(__m256 g) { return gelu_tanh8(g); }
#endif
  static float s(float g) { return g * sigmoid1(2.f * 0.7978845608f * (g + 0.044715f * g * g * g)); }
};

template <typename T, typename Act>
void gated_mul_impl(T* out, const T* gu, int64_t n, int64_t inter, int64_t gu_stride) {
  // fp32 rows are read and written where they lie; bf16 ones through fp32 copies
  constexpr bool kF32 = std::is_same_v<T, float>;
  at::parallel_for(0, n, 8, [&](int64_t b, int64_t e) {
    FlushDenormals ftz;
    std::vector<float> g(kF32 ? 0 : inter), u(kF32 ? 0 : inter);
    for (int64_t r = b; r < e; ++r) {
      const float* gp = f32_row(gu + r * gu_stride, g.data(), inter);
      const float* up = f32_row(gu + r * gu_stride + inter, u.data(), inter);
      float* op;  // fp32: the output row itself; bf16: g, rounded into the output after
      if constexpr (kF32) op = out + r * inter;
      else op = g.data();
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= inter; i += 16)
        _mm512_storeu_ps(op + i, _mm512_mul_ps(Act::v(_mm512_loadu_ps(gp + i)), _mm512_loadu_ps(up + i)));
#endif
#ifdef BATCHGEN_ACT8
      for (; i + 8 <= inter; i += 8)
        _mm256_storeu_ps(op + i, _mm256_mul_ps(Act::v8(_mm256_loadu_ps(gp + i)), _mm256_loadu_ps(up + i)));
#endif
      for (; i < inter; ++i) op[i] = Act::s(gp[i]) * up[i];
      if constexpr (!kF32) row_from_f32(g.data(), out + r * inter, inter);
    }
  });
}

// Rows of k/v [n, kv_heads, dim] (rows may be strided, heads contiguous) into cache slots.
template <typename T>
void store_kv_impl(T* cache, const T* x, const int64_t* slots, int64_t n, int64_t row, int64_t stride) {
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    FlushDenormals ftz;
    for (int64_t i = b; i < e; ++i) std::memcpy(cache + slots[i] * row, x + i * stride, row * sizeof(T));
  });
}

// Index of the first largest value of each row (torch.argmax's tie rule), reading bf16 rows
// without converting the whole [n, vocab] tensor first.
template <typename T>
void argmax_rows_impl(int64_t* out, const T* x, int64_t n, int64_t v, int64_t stride) {
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    FlushDenormals ftz;
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : 4096);  // fp32 rows are read where they lie
    for (int64_t r = b; r < e; ++r) {
      float best = -INFINITY;
      int64_t arg = 0;
      for (int64_t c0 = 0; c0 < v; c0 += 4096) {
        const int64_t m = std::min<int64_t>(4096, v - c0);
        const float* bp = f32_row(x + r * stride + c0, buf.data(), m);
        float cmax = -INFINITY;
#pragma omp simd reduction(max : cmax)
        for (int64_t i = 0; i < m; ++i) cmax = bp[i] > cmax ? bp[i] : cmax;
        if (cmax > best) {
          best = cmax;
          for (int64_t i = 0; i < m; ++i)
            if (bp[i] == cmax) {
              arg = c0 + i;
              break;
            }
        }
      }
      out[r] = arg;
    }
  });
}

// Greedy tokens of fp32 logits from bf16 ones: approx [n, v] are logits of the bf16-rounded
// hidden rows h and weight rows w (fp32 accumulation, bf16 output). Each true logit z_t lies
// within e_t = c_rel * |h| * |w_t| + c_out * |approx_t| of approx_t (the bound of the two input
// roundings, the accumulation and the output rounding), so the largest z_t is among the tokens
// whose approx_t + e_t reaches max_s(approx_s - e_s). Only those get an fp32 dot product with
// h (there were ~6 on average, at most 126, on ShareGPT). Ties go to the first index.
void argmax_verified_impl(int64_t* out, const c10::BFloat16* approx, int64_t a_stride, const float* h, int64_t h_stride,
                          const float* w, const float* wnorm, int64_t n, int64_t v, int64_t d, float c_rel,
                          float c_out) {
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    FlushDenormals ftz;
    for (int64_t r = b; r < e; ++r) {
      const float* hr = h + r * h_stride;
      float hn = 0.f;
#pragma omp simd reduction(+ : hn)
      for (int64_t i = 0; i < d; ++i) hn += hr[i] * hr[i];
      const float k = c_rel * std::sqrt(hn) * 1.0001f;  // |h| rounded up
      const c10::BFloat16* ar = approx + r * a_stride;
      float best = -INFINITY;
      int64_t arg = -1;
      auto refine = [&](int64_t t) {
        const float* wr = w + t * d;
        float z = 0.f;
#pragma omp simd reduction(+ : z)
        for (int64_t i = 0; i < d; ++i) z += hr[i] * wr[i];
        if (arg < 0 || z > best) {
          best = z;
          arg = t;
        }
      };
      auto err = [&](int64_t t, float at) { return k * wnorm[t] + c_out * std::fabs(at); };
      // Two passes over the bf16 row, 16 tokens at a time where AVX-512 is compiled in (then
      // the scalar loops only take the tail): the lower bound, then the candidates.
      int64_t v16 = 0;
      float lower = -INFINITY;
#ifdef __AVX512F__
      v16 = v / 16 * 16;
      const __m512 vk = _mm512_set1_ps(k), vc = _mm512_set1_ps(c_out);
      auto verr = [&](int64_t t, __m512 at) {
        return _mm512_fmadd_ps(vk, _mm512_loadu_ps(wnorm + t), _mm512_mul_ps(vc, _mm512_abs_ps(at)));
      };
      __m512 vlow = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < v16; t += 16) {
        const __m512 at = load16(ar + t);
        vlow = _mm512_max_ps(vlow, _mm512_sub_ps(at, verr(t, at)));
      }
      lower = _mm512_reduce_max_ps(vlow);
#endif
      for (int64_t t = v16; t < v; ++t) lower = std::max(lower, to_f(ar[t]) - err(t, to_f(ar[t])));
#ifdef __AVX512F__
      const __m512 vl = _mm512_set1_ps(lower);
      for (int64_t t = 0; t < v16; t += 16) {
        const __m512 at = load16(ar + t);
        for (unsigned m = _mm512_cmp_ps_mask(_mm512_add_ps(at, verr(t, at)), vl, _CMP_GE_OQ); m; m &= m - 1) refine(t + __builtin_ctz(m));
      }
#endif
      for (int64_t t = v16; t < v; ++t)
        if (to_f(ar[t]) + err(t, to_f(ar[t])) >= lower) refine(t);
      if (arg < 0)  // no candidate: only where the logits hold NaN; refine them all
        for (int64_t t = 0; t < v; ++t) refine(t);
      out[r] = arg;
    }
  });
}

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

bool is_bf16(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "fused ops take float32 or bfloat16");
  return t.scalar_type() == at::kBFloat16;
}

void add_rms_norm(at::Tensor out, at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  check_2d(h, "h");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == h.sizes() && out.scalar_type() == h.scalar_type(),
              "add_rms_norm: out must be contiguous, shaped and typed like h");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) && weight.scalar_type() == h.scalar_type(),
              "add_rms_norm: weight must be [hidden] in h's dtype");
  if (delta.has_value()) {
    check_2d(*delta, "delta");
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(),
                "add_rms_norm: delta must be shaped and typed like h");
  }
  const int64_t n = h.size(0), d = h.size(1);
  const int64_t ds = delta.has_value() ? delta->stride(0) : 0;
  if (is_bf16(h)) {
    using T = c10::BFloat16;
    add_rms_norm_impl<T>(out.data_ptr<T>(), h.data_ptr<T>(), delta.has_value() ? delta->data_ptr<T>() : nullptr,
                         weight.data_ptr<T>(), n, d, h.stride(0), ds, static_cast<float>(eps));
  } else {
    add_rms_norm_impl<float>(out.data_ptr<float>(), h.data_ptr<float>(),
                             delta.has_value() ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(), n, d,
                             h.stride(0), ds, static_cast<float>(eps));
  }
}

void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope_: x must be [n, heads, dim] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "rope_: cos/sin must be contiguous [n, dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() && x.size(2) % 2 == 0,
              "rope_: cos/sin in x's dtype, even dim");
  if (is_bf16(x)) {
    using T = c10::BFloat16;
    rope_impl<T>(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0));
  } else {
    rope_impl<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.size(1),
                     x.size(2), x.stride(0));
  }
}

template <typename Act>
void gated_mul(at::Tensor out, at::Tensor gate_up, const char* op) {
  check_2d(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, op, ": gate_up's width must be even");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == gate_up.size(0) &&
                  out.size(1) * 2 == gate_up.size(1) && out.scalar_type() == gate_up.scalar_type(),
              op, ": out must be contiguous [n, width / 2] in gate_up's dtype");
  const int64_t n = gate_up.size(0), inter = out.size(1);
  if (is_bf16(gate_up)) {
    using T = c10::BFloat16;
    gated_mul_impl<T, Act>(out.data_ptr<T>(), gate_up.data_ptr<T>(), n, inter, gate_up.stride(0));
  } else {
    gated_mul_impl<float, Act>(out.data_ptr<float>(), gate_up.data_ptr<float>(), n, inter, gate_up.stride(0));
  }
}

void silu_mul(at::Tensor out, at::Tensor gate_up) { gated_mul<Silu>(out, gate_up, "silu_mul"); }
void gelu_tanh_mul(at::Tensor out, at::Tensor gate_up) { gated_mul<GeluTanh>(out, gate_up, "gelu_tanh_mul"); }

void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "store_kv: caches must be contiguous [blocks, block_size, kv_heads, dim], alike");
  const int64_t row = k_cache.size(2) * k_cache.size(3), nslots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor& x : {k, v})
    TORCH_CHECK(x.dim() == 3 && x.size(1) == k_cache.size(2) && x.size(2) == k_cache.size(3) && x.stride(2) == 1 &&
                    x.stride(1) == x.size(2) && x.scalar_type() == k_cache.scalar_type(),
                "store_kv: k/v must be [n, kv_heads, dim] in the cache's dtype with contiguous heads");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == k.size(0) &&
                  v.size(0) == k.size(0),
              "store_kv: slot_mapping must be contiguous int64 [n]");
  const int64_t n = k.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < nslots, "store_kv: slot ", sp[i], " of token ", i, " is outside the cache (",
                nslots, " slots)");
  if (is_bf16(k)) {
    using T = c10::BFloat16;
    store_kv_impl<T>(k_cache.data_ptr<T>(), k.data_ptr<T>(), sp, n, row, k.stride(0));
    store_kv_impl<T>(v_cache.data_ptr<T>(), v.data_ptr<T>(), sp, n, row, v.stride(0));
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "store_kv: float32 or bfloat16");
    store_kv_impl<float>(k_cache.data_ptr<float>(), k.data_ptr<float>(), sp, n, row, k.stride(0));
    store_kv_impl<float>(v_cache.data_ptr<float>(), v.data_ptr<float>(), sp, n, row, v.stride(0));
  }
}

void argmax_rows(at::Tensor out, at::Tensor x) {
  check_2d(x, "x");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == x.size(0),
              "argmax_rows: out must be contiguous int64 [rows]");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: empty rows");
  if (is_bf16(x)) {
    using T = c10::BFloat16;
    argmax_rows_impl<T>(out.data_ptr<int64_t>(), x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0));
  } else {
    argmax_rows_impl<float>(out.data_ptr<int64_t>(), x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0));
  }
}

void argmax_verified(at::Tensor out, at::Tensor approx, at::Tensor h, at::Tensor w, at::Tensor wnorm, double c_rel,
                     double c_out) {
  check_2d(approx, "approx");
  check_2d(h, "h");
  TORCH_CHECK(approx.scalar_type() == at::kBFloat16 && h.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  wnorm.scalar_type() == at::kFloat,
              "argmax_verified: approx is bfloat16, h, w and wnorm float32");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 2 && wnorm.is_contiguous() && wnorm.numel() == w.size(0) &&
                  approx.size(1) == w.size(0) && h.size(1) == w.size(1) && approx.size(0) == h.size(0),
              "argmax_verified: shapes must be approx [n, vocab], h [n, hidden], w [vocab, hidden], wnorm [vocab]");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == h.size(0),
              "argmax_verified: out must be contiguous int64 [rows]");
  argmax_verified_impl(out.data_ptr<int64_t>(), approx.data_ptr<c10::BFloat16>(), approx.stride(0), h.data_ptr<float>(),
                       h.stride(0), w.data_ptr<float>(), wnorm.data_ptr<float>(), h.size(0), w.size(0), w.size(1),
                       static_cast<float>(c_rel), static_cast<float>(c_out));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("argmax_verified(Tensor(a!) out, Tensor approx, Tensor h, Tensor w, Tensor wnorm, float c_rel, float c_out) -> ()",
        &argmax_verified);
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()", &argmax_rows);
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) h, Tensor? delta, Tensor weight, float eps) -> ()", &add_rms_norm);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &rope_);
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()", &silu_mul);
  m.def("gelu_tanh_mul(Tensor(a!) out, Tensor gate_up) -> ()", &gelu_tanh_mul);
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()", &store_kv);
}
