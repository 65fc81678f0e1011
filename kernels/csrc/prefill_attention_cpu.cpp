// Causal prefill attention for the CPU over the paged cache, for whole prompts and for chunks of
// one (chunked prefill, prefix-cache hits): the new tokens' K/V are already in the cache.
//
// torch's path ran SDPA once per sequence (examples/bench_cpu_attention.py measures the two side
// by side), after gathering the cached keys into a copy and building a mask for every chunk that
// did not start at position 0. This reads K/V through the block tables and works flash-style:
// a work item is (sequence, tile of TQ query tokens, KV head), its TQ x group query rows meet the
// keys in chunks of KC, with an online softmax. Each chunk's K is converted to fp32 and
// transposed once (16 x 16 in registers), so the score micro-kernel is plain broadcast-FMAs over
// 8 rows x 32 keys, and P.V runs 4 rows x 64 dims at a time (AVX-512; on AVX2 8 x 8 transposes,
// 6 rows x 16 keys and 6 rows x 16 dims).
//
// Sequence p's queries are rows [cu[p], cu[p+1]) of q, at positions start[p], start[p] + 1, ...
// A query at position t sees keys [t - window + 1, t] (window > 0) or [0, t].
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

#if defined(__AVX512F__) || defined(__AVX2__)

constexpr int64_t TQ = 16;   // query tokens per tile (AVX2 without GQA, prompts of 128+ tokens: 48)
constexpr int64_t KC = 128;  // keys per chunk, a multiple of 32
#endif

#ifdef __AVX512F__

// r[i] = row i of a 16 x 16 tile, in place to column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // u[4i + c] holds, in each 128-bit lane L, column c of rows 4i..4i+3 restricted to lane L's
  // columns (4L + c). Gather lanes: first pairs of row groups, then the two halves.
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));       // lanes 0,2 of g0 | g1
    t[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));   // lanes 1,3
    t[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], _MM_SHUFFLE(2, 0, 2, 0));        // lane 0
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], _MM_SHUFFLE(3, 1, 3, 1));    // lane 2
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(2, 0, 2, 0));   // lane 1
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], _MM_SHUFFLE(3, 1, 3, 1));  // lane 3
  }
}

// S[r][c0 .. c0 + 32) for rows r0 .. r0 + 8: Q [rows][d] (pre-scaled), Kt [d][KC].
inline void scores_8x32(const float* Q, const float* Kt, float* S, int64_t d, int64_t r0, int64_t c0) {
  __m512 a[8][2];
  for (int r = 0; r < 8; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  const float* q = Q + r0 * d;
  for (int64_t k = 0; k < d; ++k) {
    const __m512 k0 = _mm512_loadu_ps(Kt + k * KC + c0), k1 = _mm512_loadu_ps(Kt + k * KC + c0 + 16);
    for (int r = 0; r < 8; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r * d + k]);
      a[r][0] = _mm512_fmadd_ps(qb, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(qb, k1, a[r][1]);
    }
  }
  for (int r = 0; r < 8; ++r) {
    _mm512_storeu_ps(S + (r0 + r) * KC + c0, a[r][0]);
    _mm512_storeu_ps(S + (r0 + r) * KC + c0 + 16, a[r][1]);
  }
}

#ifdef __AVX512BF16__
// The same from bf16 pairs with vdpbf16ps (two products per lane, twice the FMA path's rate):
// Q2 [rows][d / 2] pairs (q[2p], q[2p + 1]) and K2 [d / 2][KC] pairs (k[2p], k[2p + 1]) of each
// key; the scale is applied to the fp32 sums.
inline void scores_8x32_bf16(const uint32_t* Q2, const uint32_t* K2, float* S, int64_t d2, int64_t r0, int64_t c0,
                             float scale) {
  __m512 a[8][2];
  for (int r = 0; r < 8; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  const uint32_t* q = Q2 + r0 * d2;
  for (int64_t p = 0; p < d2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(K2 + p * KC + c0);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(K2 + p * KC + c0 + 16);
    for (int r = 0; r < 8; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * d2 + p]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], qb, k0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], qb, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < 8; ++r) {
    _mm512_storeu_ps(S + (r0 + r) * KC + c0, _mm512_mul_ps(a[r][0], sc));
    _mm512_storeu_ps(S + (r0 + r) * KC + c0 + 16, _mm512_mul_ps(a[r][1], sc));
  }
}
#endif

// O[r0 .. r0 + 4][s0 .. s0 + 16 NS) += P[r][0 .. nk) . V[0 .. nk)[same dims]; V [KC][d].
template <int NS>
inline void pv_4rows(const float* P, const float* V, float* O, int64_t d, int64_t nk, int64_t r0, int64_t s0) {
  __m512 a[4][NS];
  for (int r = 0; r < 4; ++r)
    for (int n = 0; n < NS; ++n) a[r][n] = _mm512_loadu_ps(O + (r0 + r) * d + s0 + 16 * n);
  const float* p0 = P + r0 * KC;
  for (int64_t j = 0; j < nk; ++j) {
    __m512 v[NS];
    for (int n = 0; n < NS; ++n) v[n] = _mm512_loadu_ps(V + j * d + s0 + 16 * n);
    for (int r = 0; r < 4; ++r) {
      const __m512 p = _mm512_set1_ps(p0[r * KC + j]);
      for (int n = 0; n < NS; ++n) a[r][n] = _mm512_fmadd_ps(p, v[n], a[r][n]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int n = 0; n < NS; ++n) _mm512_storeu_ps(O + (r0 + r) * d + s0 + 16 * n, a[r][n]);
}

// The same for 64 dims, written out: with an array GCC either re-loaded V for every row (a memory
// operand per FMA: the loop ran load-bound) or, told to keep it in registers, spilled it.
template <>
inline void pv_4rows<4>(const float* P, const float* V, float* O, int64_t d, int64_t nk, int64_t r0, int64_t s0) {
  float* o = O + r0 * d + s0;
  __m512 a00 = _mm512_loadu_ps(o), a01 = _mm512_loadu_ps(o + 16), a02 = _mm512_loadu_ps(o + 32),
         a03 = _mm512_loadu_ps(o + 48);
  __m512 a10 = _mm512_loadu_ps(o + d), a11 = _mm512_loadu_ps(o + d + 16), a12 = _mm512_loadu_ps(o + d + 32),
         a13 = _mm512_loadu_ps(o + d + 48);
  __m512 a20 = _mm512_loadu_ps(o + 2 * d), a21 = _mm512_loadu_ps(o + 2 * d + 16),
         a22 = _mm512_loadu_ps(o + 2 * d + 32), a23 = _mm512_loadu_ps(o + 2 * d + 48);
  __m512 a30 = _mm512_loadu_ps(o + 3 * d), a31 = _mm512_loadu_ps(o + 3 * d + 16),
         a32 = _mm512_loadu_ps(o + 3 * d + 32), a33 = _mm512_loadu_ps(o + 3 * d + 48);
  const float* p0 = P + r0 * KC;
  const float* vp = V + s0;
  for (int64_t j = 0; j < nk; ++j, vp += d) {
    __m512 v0 = _mm512_loadu_ps(vp), v1 = _mm512_loadu_ps(vp + 16), v2 = _mm512_loadu_ps(vp + 32),
           v3 = _mm512_loadu_ps(vp + 48);
    asm("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3));
    __m512 p = _mm512_set1_ps(p0[j]);
    a00 = _mm512_fmadd_ps(p, v0, a00); a01 = _mm512_fmadd_ps(p, v1, a01);
    a02 = _mm512_fmadd_ps(p, v2, a02); a03 = _mm512_fmadd_ps(p, v3, a03);
    p = _mm512_set1_ps(p0[KC + j]);
    a10 = _mm512_fmadd_ps(p, v0, a10); a11 = _mm512_fmadd_ps(p, v1, a11);
    a12 = _mm512_fmadd_ps(p, v2, a12); a13 = _mm512_fmadd_ps(p, v3, a13);
    p = _mm512_set1_ps(p0[2 * KC + j]);
    a20 = _mm512_fmadd_ps(p, v0, a20); a21 = _mm512_fmadd_ps(p, v1, a21);
    a22 = _mm512_fmadd_ps(p, v2, a22); a23 = _mm512_fmadd_ps(p, v3, a23);
    p = _mm512_set1_ps(p0[3 * KC + j]);
    a30 = _mm512_fmadd_ps(p, v0, a30); a31 = _mm512_fmadd_ps(p, v1, a31);
    a32 = _mm512_fmadd_ps(p, v2, a32); a33 = _mm512_fmadd_ps(p, v3, a33);
  }
  _mm512_storeu_ps(o, a00); _mm512_storeu_ps(o + 16, a01); _mm512_storeu_ps(o + 32, a02);
  _mm512_storeu_ps(o + 48, a03);
  _mm512_storeu_ps(o + d, a10); _mm512_storeu_ps(o + d + 16, a11); _mm512_storeu_ps(o + d + 32, a12);
  _mm512_storeu_ps(o + d + 48, a13);
  _mm512_storeu_ps(o + 2 * d, a20); _mm512_storeu_ps(o + 2 * d + 16, a21); _mm512_storeu_ps(o + 2 * d + 32, a22);
  _mm512_storeu_ps(o + 2 * d + 48, a23);
  _mm512_storeu_ps(o + 3 * d, a30); _mm512_storeu_ps(o + 3 * d + 16, a31); _mm512_storeu_ps(o + 3 * d + 32, a32);
  _mm512_storeu_ps(o + 3 * d + 48, a33);
}

#elif defined(__AVX2__)
// AVX2 (+FMA) micro-kernels for CPUs without AVX-512 (AMD Zen 2/3, Intel client parts): 8-lane
// vectors and 16 registers, so 8 x 8 transposes, 6 rows x 16 keys of scores and 6 rows x 16 dims
// of P.V at a time (12 accumulators each; 4- and 2-row tiles for the last rows).

// r[i] = row i of an 8 x 8 tile, in place to column i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // t[2i] = [r(2i)_0 r(2i+1)_0 r(2i)_1 r(2i+1)_1 | the same for columns 4, 5]
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + c]: column c | column c + 4 of rows 4i .. 4i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// C[r][0 .. 16) = (Accumulate ? C[r][0 .. 16) : 0) + sum over k < nk of A[r][k] * B[k][0 .. 16), for
// rows r < R: A's rows lda apart, B's ldb, C's ldc. The scores are Q (pre-scaled) times Kt [d][KC]
// over 16 keys, P.V is P times V [KC][d] over 16 dims. Six rows (12 accumulators, B's two vectors
// and a broadcast: 15 of the 16 registers) give 12 FMAs per step of k for 2 B loads and 6
// broadcasts; the 4-row tiles they replaced gave 8, and GCC had folded K's loads into the FMAs (a
// memory operand each: 8 loads a step).
template <int R, bool Accumulate>
inline void tile_rx16(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t nk, float* C, int64_t ldc) {
  __m256 a[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    a[r][0] = Accumulate ? _mm256_loadu_ps(C + r * ldc) : _mm256_setzero_ps();
    a[r][1] = Accumulate ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < nk; ++k, B += ldb) {
    __m256 b0 = _mm256_loadu_ps(B), b1 = _mm256_loadu_ps(B + 8);
    asm("" : "+x"(b0), "+x"(b1));  // B in registers, not a memory operand per FMA
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(A + r * lda + k);
      a[r][0] = _mm256_fmadd_ps(x, b0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(x, b1, a[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(C + r * ldc, a[r][0]);
    _mm256_storeu_ps(C + r * ldc + 8, a[r][1]);
  }
}

// The tile of rows [r0, r0 + 6) of C (+)= A . B, or of the last 4 or 2 rows (rows is even).
template <bool Accumulate>
inline void tile_at(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t nk, float* C, int64_t ldc,
                    int64_t r0, int64_t rows) {
  A += r0 * lda;
  C += r0 * ldc;
  if (r0 + 6 <= rows) tile_rx16<6, Accumulate>(A, lda, B, ldb, nk, C, ldc);
  else if (r0 + 4 == rows) tile_rx16<4, Accumulate>(A, lda, B, ldb, nk, C, ldc);
  else tile_rx16<2, Accumulate>(A, lda, B, ldb, nk, C, ldc);
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// The first key a query at position pos sees: pos - window + 1 with a window (window > 0), else 0.
inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

struct Item {
  int64_t seq, t0, nq, head, cost;  // query tokens [t0, t0 + nq) of sequence seq
};

struct Buffers {
  std::vector<float> q, kt, v, s, o, m, l, alpha;
  std::vector<uint32_t> q2, k2;  // the bf16 score path: pairs of bf16 per 32-bit element
  std::vector<int64_t> slots;
  std::vector<const char*> pf;  // lines the next item reads first (prefetch_ahead), issued during this one
  Buffers(int64_t rows, int64_t d)
      : q(rows * d), kt(d * KC), v(KC * d), s(rows * KC), o(rows * d), m(rows), l(rows), alpha(rows),
        q2(rows * d / 2), k2(d / 2 * KC), slots(KC) {}
};

// One work item: query tokens [t0, t0 + nq) of sequence p against KV head h.
template <typename QT, typename KT>
void prefill_item(QT* out, const QT* q, int64_t q_stride, const KT* kc, const KT* vc, const float* ks, const float* vs,
                  const int64_t* table, int64_t row0, int64_t pos0, int64_t nq, int64_t h, int64_t heads, int64_t kvh,
                  int64_t d, int64_t bs, int64_t window, float scale, float softcap, Buffers& b) {
#ifdef __AVX512F__
  constexpr int64_t kRowPad = 8, kKeyPad = 32;  // scores_8x32
#else
  constexpr int64_t kRowPad = 2, kKeyPad = 16;  // the 6-, 4- and 2-row tiles of 16 keys
#endif
  const int64_t G = heads / kvh, M = nq * G, Mp = (M + kRowPad - 1) / kRowPad * kRowPad;
#ifdef __AVX512BF16__
  // bf16 q and cache: scores from the bf16 values as they are (the FMA path converts them to fp32
  // first, exactly; the products and sums are fp32 either way).
  constexpr bool pairs = std::is_same<QT, c10::BFloat16>::value && std::is_same<KT, c10::BFloat16>::value;
  const bool bf16_scores = pairs && d % 32 == 0;
#else
  const bool bf16_scores = false;
#endif
  const int64_t d2 = d / 2;
  if (bf16_scores) {  // Q rows m = i * G + g as bf16 pairs; padding rows zero
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(b.q2.data() + (i * G + g) * d2, q + (row0 + i) * q_stride + (h * G + g) * d, d * 2);
    std::fill(b.q2.begin() + M * d2, b.q2.begin() + Mp * d2, 0u);
  } else {  // Q rows m = i * G + g, scaled; padding rows zero
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G; ++g) {
        float* dst = b.q.data() + (i * G + g) * d;
        row_to_f32(q + (row0 + i) * q_stride + (h * G + g) * d, dst, d);
        for (int64_t k = 0; k < d; ++k) dst[k] *= scale;
      }
    std::fill(b.q.begin() + M * d, b.q.begin() + Mp * d, 0.f);
  }
  std::fill(b.o.begin(), b.o.begin() + Mp * d, 0.f);
  std::fill(b.m.begin(), b.m.begin() + Mp, -1e30f);
  std::fill(b.l.begin(), b.l.begin() + Mp, 0.f);
  const int64_t klo = first_key(pos0, window), khi = pos0 + nq;
  const int64_t row = kvh * d;
  // the next item's lines, spread over the first chunk's rows
  const size_t pf_per_row = (b.pf.size() + Mp - 1) / Mp;
  size_t pf_at = 0;
  for (int64_t c0 = klo; c0 < khi; c0 += KC) {
    const int64_t nk = std::min(KC, khi - c0), nkp = (nk + kKeyPad - 1) / kKeyPad * kKeyPad;
    walk_blocks(table, c0, c0 + nk, bs, [&](int64_t slot0, int64_t cnt, int64_t at, int64_t) {
      for (int64_t i = 0; i < cnt; ++i) b.slots[at + i] = slot0 + i;
    });
#ifdef __AVX512F__
    // K chunk -> Kt [d][KC] (transposed 16 keys x 16 dims at a time), V chunk -> V [KC][d].
    // The bf16 score path: K2 [d / 2][KC], 16 keys x 16 bf16 pairs transposed as 32-bit values.
    for (int64_t g0 = 0; bf16_scores && g0 < nkp; g0 += 16) {
      for (int64_t dv = 0; dv < d / 32; ++dv) {
        __m512 r[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t j = g0 + i;
          r[i] = j < nk ? _mm512_castsi512_ps(_mm512_loadu_si512(kc + b.slots[j] * row + h * d + dv * 32))
                        : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i)
          _mm512_storeu_ps(reinterpret_cast<float*>(b.k2.data()) + (dv * 16 + i) * KC + g0, r[i]);
      }
    }
    for (int64_t g0 = 0; !bf16_scores && g0 < nkp; g0 += 16) {
      for (int64_t dv = 0; dv < d / 16; ++dv) {
        __m512 r[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t j = g0 + i;
          if (j < nk) {
            const int64_t slot = b.slots[j];
            r[i] = load16(kc + slot * row + h * d + dv * 16);
            if (ks) r[i] = _mm512_mul_ps(r[i], _mm512_set1_ps(ks[slot * kvh + h]));
          } else {
            r[i] = _mm512_setzero_ps();
          }
        }
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(b.kt.data() + (dv * 16 + i) * KC + g0, r[i]);
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = b.slots[j];
      const __m512 sc = _mm512_set1_ps(vs ? vs[slot * kvh + h] : 1.f);
      for (int64_t dv = 0; dv < d / 16; ++dv)
        _mm512_storeu_ps(b.v.data() + j * d + dv * 16, _mm512_mul_ps(load16(vc + slot * row + h * d + dv * 16), sc));
    }
    for (int64_t r0 = 0; r0 < Mp; r0 += 8)
      for (int64_t cc = 0; cc < nkp; cc += 32) {
#ifdef __AVX512BF16__
        if (bf16_scores) {
          scores_8x32_bf16(b.q2.data(), b.k2.data(), b.s.data(), d2, r0, cc, scale);
          continue;
        }
#endif
        scores_8x32(b.q.data(), b.kt.data(), b.s.data(), d, r0, cc);
      }
#else
    // K chunk -> Kt [d][KC] (transposed 8 keys x 8 dims at a time), V chunk -> V [KC][d].
    for (int64_t g0 = 0; g0 < nkp; g0 += 8) {
      for (int64_t dv = 0; dv < d / 8; ++dv) {
        __m256 r[8];
        for (int64_t i = 0; i < 8; ++i) {
          const int64_t j = g0 + i;
          if (j < nk) {
            const int64_t slot = b.slots[j];
            r[i] = load8(kc + slot * row + h * d + dv * 8);
            if (ks) r[i] = _mm256_mul_ps(r[i], _mm256_set1_ps(ks[slot * kvh + h]));
          } else {
            r[i] = _mm256_setzero_ps();
          }
        }
        transpose8(r);
        for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(b.kt.data() + (dv * 8 + i) * KC + g0, r[i]);
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = b.slots[j];
      const __m256 sc = _mm256_set1_ps(vs ? vs[slot * kvh + h] : 1.f);
      for (int64_t dv = 0; dv < d / 8; ++dv)
        _mm256_storeu_ps(b.v.data() + j * d + dv * 8, _mm256_mul_ps(load8(vc + slot * row + h * d + dv * 8), sc));
    }
    for (int64_t r0 = 0; r0 < Mp; r0 += 6)
      for (int64_t cc = 0; cc < nkp; cc += 16)
        tile_at<false>(b.q.data(), d, b.kt.data() + cc, KC, d, b.s.data() + cc, KC, r0, Mp);
#endif
    // Online softmax over each row's visible keys of the chunk; the rest get probability 0.
    for (int64_t r = 0; r < Mp; ++r) {
      for (const size_t e = std::min(b.pf.size(), pf_at + pf_per_row); pf_at < e; ++pf_at)
        _mm_prefetch(b.pf[pf_at], _MM_HINT_T1);
      float* s = b.s.data() + r * KC;
      int64_t jlo = 0, jhi = 0;
      if (r < M) {
        const int64_t t = pos0 + r / G;
        jlo = std::max<int64_t>(0, first_key(t, window) - c0);
        jhi = std::min(nk, t + 1 - c0);
      }
      if (jhi <= jlo) {
        std::fill(s, s + nk, 0.f);
        b.alpha[r] = 1.f;
        continue;
      }
      if (softcap > 0.f) soft_cap(s + jlo, jhi - jlo, softcap);
      const float mnew = std::max(b.m[r], row_max(s, jlo, jhi));
      b.alpha[r] = b.m[r] <= -1e30f ? 0.f : std::exp(b.m[r] - mnew);
      const float z = exp_sum(s, jlo, jhi, mnew);
      std::fill(s, s + jlo, 0.f);
      std::fill(s + jhi, s + nk, 0.f);
      b.l[r] = b.l[r] * b.alpha[r] + z;
      b.m[r] = mnew;
      if (b.alpha[r] != 1.f)
        for (int64_t k = 0; k < d; ++k) b.o[r * d + k] *= b.alpha[r];
    }
#ifdef __AVX512F__
    for (int64_t r0 = 0; r0 < Mp; r0 += 4) {
      int64_t s0 = 0;
      for (; s0 + 64 <= d; s0 += 64) pv_4rows<4>(b.s.data(), b.v.data(), b.o.data(), d, nk, r0, s0);
      switch ((d - s0) / 16) {
        case 1: pv_4rows<1>(b.s.data(), b.v.data(), b.o.data(), d, nk, r0, s0); break;
        case 2: pv_4rows<2>(b.s.data(), b.v.data(), b.o.data(), d, nk, r0, s0); break;
        case 3: pv_4rows<3>(b.s.data(), b.v.data(), b.o.data(), d, nk, r0, s0); break;
        default: break;
      }
    }
#else
    for (int64_t r0 = 0; r0 < Mp; r0 += 6)
      for (int64_t s0 = 0; s0 < d; s0 += 16)
        tile_at<true>(b.s.data(), KC, b.v.data() + s0, d, nk, b.o.data() + s0, d, r0, Mp);
#endif
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t i = r / G, g = r % G;
    float* o = b.o.data() + r * d;
    const float inv = 1.f / b.l[r];
    for (int64_t k = 0; k < d; ++k) o[k] *= inv;
    row_from_f32(o, out + (row0 + i) * heads * d + (h * G + g) * d, d);
  }
}

// The lines item i reads first from memory, for the item before it to prefetch: its query rows, and
// the K and V rows of its own tokens (the item before it, the same sequence and head's previous
// tile, read the earlier ones), or of its first chunk where it starts a (sequence, head). A
// head's K or V row is one d-wide slice of a token's kvh x d row, so the hardware prefetchers,
// which follow strides within a page, miss most of them.
template <typename QT, typename KT>
void prefetch_ahead(std::vector<const char*>& pf, const std::vector<Item>& items, int64_t i, const QT* q, int64_t q_stride,
                    const KT* kc, const KT* vc, const int64_t* tables, int64_t width, const int64_t* cu,
                    const int64_t* start, int64_t kvh, int64_t group, int64_t d, int64_t bs, int64_t window) {
  pf.clear();
  const Item& it = items[i];
  const int64_t pos0 = start[it.seq] + it.t0;
  const bool fresh = items[i - 1].seq != it.seq || items[i - 1].head != it.head;
  const int64_t klo = first_key(pos0, window);
  const int64_t k0 = fresh ? klo : pos0, k1 = fresh ? std::min(pos0 + it.nq, klo + KC) : pos0 + it.nq;
  const int64_t head_bytes = d * static_cast<int64_t>(sizeof(KT)), row_bytes = kvh * head_bytes;
  walk_blocks(tables + it.seq * width, k0, k1, bs, [&](int64_t slot0, int64_t cnt, int64_t, int64_t) {
    for (int64_t slot = slot0; slot < slot0 + cnt; ++slot) {
      const char* kp = reinterpret_cast<const char*>(kc) + slot * row_bytes + it.head * head_bytes;
      const char* vp = reinterpret_cast<const char*>(vc) + slot * row_bytes + it.head * head_bytes;
      for (int64_t o = 0; o < head_bytes; o += 64) {
        pf.push_back(kp + o);
        pf.push_back(vp + o);
      }
    }
  });
  const int64_t q_bytes = group * d * static_cast<int64_t>(sizeof(QT));
  for (int64_t r = 0; r < it.nq; ++r) {
    const char* qp = reinterpret_cast<const char*>(q + (cu[it.seq] + it.t0 + r) * q_stride + it.head * group * d);
    for (int64_t o = 0; o < q_bytes; o += 64) pf.push_back(qp + o);
  }
}

template <typename QT, typename KT>
void prefill_run(QT* out, const QT* q, int64_t q_stride, const KT* kc, const KT* vc, const float* ks, const float* vs,
                 const int64_t* tables, int64_t width, const int64_t* cu, const int64_t* start, int64_t nseq,
                 int64_t heads, int64_t kvh, int64_t d, int64_t bs, int64_t window, float scale, float softcap) {
  // Query tokens per tile of sequence p. On AVX2 a tile's K/V chunk is read, transposed and copied
  // once for all its rows, and without GQA (one query head a group) 16 tokens are only 16 rows:
  // there tiles of 48 for chunks of 128+ tokens ran 1.16-1.53x at 32 x 32 x 96 (16 x 256 to
  // 2 x 1,000 tokens), while 48 for 64-token prompts ran 0.95-0.98x: more of the masked triangle
  // is computed. (Two heads a group at 32 tokens ran level.)
#ifdef __AVX512F__
  constexpr int64_t kLongTiles = 1;
#else
  constexpr int64_t kLongTiles = 3;
#endif
  const int64_t long_tq = heads == kvh ? kLongTiles * TQ : TQ;  // also the buffers' tile height
  std::vector<Item> items;
  int64_t total = 0;
  // Items in (sequence, KV head, tile) order: a tile's K/V chunks are mostly the ones the same head's
  // previous tile just read, so they come from L1/L2. Tile-major order (each tile over every head
  // in turn) read them back from L3 or memory: without GQA (32 heads, head_dim 96) head-major ran
  // 1.07-1.09x, on top of the softmax's exp (Zen 3; GQA shapes level). prefetch_ahead then fetches
  // the lines the next item reads first while this one runs: 1.05-1.15x more at 64-token prompts,
  // level on long ones (Zen 3, noisy).
  for (int64_t p = 0; p < nseq; ++p)
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t t0 = 0, tq = cu[p + 1] - cu[p] >= 128 ? long_tq : TQ; t0 < cu[p + 1] - cu[p]; t0 += tq) {
        const int64_t nq = std::min(tq, cu[p + 1] - cu[p] - t0), pos0 = start[p] + t0;
        const int64_t keys = pos0 + nq - first_key(pos0, window);
        items.push_back({p, t0, nq, h, nq * (keys + 32) + 256});
        total += items.back().cost;
      }
  // One contiguous range of items per thread, of equal total cost.
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bounds(nt + 1, n);
  bounds[0] = 0;
  int64_t acc = 0, t = 1;
  for (int64_t i = 0; i < n && t < nt; ++i) {
    acc += items[i].cost;
    while (t < nt && acc * nt >= total * t) bounds[t++] = i + 1;
  }
  at::parallel_for(0, nt, 1, [&](int64_t tb, int64_t te) {
    FlushDenormals ftz;  // tiny probabilities would each cost a microcode assist
    Buffers b(long_tq * (heads / kvh) + 8, d);
    for (int64_t i = bounds[tb]; i < bounds[te]; ++i) {
      const Item& it = items[i];
      if (i + 1 < bounds[te])
        prefetch_ahead(b.pf, items, i + 1, q, q_stride, kc, vc, tables, width, cu, start, kvh, heads / kvh, d, bs, window);
      else
        b.pf.clear();
      prefill_item(out, q, q_stride, kc, vc, ks, vs, tables + it.seq * width, cu[it.seq] + it.t0,
                   start[it.seq] + it.t0, it.nq, it.head, heads, kvh, d, bs, window, scale, softcap, b);
    }
  });
}

bool has_prefill_path(int64_t heads, int64_t kvh, int64_t d) {
  return kvh > 0 && heads % kvh == 0 && d % 16 == 0 && d > 0;
}
#else
bool has_prefill_path(int64_t, int64_t, int64_t) { return false; }
#endif

void paged_prefill(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                   c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, at::Tensor block_tables,
                   at::Tensor cu_seqlens, at::Tensor start_pos, int64_t window, double scale_d, double softcap_d) {
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  check_attention_args("paged_prefill", out, q, k_cache, v_cache, k_scale, v_scale);
  const int64_t heads = q.size(1), kvh = k_cache.size(2), d = q.size(2), bs = k_cache.size(1);
  TORCH_CHECK(has_prefill_path(heads, kvh, d),
              "paged_prefill: needs AVX-512 or AVX2, head_dim a multiple of 16 and heads a multiple of kv_heads");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong && block_tables.dim() == 2,
              "paged_prefill: block_tables must be contiguous int64 [num_seqs, width]");
  const int64_t nseq = block_tables.size(0), width = block_tables.size(1);
  TORCH_CHECK(cu_seqlens.is_contiguous() && cu_seqlens.scalar_type() == at::kLong && cu_seqlens.numel() == nseq + 1,
              "paged_prefill: cu_seqlens must be contiguous int64 [num_seqs + 1]");
  TORCH_CHECK(start_pos.is_contiguous() && start_pos.scalar_type() == at::kLong && start_pos.numel() == nseq,
              "paged_prefill: start_pos must be contiguous int64 [num_seqs]");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* st = start_pos.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[nseq] == q.size(0), "paged_prefill: cu_seqlens must run from 0 to q's row count");
  for (int64_t p = 0; p < nseq; ++p)
    TORCH_CHECK(cu[p + 1] >= cu[p] && st[p] >= 0 && st[p] + cu[p + 1] - cu[p] <= width * bs,
                "paged_prefill: sequence ", p, " (start ", st[p], ", ", cu[p + 1] - cu[p],
                " tokens) does not fit its block table (", width, " blocks of ", bs, ")");
#if defined(__AVX512F__) || defined(__AVX2__)
  const float scale = static_cast<float>(scale_d), softcap = static_cast<float>(softcap_d);
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  auto with_cache = [&](auto* qp, auto* op) {
    const int64_t qs = q.stride(0);
    if (k_cache.scalar_type() == at::kFloat)
      prefill_run(op, qp, qs, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), nullptr, nullptr, tp, width, cu,
                  st, nseq, heads, kvh, d, bs, window, scale, softcap);
    else if (k_cache.scalar_type() == at::kBFloat16)
      prefill_run(op, qp, qs, k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), nullptr, nullptr,
                  tp, width, cu, st, nseq, heads, kvh, d, bs, window, scale, softcap);
    else
      prefill_run(op, qp, qs, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), k_scale->data_ptr<float>(),
                  v_scale->data_ptr<float>(), tp, width, cu, st, nseq, heads, kvh, d, bs, window, scale, softcap);
  };
  if (bf16)
    with_cache(q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  else
    with_cache(q.data_ptr<float>(), out.data_ptr<float>());
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("paged_prefill(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor cu_seqlens, Tensor start_pos, int window, float scale, float softcap=0.) -> ()",
        &paged_prefill);
  m.def("has_prefill_path(int heads, int kv_heads, int head_dim) -> bool", &has_prefill_path);
}
