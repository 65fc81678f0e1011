// Paged decode attention for the CPU: reads K/V in place through the block tables.
//
// The torch path gathers each sequence's blocks into a padded copy and then runs SDPA over it,
// three passes over the KV; this reads each K and V row once, for all query heads of its group.
// The AVX-512 and AVX2 kernels take one sequence (every KV head) per work item, the generic one
// a (sequence, KV head); torch's own thread pool runs them (at::parallel_for).
//
// Caches: float32 or bfloat16 [num_blocks, block_size, kv_heads, dim], or int8 with one float
// scale per (slot, head) in a [num_blocks, block_size, kv_heads] tensor.
// Every sequence attends to keys [lo, hi) of its own table; lse (optional) gets the log-sum-exp
// of the scaled (and, with softcap > 0, capped) scores, for merging partial results (cascade
// prefixes).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace batchgen_cpu;

template <typename T>
inline void load_row(float* __restrict dst, const T* __restrict src, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = to_f(src[i]);
}

// Each of `rows` rows of scores (length len) becomes its softmax in place; lse[r] (when given)
// gets the row's log-sum-exp. softcap > 0 first caps each score at softcap * tanh(s / softcap)
// (Gemma 2).
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* lse, float softcap) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sg = scores + r * len;
    if (softcap > 0.f) soft_cap(sg, len, softcap);
    const float m = row_max(sg, 0, len);
    const float z = exp_sum(sg, 0, len, m);
    const float inv = 1.f / z;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) sg[j] *= inv;
    if (lse) lse[r] = m + std::log(z);
  }
}

// Any head_dim, any group size, any ISA: one (sequence, KV head) per work item.
template <typename KT>
void decode_impl(float* out, float* lse, const float* q, int64_t q_stride, const KT* kc, const KT* vc, const float* ks, const float* vs,
                 const int64_t* tables, const int64_t* lo_p, const int64_t* hi_p, int64_t n, int64_t heads,
                 int64_t kvh, int64_t d, int64_t bs, int64_t width, float scale, float softcap) {
  const int64_t group = heads / kvh;
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), row(d), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kvh, h = item % kvh;
      const int64_t lo = lo_p[s], hi = hi_p[s], len = hi - lo;
      float* o = out + s * heads * d + h * group * d;
      float* l = lse ? lse + s * heads + h * group : nullptr;
      if (len <= 0) {
        std::fill(o, o + group * d, 0.f);
        if (l) std::fill(l, l + group, -1e30f);
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        load_row(qf.data() + g * d, q + s * q_stride + (h * group + g) * d, d);
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] *= scale;
      }
      scores.resize(group * len);
      const int64_t* table = tables + s * width;
      // Scores: one pass over K.
      walk_blocks(table, lo, hi, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t) {
        for (int64_t i = 0; i < cnt; ++i) {
          const int64_t slot = slot0 + i;
          load_row(row.data(), kc + (slot * kvh + h) * d, d);
          const float kscale = ks ? ks[slot * kvh + h] : 1.f;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < d; ++j) dot += qg[j] * row[j];
            scores[g * len + at + i] = dot * kscale;
          }
        }
      });
      softmax_rows(scores.data(), group, len, l, softcap);
      // Weighted sum of V: one pass over V, straight into the output.
      std::fill(o, o + group * d, 0.f);
      walk_blocks(table, lo, hi, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t) {
        for (int64_t i = 0; i < cnt; ++i) {
          const int64_t slot = slot0 + i;
          load_row(row.data(), vc + (slot * kvh + h) * d, d);
          const float vscale = vs ? vs[slot * kvh + h] : 1.f;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + at + i] * vscale;
            float* a = o + g * d;
#pragma omp simd
            for (int64_t j = 0; j < d; ++j) a[j] += p * row[j];
          }
        }
      });
    }
  });
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The 64-byte lines [l0, l1) from p, into L2, for a later iteration.
inline void prefetch_lines(const void* p, int l0, int l1) {
  const char* c = static_cast<const char*>(p);
  for (int l = l0; l < l1; ++l) _mm_prefetch(c + l * 64, _MM_HINT_T1);
}

// The lines of one head's slice of a K or V row (D values).
template <int D, typename KT>
constexpr int row_lines() { return (static_cast<int>(sizeof(KT)) * D + 63) / 64; }

// One head's slice of a K or V row, into L2, for a later iteration.
template <int D, typename KT>
inline void prefetch_row(const KT* p) { prefetch_lines(p, 0, row_lines<D, KT>()); }

// The slots of an N-row score tile from `first`; a tail tile (n < N) repeats its last row, so
// every row load stays inside the block (only the n valid sums are stored).
template <int N>
inline void tile_slots(int64_t (&sl)[N], int64_t first, int64_t n) {
  for (int i = 0; i < N; ++i) sl[i] = first + std::min<int64_t>(i, n - 1);
}

// The weighted sum of V's slice width: the widest of at most `cap` vectors that divides the head's
// nd vectors (head_dim 96 = 6 x 16 dims takes 3 where 64 and 128 take 4).
constexpr int v_slices(int cap, int nd) {
  for (int dc = cap < nd ? cap : nd; dc > 1; --dc)
    if (nd % dc == 0) return dc;
  return 1;
}
#endif

#ifdef __AVX512F__
// Element i (< 8) of the result = the sum of the 16 lanes of a[i]: ~3 shuffles and adds per
// vector instead of the ~8 of one _mm512_reduce_add_ps each.
inline __m256 transpose_sum8(const __m512* a) {
  __m512 c[4], d[2];
  for (int i = 0; i < 4; ++i)  // 256-bit halves: [a(2i): 8 partials | a(2i+1): 8 partials]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // 128-bit lane L: 4 partials of a(4i + L)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane L: [a(L), a(4+L), a(L), a(4+L)] partial pairs, then whole sums in elements 0 and 1.
  __m512 e = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
  e = _mm512_add_ps(e, _mm512_permute_ps(e, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, e));
}

// Both decode kernels' second pass: o [kvh * G, D] = the probabilities in `scores` times V, one
// pass over V. Per block and head, the G heads' accumulators of one DC x 16 slice of the head
// live in registers while the block's rows stream through (DC = ND: the whole head at once). The
// next block's rows are prefetched during the first slice, and the last block prefetches the
// next sequence's first K block (next_k), so no pass starts cold. acc_mem: [kvh * G, D].
template <int G, int ND, int DC, typename KT>
void weighted_v_sum(float* o, const float* scores, const KT* vc, const float* vs, const int64_t* table, int64_t lo,
                    int64_t hi, int64_t kvh, int64_t bs, float* acc_mem, const KT* next_k) {
  constexpr int D = ND * 16;
  static_assert(ND % DC == 0, "head_dim slices must divide the head");
  const int64_t len = hi - lo;
  const int64_t row = kvh * D;
  std::fill(acc_mem, acc_mem + kvh * G * D, 0.f);
  walk_blocks(table, lo, hi, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t nxt) {
    for (int64_t h = 0; h < kvh; ++h) {
      const KT* next = nxt >= 0 ? vc + nxt * bs * row + h * D : (next_k ? next_k + h * D : nullptr);
      float* am = acc_mem + h * G * D;
      const float* pr = scores + h * G * len + at;
      for (int c = 0; c < ND; c += DC) {
        __m512 acc[G][DC];
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < DC; ++j) acc[g][j] = _mm512_loadu_ps(am + g * D + (c + j) * 16);
        for (int64_t i = 0; i < cnt; ++i) {
          const int64_t slot = slot0 + i;
          const KT* vp = vc + slot * row + h * D + c * 16;
          if (c == 0 && next) prefetch_row<D>(next + i * row);
          __m512 vv[DC];
          for (int j = 0; j < DC; ++j) vv[j] = load16(vp + j * 16);
          const float vsc = vs ? vs[slot * kvh + h] : 1.f;
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(pr[g * len + i] * vsc);
            for (int j = 0; j < DC; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < DC; ++j) _mm512_storeu_ps(am + g * D + (c + j) * 16, acc[g][j]);
      }
    }
  });
  std::memcpy(o, acc_mem, sizeof(float) * kvh * G * D);
}

// One sequence, every KV head, G query heads per KV head of ND x 16 dims, with all G x D query
// values and accumulators held as registers (groups of up to 3; see decode_seq_tiled). Walking
// block by block and head by head inside a block reads each block as one contiguous span (one
// (sequence, head) per work item would stride over the other heads' rows and stall on its loads).
template <int G, int ND, typename KT>
void decode_seq_regs(float* o, float* lse, const float* q, const KT* kc, const KT* vc, const float* ks,
                       const float* vs, const int64_t* table, int64_t lo, int64_t hi, int64_t kvh, int64_t bs,
                       float scale, float softcap, float* scores, float* acc_mem, const KT* next_k) {
  constexpr int D = ND * 16;
  const int64_t len = hi - lo;
  const int64_t row = kvh * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  // Scores: one pass over K. scores[(h * G + g) * len + (t - lo)]. The next block's rows are
  // prefetched a row at a time, a block ahead, spread over this block's work (a burst of a whole
  // block's lines overflowed the miss queues). The last block prefetches V's first block, and
  // the V pass's last block the next sequence's first K block (next_k), so no pass starts cold.
  walk_blocks(table, lo, hi, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t nxt) {
    for (int64_t h = 0; h < kvh; ++h) {
      __m512 qv[G][ND];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < ND; ++j)
          qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + (h * G + g) * D + j * 16), vscale);
      float* sc = scores + h * G * len + at;
      const KT* next = nxt >= 0 ? kc + nxt * bs * row + h * D : vc + table[lo / bs] * bs * row + h * D;
      for (int64_t i0 = 0; i0 < cnt; i0 += 8) {
        const int64_t n8 = std::min<int64_t>(8, cnt - i0);
        __m512 acc[G][8];
        for (int64_t i = 0; i < 8; ++i) {
          if (i < n8) {
            const int64_t slot = slot0 + i0 + i;
            const KT* kp = kc + slot * row + h * D;
            if (next) prefetch_row<D>(next + (i0 + i) * row);
            __m512 kv[ND];
            for (int j = 0; j < ND; ++j) kv[j] = load16(kp + j * 16);
            if (ks) {
              const __m512 ksc = _mm512_set1_ps(ks[slot * kvh + h]);
              for (int j = 0; j < ND; ++j) kv[j] = _mm512_mul_ps(kv[j], ksc);
            }
            for (int g = 0; g < G; ++g) {
              __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
              for (int j = 1; j < ND; ++j) a = _mm512_fmadd_ps(qv[g][j], kv[j], a);
              acc[g][i] = a;
            }
          } else {
            for (int g = 0; g < G; ++g) acc[g][i] = _mm512_setzero_ps();
          }
        }
        const __mmask8 valid = static_cast<__mmask8>((1u << n8) - 1u);
        for (int g = 0; g < G; ++g) _mm256_mask_storeu_ps(sc + g * len + i0, valid, transpose_sum8(acc[g]));
      }
    }
  });
  softmax_rows(scores, kvh * G, len, lse, softcap);
  weighted_v_sum<G, ND, ND>(o, scores, vc, vs, table, lo, hi, kvh, bs, acc_mem, next_k);
}

template <int GT>
inline void zero_tile(__m512 (&acc)[GT][8]) {
  for (int g = 0; g < GT; ++g)
    for (int i = 0; i < 8; ++i) acc[g][i] = _mm512_setzero_ps();
}

// Scores of GT query heads (a tile of one KV head's group) over the rows of one block, read in
// place: sc[g * len + i] = q[g] . k[slot0 + i] (times the int8 scale), 8 rows at a time. The GT x
// 8 partial sums, the GT query slices and one K slice stay in registers (GT <= 3: 28 of 32).
// `next` (the first tile only) prefetches the next block's rows, spread over the slices (a burst
// of a whole block's lines overflowed the miss queues).
template <int GT, int ND, typename KT>
inline void scores_tile(float* sc, int64_t len, const float* q, const KT* kbase, int64_t slot0, int64_t cnt,
                        int64_t row, const float* ks, int64_t kvh, int64_t h, const KT* next) {
  constexpr int D = ND * 16;
  for (int64_t i0 = 0; i0 < cnt; i0 += 8) {
    const int64_t n8 = std::min<int64_t>(8, cnt - i0);
    int64_t sl[8];
    tile_slots(sl, slot0 + i0, n8);
    const KT* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = kbase + sl[i] * row;
    __m512 acc[GT][8];
    zero_tile<GT>(acc);
    for (int j = 0; j < ND; ++j) {
      if (next)
        for (int r = j * 8 / ND; r < (j + 1) * 8 / ND; ++r) prefetch_row<D>(next + (i0 + r) * row);
      __m512 qj[GT];
      for (int g = 0; g < GT; ++g) qj[g] = _mm512_loadu_ps(q + g * D + j * 16);
      for (int i = 0; i < 8; ++i) {
        const __m512 kv = load16(kr[i] + j * 16);
        for (int g = 0; g < GT; ++g) acc[g][i] = _mm512_fmadd_ps(qj[g], kv, acc[g][i]);
      }
    }
    const __mmask8 valid = static_cast<__mmask8>((1u << n8) - 1u);
    __m256 ksc = _mm256_set1_ps(1.f);
    if (ks) {
      float k8[8];
      for (int i = 0; i < 8; ++i) k8[i] = ks[sl[i] * kvh + h];
      ksc = _mm256_loadu_ps(k8);
    }
    for (int g = 0; g < GT; ++g)
      _mm256_mask_storeu_ps(sc + g * len + i0, valid, _mm256_mul_ps(transpose_sum8(acc[g]), ksc));
  }
}

#ifdef __AVX512BF16__
// scores_tile for a bf16 cache and bf16 queries: AVX512-BF16 dot products (each multiplies 32 bf16
// pairs and adds them into 16 fp32 lanes) read K as stored, with no widening to fp32: half the
// loads and a quarter of the arithmetic instructions of the fp32 tile. Products of bf16 values
// are exact in fp32; the sums round as an FMA chain's do (in another order). Scores are
// scaled after the sum (q is the unscaled bf16 query, exact).
template <int GT, int ND>
inline void scores_tile_bf16(float* sc, int64_t len, const c10::BFloat16* q, const c10::BFloat16* kbase,
                             int64_t slot0, int64_t cnt, int64_t row, float scale, const c10::BFloat16* next) {
  constexpr int D = ND * 16, NP = ND / 2;  // NP slices of 32 dims
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t i0 = 0; i0 < cnt; i0 += 8) {
    const int64_t n8 = std::min<int64_t>(8, cnt - i0);
    int64_t sl[8];
    tile_slots(sl, slot0 + i0, n8);
    const c10::BFloat16* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = kbase + sl[i] * row;
    __m512 acc[GT][8];
    zero_tile<GT>(acc);
    for (int p = 0; p < NP; ++p) {
      if (next)
        for (int r = p * 8 / NP; r < (p + 1) * 8 / NP; ++r) prefetch_row<D>(next + (i0 + r) * row);
      __m512bh qp[GT];
      for (int g = 0; g < GT; ++g) qp[g] = (__m512bh)_mm512_loadu_si512(q + g * D + p * 32);
      for (int i = 0; i < 8; ++i) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kr[i] + p * 32);
        for (int g = 0; g < GT; ++g) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], qp[g], kv);
      }
    }
    const __mmask8 valid = static_cast<__mmask8>((1u << n8) - 1u);
    for (int g = 0; g < GT; ++g)
      _mm256_mask_storeu_ps(sc + g * len + i0, valid, _mm256_mul_ps(transpose_sum8(acc[g]), vscale));
  }
}
#endif

// The same for groups of 4 or more query heads per KV head, in register tiles that fit any G
// and D: the scores in tiles of up to 3 query heads (each tile reads the block's K rows again,
// from L1), the weighted sum of V in slices of DC x 16 dims for all G heads at once (G x DC
// accumulators). decode_seq_regs keeps all G x D query values and accumulators in registers and
// spills them from G x D = 3 x 64 on; at 4 heads and more this runs 1.1-1.4x its speed (6 x 128,
// Qwen2.5-1.5B: 1.23x; 8 x 128, Qwen2.5-3B: 1.42x; examples/bench_cpu_attention.py --shape,
// alternating builds), and at 2-3 heads (head_dim 256 included) it was level or slower, so those
// keep it. A bf16 cache with bf16 queries (qb) takes the dot-product score tiles where the CPU
// has AVX512-BF16. Walking block by block and head by head inside a block reads each block as one
// contiguous span; the last K block prefetches V's first block.
template <int G, int ND, typename KT>
void decode_seq_tiled(float* o, float* lse, const float* q, const KT* kc, const KT* vc, const float* ks,
                      const float* vs, const int64_t* table, int64_t lo, int64_t hi, int64_t kvh, int64_t bs,
                      float scale, float softcap, float* scores, float* acc_mem, const KT* next_k,
                      const c10::BFloat16* qb) {
  constexpr int D = ND * 16;
  constexpr int DC = v_slices(G <= 2 ? 8 : G <= 6 ? 4 : 2, ND);  // G x DC + DC <= 28 registers
  const int64_t len = hi - lo;
  const int64_t row = kvh * D;
  float* qs = acc_mem + kvh * G * D;  // [kvh * G, D], the scaled queries
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kvh * G * ND; ++i)
    _mm512_storeu_ps(qs + i * 16, _mm512_mul_ps(_mm512_loadu_ps(q + i * 16), vscale));
  walk_blocks(table, lo, hi, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t nxt) {
    for (int64_t h = 0; h < kvh; ++h) {
      const KT* pf = nxt >= 0 ? kc + nxt * bs * row + h * D : vc + table[lo / bs] * bs * row + h * D;
      float* sc = scores + h * G * len + at;
      const float* qh = qs + h * G * D;
      const KT* kb = kc + h * D;
      int g0 = 0;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<KT, c10::BFloat16>) {
        if (qb) {
          const c10::BFloat16* qbh = qb + h * G * D;
          for (; g0 + 3 <= G; g0 += 3, pf = nullptr)
            scores_tile_bf16<3, ND>(sc + g0 * len, len, qbh + g0 * D, kb, slot0, cnt, row, scale, pf);
          if (G - g0 == 2) scores_tile_bf16<2, ND>(sc + g0 * len, len, qbh + g0 * D, kb, slot0, cnt, row, scale, pf);
          if (G - g0 == 1) scores_tile_bf16<1, ND>(sc + g0 * len, len, qbh + g0 * D, kb, slot0, cnt, row, scale, pf);
          continue;
        }
      }
#endif
      for (; g0 + 3 <= G; g0 += 3, pf = nullptr)
        scores_tile<3, ND>(sc + g0 * len, len, qh + g0 * D, kb, slot0, cnt, row, ks, kvh, h, pf);
      if (G - g0 == 2) scores_tile<2, ND>(sc + g0 * len, len, qh + g0 * D, kb, slot0, cnt, row, ks, kvh, h, pf);
      if (G - g0 == 1) scores_tile<1, ND>(sc + g0 * len, len, qh + g0 * D, kb, slot0, cnt, row, ks, kvh, h, pf);
    }
  });
  softmax_rows(scores, kvh * G, len, lse, softcap);
  weighted_v_sum<G, ND, DC>(o, scores, vc, vs, table, lo, hi, kvh, bs, acc_mem, next_k);
}

#elif defined(__AVX2__)
// The tiled kernel for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel client parts):
// 8-lane vectors and 16 registers, so smaller register tiles than above: scores for 2 query heads
// x 4 K rows at a time (8 partial sums, 2 query slices and one K slice: 11 registers), the
// weighted sum of V for all G heads over DC slices of 8 dims (G x DC + DC <= 15). One sequence,
// every KV head per work item, walking each block as one contiguous span, as the AVX-512 kernels do.

// Element i (< 4) of the result = the sum of the 8 lanes of a[i].
inline __m128 transpose_sum4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// sc[g * len + i] = q[g] . k[slot0 + i] (times the int8 scale) for GT (<= 2) query heads of one KV
// head, over the rows of one block read in place, 4 rows at a time; a tail tile repeats its last
// row (only the valid sums are stored). `next` prefetches the next block's rows.
template <int GT, int ND, typename KT>
inline void scores_tile(float* sc, int64_t len, const float* q, const KT* kbase, int64_t slot0, int64_t cnt,
                        int64_t row, const float* ks, int64_t kvh, int64_t h, const KT* next) {
  constexpr int D = ND * 16, N8 = D / 8;
  for (int64_t i0 = 0; i0 < cnt; i0 += 4) {
    const int64_t n4 = std::min<int64_t>(4, cnt - i0);
    int64_t sl[4];
    tile_slots(sl, slot0 + i0, n4);
    const KT* kr[4];
    for (int i = 0; i < 4; ++i) kr[i] = kbase + sl[i] * row;
    if (next)
      for (int64_t i = 0; i < n4; ++i) prefetch_row<D>(next + (i0 + i) * row);
    __m256 acc[GT][4];
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int j = 0; j < N8; ++j) {
      __m256 qj[GT];
#pragma GCC unroll 2
      for (int g = 0; g < GT; ++g) qj[g] = _mm256_loadu_ps(q + g * D + j * 8);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256 kv = load8(kr[i] + j * 8);
#pragma GCC unroll 2
        for (int g = 0; g < GT; ++g) acc[g][i] = _mm256_fmadd_ps(qj[g], kv, acc[g][i]);
      }
    }
    const __m128 ksc = ks ? _mm_setr_ps(ks[sl[0] * kvh + h], ks[sl[1] * kvh + h], ks[sl[2] * kvh + h], ks[sl[3] * kvh + h])
                          : _mm_set1_ps(1.f);
    for (int g = 0; g < GT; ++g) {
      alignas(16) float r[4];
      _mm_store_ps(r, _mm_mul_ps(transpose_sum4(acc[g]), ksc));
      for (int64_t i = 0; i < n4; ++i) sc[g * len + i0 + i] = r[i];
    }
  }
}

// o [kvh * G, D] = the probabilities in `scores` times V, one pass over V: per block and head, the
// G heads' accumulators of DC x 8 dims stay in registers while the block's rows stream through.
// The next block's rows (or, at the last block, the next sequence's first K block) are prefetched
// a line of each row at a time, spread over the head's slices: one slice issuing all of a head's
// lines (64 at head_dim 64, fp32) left the V loads waiting on DRAM, and spread the op ran 1.14-1.23x
// faster on Zen 3 (examples/ab_attention_source.py, SmolLM2's 9,3,64 shape, fp32, one and two
// threads; at 12,2,128, 16,2,128 and 4,1,256: 1.07-1.29x in fp32, 1.02-1.37x in bf16; level at
// 14,2,64 bf16). Two blocks ahead ran slower than one. acc_mem: [kvh * G, D].
template <int G, int ND, int DC, typename KT>
void weighted_v_sum(float* o, const float* scores, const KT* vc, const float* vs, const int64_t* table, int64_t lo,
                    int64_t hi, int64_t kvh, int64_t bs, float* acc_mem, const KT* next_k) {
  constexpr int D = ND * 16, N8 = D / 8;
  static_assert(N8 % DC == 0, "head_dim slices must divide the head");
  // bf16 rows (no scale): each probability broadcast straight from memory, a load with no ALU work,
  // where a product with the scale and a register broadcast took two uops on the FP pipes that
  // widening bf16 keeps busy. At 14,2,64, 16,2,128 and 9,3,64 bf16 the op ran 1.02-1.22x faster
  // (ab_attention_source, Zen 3, one and two threads); fp32 reads are bound by memory, and there it ran
  // level to 0.9x (12,2,128), so fp32 and int8 keep the product.
  constexpr bool kBroadcastFromMemory = std::is_same_v<KT, c10::BFloat16>;
  const int64_t len = hi - lo;
  const int64_t row = kvh * D;
  std::fill(acc_mem, acc_mem + kvh * G * D, 0.f);
  walk_blocks(table, lo, hi, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t nxt) {
    for (int64_t h = 0; h < kvh; ++h) {
      const KT* next = nxt >= 0 ? vc + nxt * bs * row + h * D : (next_k ? next_k + h * D : nullptr);
      float* am = acc_mem + h * G * D;
      const float* pr = scores + h * G * len + at;
      for (int c = 0; c < N8; c += DC) {
        __m256 acc[G][DC];
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
          for (int j = 0; j < DC; ++j) acc[g][j] = _mm256_loadu_ps(am + g * D + (c + j) * 8);
        // this slice's share of the next block's lines: lines [l0, l1) of each row
        constexpr int kLines = row_lines<D, KT>(), kSlices = N8 / DC;
        const int l0 = (c / DC) * kLines / kSlices, l1 = (c / DC + 1) * kLines / kSlices;
        for (int64_t i = 0; i < cnt; ++i) {
          const int64_t slot = slot0 + i;
          const KT* vp = vc + slot * row + h * D + c * 8;
          if (next) prefetch_lines(next + i * row, l0, l1);
          __m256 vv[DC];
#pragma GCC unroll 4
          for (int j = 0; j < DC; ++j) vv[j] = load8(vp + j * 8);
          const float vsc = vs ? vs[slot * kvh + h] : 1.f;
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) {
            const __m256 p = kBroadcastFromMemory ? _mm256_broadcast_ss(pr + g * len + i)
                                                  : _mm256_set1_ps(pr[g * len + i] * vsc);
#pragma GCC unroll 4
            for (int j = 0; j < DC; ++j) acc[g][j] = _mm256_fmadd_ps(p, vv[j], acc[g][j]);
          }
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
          for (int j = 0; j < DC; ++j) _mm256_storeu_ps(am + g * D + (c + j) * 8, acc[g][j]);
      }
    }
  });
  std::memcpy(o, acc_mem, sizeof(float) * kvh * G * D);
}

// One sequence, every KV head, G query heads per KV head: scores in tiles of 2 query heads (each
// tile reads the block's K rows again, from L1), softmax, then the weighted sum of V. Queries come
// as fp32 (a bf16 q is widened by decode_fast); the last K block prefetches V's first block.
template <int G, int ND, typename KT>
void decode_seq_tiled(float* o, float* lse, const float* q, const KT* kc, const KT* vc, const float* ks,
                      const float* vs, const int64_t* table, int64_t lo, int64_t hi, int64_t kvh, int64_t bs,
                      float scale, float softcap, float* scores, float* acc_mem, const KT* next_k,
                      const c10::BFloat16*) {
  constexpr int D = ND * 16, N8 = D / 8;
  constexpr int DC_MAX = 15 / (G + 1);
  constexpr int DC = DC_MAX >= 4 && N8 % 4 == 0 ? 4 : DC_MAX >= 2 ? 2 : 1;
  const int64_t len = hi - lo;
  const int64_t row = kvh * D;
  float* qs = acc_mem + kvh * G * D;  // [kvh * G, D], the scaled queries
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < kvh * G * N8; ++i)
    _mm256_storeu_ps(qs + i * 8, _mm256_mul_ps(_mm256_loadu_ps(q + i * 8), vscale));
  walk_blocks(table, lo, hi, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t nxt) {
    for (int64_t h = 0; h < kvh; ++h) {
      const KT* pf = nxt >= 0 ? kc + nxt * bs * row + h * D : vc + table[lo / bs] * bs * row + h * D;
      float* sc = scores + h * G * len + at;
      const float* qh = qs + h * G * D;
      const KT* kb = kc + h * D;
      int g0 = 0;
      for (; g0 + 2 <= G; g0 += 2, pf = nullptr)
        scores_tile<2, ND>(sc + g0 * len, len, qh + g0 * D, kb, slot0, cnt, row, ks, kvh, h, pf);
      if (G - g0 == 1) scores_tile<1, ND>(sc + g0 * len, len, qh + g0 * D, kb, slot0, cnt, row, ks, kvh, h, pf);
    }
  });
  softmax_rows(scores, kvh * G, len, lse, softcap);
  weighted_v_sum<G, ND, DC>(o, scores, vc, vs, table, lo, hi, kvh, bs, acc_mem, next_k);
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)

using SeqFn = void (*)(float*, float*, const float*, const void*, const void*, const float*, const float*,
                       const int64_t*, int64_t, int64_t, int64_t, int64_t, float, float, float*, float*, const void*,
                       const c10::BFloat16*);

template <int G, int ND, typename KT>
void seq_thunk(float* o, float* lse, const float* q, const void* kc, const void* vc, const float* ks, const float* vs,
               const int64_t* table, int64_t lo, int64_t hi, int64_t kvh, int64_t bs, float scale, float softcap,
               float* scores, float* acc, const void* next_k, const c10::BFloat16* qb) {
#ifdef __AVX512F__
  if constexpr (G <= 3) {
    decode_seq_regs<G, ND, KT>(o, lse, q, static_cast<const KT*>(kc), static_cast<const KT*>(vc), ks, vs, table, lo,
                               hi, kvh, bs, scale, softcap, scores, acc, static_cast<const KT*>(next_k));
    return;
  }
#endif
  decode_seq_tiled<G, ND, KT>(o, lse, q, static_cast<const KT*>(kc), static_cast<const KT*>(vc), ks, vs, table, lo, hi,
                              kvh, bs, scale, softcap, scores, acc, static_cast<const KT*>(next_k), qb);
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
  if (d == 256) return pick_g<16, KT>(g);  // Gemma 2/3
  if (d == 96) return pick_g<6, KT>(g);    // Phi-3/3.5-mini
  return nullptr;
}

// Returns false where no specialised kernel fits (the caller falls back to the generic one).
// q and out are float32, or bfloat16 with bf16_io (converted a sequence at a time here, which
// saves the model two whole-tensor conversions per layer).
template <typename KT>
bool decode_fast(void* out_v, float* lse, const void* q_v, int64_t q_stride, bool bf16_io, const KT* kc, const KT* vc, const float* ks,
                 const float* vs, const int64_t* tables, const int64_t* lo_p, const int64_t* hi_p, int64_t n,
                 int64_t heads, int64_t kvh, int64_t d, int64_t bs, int64_t width, float scale, float softcap) {
  const int64_t group = heads / kvh;
  SeqFn fn = pick<KT>(group, d);
  if (!fn) return false;
  // Split the sequences into one contiguous range per thread of equal total context: callers
  // sort decodes by length, and an even split by count left one thread all the long ones.
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bounds(nt + 1, n);
  {
    int64_t total = 0;
    for (int64_t s = 0; s < n; ++s) total += std::max<int64_t>(hi_p[s] - lo_p[s], 0) + 16;
    int64_t acc = 0, t = 1;
    bounds[0] = 0;
    for (int64_t s = 0; s < n && t < nt; ++s) {
      acc += std::max<int64_t>(hi_p[s] - lo_p[s], 0) + 16;
      while (t < nt && acc * nt >= total * t) bounds[t++] = s + 1;
    }
  }
  at::parallel_for(0, nt, 1, [&](int64_t tb, int64_t te) {
    const int64_t begin = bounds[tb], end = bounds[te];
    FlushDenormals ftz;  // peaked softmaxes make tiny probabilities
    const int64_t hd = heads * d;
    std::vector<float> scores, acc(2 * hd), qbuf(bf16_io ? hd : 0), obuf(bf16_io ? hd : 0);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t lo = lo_p[s], hi = hi_p[s];
      float* o = bf16_io ? obuf.data() : static_cast<float*>(out_v) + s * hd;
      const float* qs = static_cast<const float*>(q_v) + s * q_stride;
      if (bf16_io) {
        const c10::BFloat16* qb = static_cast<const c10::BFloat16*>(q_v) + s * q_stride;
        for (int64_t i = 0; i < hd; ++i) qbuf[i] = to_f(qb[i]);
        qs = qbuf.data();
      }
      float* l = lse ? lse + s * heads : nullptr;
      if (hi <= lo) {
        std::fill(o, o + hd, 0.f);
        if (l) std::fill(l, l + heads, -1e30f);
      } else {
        scores.resize(heads * (hi - lo));
        const KT* next_k = s + 1 < end && hi_p[s + 1] > lo_p[s + 1]
                               ? kc + tables[(s + 1) * width + lo_p[s + 1] / bs] * bs * kvh * d : nullptr;
        // bf16 queries also go to the kernel as stored (the bf16 dot-product score path).
        const c10::BFloat16* qb = bf16_io ? static_cast<const c10::BFloat16*>(q_v) + s * q_stride : nullptr;
        fn(o, l, qs, kc, vc, ks, vs, tables + s * width, lo, hi, kvh, bs, scale, softcap, scores.data(), acc.data(),
           next_k, qb);
      }
      if (bf16_io) {
        c10::BFloat16* ob = static_cast<c10::BFloat16*>(out_v) + s * hd;
        for (int64_t i = 0; i < hd; ++i) ob[i] = c10::BFloat16(o[i]);
      }
    }
  });
  return true;
}
bool has_fast_path(int64_t heads, int64_t kvh, int64_t d) {
  return kvh > 0 && heads % kvh == 0 && pick<float>(heads / kvh, d) != nullptr;
}
#else
template <typename KT>
bool decode_fast(void*, float*, const void*, int64_t, bool, const KT*, const KT*, const float*, const float*, const int64_t*,
                 const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float) {
  return false;
}
bool has_fast_path(int64_t, int64_t, int64_t) { return false; }
#endif

void paged_decode(at::Tensor out, c10::optional<at::Tensor> lse, at::Tensor q, at::Tensor k_cache,
                  at::Tensor v_cache, c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                  at::Tensor block_tables, at::Tensor lo, at::Tensor hi, double scale_d, double softcap_d) {
  const bool bf16_io = q.scalar_type() == at::kBFloat16;
  check_attention_args("paged_decode", out, q, k_cache, v_cache, k_scale, v_scale);
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
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), width = block_tables.size(1);
  float* lse_p = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  TORCH_CHECK(!bf16_io || has_fast_path(heads, kvh, d),
              "paged_decode: bfloat16 q needs the specialised kernel (AVX-512 or AVX2, head_dim 64, 96, 128 or 256, at most 8 "
              "query heads per KV head); pass float32");
  void* o = out.data_ptr();
  const void* qp = q.data_ptr();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = lo.data_ptr<int64_t>();
  const int64_t* hp = hi.data_ptr<int64_t>();
  const float scale = static_cast<float>(scale_d), softcap = static_cast<float>(softcap_d);
  auto run = [&](auto* kc, auto* vc, const float* ks, const float* vs) {
    if (!decode_fast(o, lse_p, qp, q.stride(0), bf16_io, kc, vc, ks, vs, tp, lp, hp, n, heads, kvh, d, bs, width, scale,
                     softcap))
      decode_impl(static_cast<float*>(o), lse_p, static_cast<const float*>(qp), q.stride(0), kc, vc, ks, vs, tp, lp, hp, n, heads,
                  kvh, d, bs, width, scale, softcap);
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
        "Tensor? v_scale, Tensor block_tables, Tensor lo, Tensor hi, float scale, float softcap=0.) -> ()",
        &paged_decode);
  m.def("has_fast_path(int heads, int kv_heads, int head_dim) -> bool", &has_fast_path);
}
