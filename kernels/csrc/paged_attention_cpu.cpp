// Paged decode attention for the CPU: reads K/V in place through the block tables.
//
// The torch path gathers each sequence's blocks into a padded copy and then runs SDPA over it,
// three passes over the KV; this reads each K and V row once, for all query heads of its group.
// One work item is one (sequence, KV head); torch's own thread pool runs them (at::parallel_for).
//
// Caches: float32 or bfloat16 [num_blocks, block_size, kv_heads, dim], or int8 with one float
// scale per (slot, head) in a [num_blocks, block_size, kv_heads] tensor.
// Every sequence attends to keys [lo, hi) of its own table; lse (optional) gets the log-sum-exp
// of the scaled scores, for merging partial results (cascade prefixes).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float to_f(int8_t x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(float* __restrict dst, const T* __restrict src, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = to_f(src[i]);
}

inline void store_row(float* dst, const float* src, int64_t d, float mul) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * mul;
}
inline void store_row(c10::BFloat16* dst, const float* src, int64_t d, float mul) {
  for (int64_t i = 0; i < d; ++i) dst[i] = c10::BFloat16(src[i] * mul);
}

template <typename QT, typename KT>
void decode_impl(QT* out, float* lse, const QT* q, const KT* kc, const KT* vc, const float* ks, const float* vs,
                 const int64_t* tables, const int64_t* lo_p, const int64_t* hi_p, int64_t n, int64_t heads,
                 int64_t kvh, int64_t d, int64_t bs, int64_t width, int64_t q_stride, float scale) {
  const int64_t group = heads / kvh;
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), kr(d), vr(d), mx(group), sum(group), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kvh, h = item % kvh;
      const int64_t lo = lo_p[s], hi = hi_p[s], len = hi - lo;
      QT* o = out + s * heads * d + h * group * d;
      if (len <= 0) {
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < d; ++i) o[g * d + i] = QT(0.f);
          if (lse) lse[s * heads + h * group + g] = -1e30f;
        }
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        load_row(qf.data() + g * d, q + s * q_stride + (h * group + g) * d, d);
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] *= scale;
      }
      scores.resize(group * len);
      const int64_t* table = tables + s * width;
      // Scores: one pass over K.
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const KT* kp = kc + (slot * kvh + h) * d;
        load_row(kr.data(), kp, d);
        const float kscale = ks ? ks[slot * kvh + h] : 1.f;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qg[i] * kr[i];
          scores[g * len + (t - lo)] = dot * kscale;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float m = sg[0];
        for (int64_t j = 1; j < len; ++j) m = sg[j] > m ? sg[j] : m;
        float z = 0.f;
#pragma omp simd reduction(+ : z)
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = std::exp(sg[j] - m);
          z += sg[j];
        }
        mx[g] = m;
        sum[g] = z;
      }
      // Weighted sum of V: one pass over V.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        load_row(vr.data(), vc + (slot * kvh + h) * d, d);
        const float vscale = vs ? vs[slot * kvh + h] : 1.f;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + (t - lo)] * vscale;
          float* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += p * vr[i];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        store_row(o + g * d, acc.data() + g * d, d, 1.f / sum[g]);
        if (lse) lse[s * heads + h * group + g] = mx[g] + std::log(sum[g]);
      }
    }
  });
}


#ifdef __AVX512F__
#include <immintrin.h>

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The next block's rows of one head: random block placement defeats the hardware prefetcher,
// and without this the kernel stalled on its loads (perf: ~40% of cycles on the first vmovups).
template <typename KT>
inline void prefetch_rows(const KT* p, int64_t rows, int64_t row) {
  constexpr int64_t bytes_per_row_head = 0;  // unused; whole lines of the head's slice below
  (void)bytes_per_row_head;
  for (int64_t r = 0; r < rows; ++r) {
    const char* c = reinterpret_cast<const char*>(p + r * row);
    _mm_prefetch(c, _MM_HINT_T0);
    _mm_prefetch(c + 64, _MM_HINT_T0);
    _mm_prefetch(c + 128, _MM_HINT_T0);
    _mm_prefetch(c + 192, _MM_HINT_T0);
  }
}

// The next block's K or V rows (all heads: a block is one contiguous span). Blocks sit at
// random places, which the hardware prefetcher cannot guess.
template <typename KT>
inline void prefetch_block(const KT* p, int64_t rows, int64_t row) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = rows * row * static_cast<int64_t>(sizeof(KT));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// One sequence, every KV head, G query heads per KV head of ND x 16 dims. Walking block by block
// and head by head inside a block reads each block as one contiguous span (an earlier version
// took one (sequence, head) per work item, striding over the other heads' rows, and ran ~2x
// slower: it stalled on its loads).
template <int G, int ND, typename KT>
void decode_seq_avx512(float* o, float* lse, const float* q, const KT* kc, const KT* vc, const float* ks,
                       const float* vs, const int64_t* table, int64_t lo, int64_t hi, int64_t kvh, int64_t bs,
                       float scale, float* scores, float* acc_mem) {
  constexpr int D = ND * 16;
  const int64_t len = hi - lo;
  const int64_t row = kvh * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  // Scores: one pass over K. scores[(h * G + g) * len + (t - lo)]
  for (int64_t t = lo; t < hi;) {
    const int64_t blk = t / bs, off = t - blk * bs, stop = std::min(hi, (blk + 1) * bs);
    if (stop < hi) prefetch_block(kc + table[blk + 1] * bs * row, std::min<int64_t>(bs, hi - stop), row);
    const int64_t slot0 = table[blk] * bs + off, cnt = stop - t;
    for (int64_t h = 0; h < kvh; ++h) {
      __m512 qv[G][ND];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < ND; ++j)
          qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + (h * G + g) * D + j * 16), vscale);
      float* sc = scores + h * G * len + (t - lo);
      for (int64_t i = 0; i < cnt; ++i) {
        const int64_t slot = slot0 + i;
        const KT* kp = kc + slot * row + h * D;
        __m512 kv[ND];
        for (int j = 0; j < ND; ++j) kv[j] = load16(kp + j * 16);
        const float ksc = ks ? ks[slot * kvh + h] : 1.f;
        for (int g = 0; g < G; ++g) {
          __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int j = 1; j < ND; ++j) a = _mm512_fmadd_ps(qv[g][j], kv[j], a);
          sc[g * len + i] = _mm512_reduce_add_ps(a) * ksc;
        }
      }
    }
    t = stop;
  }
  // Softmax per query head.
  for (int64_t hg = 0; hg < kvh * G; ++hg) {
    float* sg = scores + hg * len;
    float m = sg[0];
    for (int64_t j = 1; j < len; ++j) m = sg[j] > m ? sg[j] : m;
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t j = 0; j < len; ++j) {
      sg[j] = std::exp(sg[j] - m);
      z += sg[j];
    }
    const float inv = 1.f / z;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) sg[j] *= inv;
    if (lse) lse[hg] = m + std::log(z);
  }
  // Weighted sum of V: one pass over V; accumulators of one head live in registers per block.
  std::fill(acc_mem, acc_mem + kvh * G * D, 0.f);
  for (int64_t t = lo; t < hi;) {
    const int64_t blk = t / bs, off = t - blk * bs, stop = std::min(hi, (blk + 1) * bs);
    if (stop < hi) prefetch_block(vc + table[blk + 1] * bs * row, std::min<int64_t>(bs, hi - stop), row);
    const int64_t slot0 = table[blk] * bs + off, cnt = stop - t;
    for (int64_t h = 0; h < kvh; ++h) {
      __m512 acc[G][ND];
      float* am = acc_mem + h * G * D;
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < ND; ++j) acc[g][j] = _mm512_loadu_ps(am + g * D + j * 16);
      const float* pr = scores + h * G * len + (t - lo);
      for (int64_t i = 0; i < cnt; ++i) {
        const int64_t slot = slot0 + i;
        const KT* vp = vc + slot * row + h * D;
        __m512 vv[ND];
        for (int j = 0; j < ND; ++j) vv[j] = load16(vp + j * 16);
        const float vsc = vs ? vs[slot * kvh + h] : 1.f;
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(pr[g * len + i] * vsc);
          for (int j = 0; j < ND; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < ND; ++j) _mm512_storeu_ps(am + g * D + j * 16, acc[g][j]);
    }
    t = stop;
  }
  std::memcpy(o, acc_mem, sizeof(float) * kvh * G * D);
}

using SeqFn = void (*)(float*, float*, const float*, const void*, const void*, const float*, const float*,
                       const int64_t*, int64_t, int64_t, int64_t, int64_t, float, float*, float*);

template <int G, int ND, typename KT>
void seq_thunk(float* o, float* lse, const float* q, const void* kc, const void* vc, const float* ks, const float* vs,
               const int64_t* table, int64_t lo, int64_t hi, int64_t kvh, int64_t bs, float scale, float* scores,
               float* acc) {
  decode_seq_avx512<G, ND, KT>(o, lse, q, static_cast<const KT*>(kc), static_cast<const KT*>(vc), ks, vs, table, lo,
                               hi, kvh, bs, scale, scores, acc);
}

template <int ND, typename KT>
SeqFn pick_g(int64_t g) {
  switch (g) {
    case 1: return seq_thunk<1, ND, KT>;
    case 2: return seq_thunk<2, ND, KT>;
    case 3: return seq_thunk<3, ND, KT>;
    case 4: return seq_thunk<4, ND, KT>;
    case 5: return seq_thunk<5, ND, KT>;
    case 6: return seq_thunk<6, ND, KT>;
    case 7: return seq_thunk<7, ND, KT>;
    case 8: return seq_thunk<8, ND, KT>;
    default: return nullptr;
  }
}

template <typename KT>
SeqFn pick(int64_t g, int64_t d) {
  if (d == 64) return pick_g<4, KT>(g);
  if (d == 128) return pick_g<8, KT>(g);
  return nullptr;
}

// Returns false where no specialised kernel fits (the caller falls back to the generic one).
template <typename KT>
bool decode_fast(float* out, float* lse, const float* q, const KT* kc, const KT* vc, const float* ks, const float* vs,
                 const int64_t* tables, const int64_t* lo_p, const int64_t* hi_p, int64_t n, int64_t heads,
                 int64_t kvh, int64_t d, int64_t bs, int64_t width, float scale) {
  const int64_t group = heads / kvh;
  SeqFn fn = pick<KT>(group, d);
  if (!fn) return false;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(heads * d);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t lo = lo_p[s], hi = hi_p[s];
      float* o = out + s * heads * d;
      float* l = lse ? lse + s * heads : nullptr;
      if (hi <= lo) {
        std::fill(o, o + heads * d, 0.f);
        if (l) std::fill(l, l + heads, -1e30f);
        continue;
      }
      scores.resize(heads * (hi - lo));
      fn(o, l, q + s * heads * d, kc, vc, ks, vs, tables + s * width, lo, hi, kvh, bs, scale, scores.data(),
         acc.data());
    }
  });
  return true;
}
#else
template <typename KT>
bool decode_fast(float*, float*, const float*, const KT*, const KT*, const float*, const float*, const int64_t*,
                 const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float) {
  return false;
}
#endif

void paged_decode(at::Tensor out, c10::optional<at::Tensor> lse, at::Tensor q, at::Tensor k_cache,
                  at::Tensor v_cache, c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                  at::Tensor block_tables, at::Tensor lo, at::Tensor hi, double scale_d) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat,
              "paged_decode: q must be contiguous float32 [n, heads, dim]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == at::kFloat,
              "paged_decode: out must be contiguous float32, shaped like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == q.size(2) &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode: caches must be contiguous [blocks, block_size, kv_heads, dim] matching q");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_decode: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0),
              "paged_decode: block_tables must be contiguous int64 [n, width]");
  TORCH_CHECK(lo.is_contiguous() && hi.is_contiguous() && lo.scalar_type() == at::kLong &&
                  hi.scalar_type() == at::kLong && lo.numel() == q.size(0) && hi.numel() == q.size(0),
              "paged_decode: lo/hi must be contiguous int64 [n]");
  if (lse.has_value())
    TORCH_CHECK(lse->is_contiguous() && lse->scalar_type() == at::kFloat && lse->numel() == q.size(0) * q.size(1),
                "paged_decode: lse must be contiguous float32 [n, heads]");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 || int8,
              "paged_decode: the cache must be float32, bfloat16 or int8");
  if (int8)
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->scalar_type() == at::kFloat && k_scale->numel() * q.size(2) == k_cache.numel(),
                "paged_decode: an int8 cache needs contiguous float32 scales [blocks, block_size, kv_heads]");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), width = block_tables.size(1);
  float* lse_p = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = lo.data_ptr<int64_t>();
  const int64_t* hp = hi.data_ptr<int64_t>();
  const float scale = static_cast<float>(scale_d);
  auto run = [&](auto* kc, auto* vc, const float* ks, const float* vs) {
    if (!decode_fast(o, lse_p, qp, kc, vc, ks, vs, tp, lp, hp, n, heads, kvh, d, bs, width, scale))
      decode_impl(o, lse_p, qp, kc, vc, ks, vs, tp, lp, hp, n, heads, kvh, d, bs, width, d * heads, scale);
  };
  if (k_cache.scalar_type() == at::kFloat) {
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), nullptr, nullptr);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), nullptr, nullptr);
  } else {
    run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), k_scale->data_ptr<float>(), v_scale->data_ptr<float>());
  }
}

}  // namespace

TORCH_LIBRARY(batchgen_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor(b!)? lse, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, "
        "Tensor? v_scale, Tensor block_tables, Tensor lo, Tensor hi, float scale) -> ()",
        &paged_decode);
}
