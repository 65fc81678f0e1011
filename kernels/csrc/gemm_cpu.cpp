// Our GEMMs, y = x @ W.T (+ b). gemm_bf16 for AVX512-BF16 CPUs without AMX (AMD Zen 4/5, Intel
// Cooper Lake), on pack_bf16_weight's layout; gemm_bf16_fma and gemm_f32_fma for AVX2 + FMA CPUs
// without AVX-512 (below), on pack_bf16_weight's and pack_f32_weight's; gemm_f32_avx512 for fp32
// weights on AVX-512 (AMD Zen 4 by default), on pack_f32_weight's. gemm_bf16 and gemm_f32_avx512
// share one walk (`walk`, templated on a trait per dtype).
//
// oneDNN's bf16 kernels reach the dot-product peak on large row counts, but a decode step has
// tens of rows, and there oneDNN ran at 75-85% of its 256-row rate on Qwen2.5-1.5B's shapes: it
// waits on the weight stream from DRAM each time a new column panel starts. Here the weight is
// packed for vdpbf16ps (per 16 columns, the K pairs in order: one 64-byte load feeds 16 columns
// times 2 k), a register tile of up to 6 rows x 64 columns walks K, and while one panel is
// computed the next panel's weights are prefetched into L2, spread over the row tiles of this one.
// Panels longer than 2,048 k are cut into chunks that fit L2, with fp32 partial sums in between.
// CPUs with AMX take gemm_bf16_amx (below: the same packed weight on AMX tiles); the Python side
// decides.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BATCHGEN_DPBF16 1
#endif
#if defined(__AVX512F__)
#define BATCHGEN_AVX512F 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define BATCHGEN_FMA 1
#endif
#if defined(BATCHGEN_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BATCHGEN_AMX 1  // gemm_bf16_amx, and moe_experts' experts of many rows (below)
#endif
#if defined(BATCHGEN_AVX512F) || defined(BATCHGEN_FMA)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 16;        // columns per packed block (one zmm, or two ymm, of fp32 sums)
constexpr int64_t kPanel = 4;        // blocks per register tile: 64 columns
constexpr int kRows = 6;             // rows per register tile: 6 x 4 accumulators
constexpr int64_t kChunkLines = 1024;  // lines per L2 chunk of a panel (4 x 1024 x 64 B = 256 KiB)
constexpr int64_t kItemRows = 8;     // the grouped walks' cost of a panel's weight stream, in rows (walk_groups)

// The grouped walks' work split: item i (group i / panels, a panel of it) costs its group's rows
// plus kItemRows; thread t of `threads` takes the items whose cost starts in its share of the total.
struct ItemSplit {
  std::vector<int64_t> before;  // the cost of the items before each; back(): the total
  template <class G>
  ItemSplit(const std::vector<G>& groups, int64_t panels) : before(groups.size() * panels + 1, 0) {
    for (size_t i = 0; i + 1 < before.size(); ++i) before[i + 1] = before[i] + groups[i / panels].m + kItemRows;
  }
  int64_t items() const { return static_cast<int64_t>(before.size()) - 1; }
  std::pair<int64_t, int64_t> range(int64_t t, int64_t threads) const {
    const auto first = [&](int64_t share) {
      return std::lower_bound(before.begin(), before.end() - 1, before.back() * share / threads) - before.begin();
    };
    return {first(t), t + 1 == threads ? items() : first(t + 1)};
  }
};

bool has_dpbf16_gemm() {
#ifdef BATCHGEN_DPBF16
  return true;
#else
  return false;
#endif
}

bool has_avx512_f32_gemm() {
#ifdef BATCHGEN_AVX512F
  return true;
#else
  return false;
#endif
}

bool has_fma_bf16_gemm() {
#ifdef BATCHGEN_FMA
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 -> [ceil(N / 16), K / 2, 16, 2]: block b, pair p holds (w[16b + j, 2p], w[16b + j, 2p + 1])
// for j = 0..15. Columns past N are zero.
at::Tensor pack_bf16_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16_weight: a 2-D bfloat16 weight");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "pack_bf16_weight: in_features must be even, got ", k);
  const int64_t nblk = (n + kCols - 1) / kCols, kp = k / 2;
  auto src = w.contiguous();
  auto out = w.new_zeros({nblk, kp, kCols, 2});
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src.data_ptr());
  uint32_t* d = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, nblk, 1, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t cols = std::min(kCols, n - blk * kCols);
      const uint32_t* rows = s + blk * kCols * kp;
      uint32_t* dst = d + blk * kp * kCols;
      for (int64_t p = 0; p < kp; ++p)  // 16 sequential reads, one sequential write
        for (int64_t j = 0; j < cols; ++j) dst[p * kCols + j] = rows[j * kp + p];
    }
  });
  return out;
}

// Part i of `parts` near-equal shares of `total` prefetch lines: [first, first + n), empty past the
// end (the walks split the next slice's lines over their row tiles this way).
struct Share {
  int64_t first, n;
  Share(int64_t total, int64_t parts, int64_t i) {
    const int64_t per = (total + parts - 1) / parts;
    first = std::min(total, i * per);
    n = std::min(total, first + per) - first;
  }
};

#ifdef BATCHGEN_AVX512F

// The lines of the next chunk's weights to pull into L2: `runs` contiguous runs (one per block) of
// `run` lines, `gap` bytes apart; a tile prefetches lines [first, first + lines).
struct Prefetch {
  const char* p = nullptr;
  int64_t first = 0, lines = 0, run = 1, gap = 0;
};

// A tile's walk over its share of a Prefetch, in order, without a division per line: `per` lines
// every `every` steps of k, so the share is spread over the tile's steps even where it has more
// lines than steps. Before it, each line's address took a division and a tile issued at most one
// line a step, the rest in a burst at its end: a decode step's one to three tiles (1-4 lines a
// step) left the next chunk's weights late. On Zen 4 (Qwen2.5-1.5B's layer, ab_gemm_source) the
// cursor ran bf16 1.10-1.31x at 4-16 rows and 1.03-1.08x at 32-256, fp32 1.05-1.29x and 1.02-1.07x.
// (Spreading the share exactly, an error term per step, ran 0.95-0.98x this at 32-256 rows.)
struct PrefetchCursor {
  const char* at;   // the next line
  const char* end;  // the end of the current run
  int64_t left, run, gap;
  explicit PrefetchCursor(const Prefetch& pf) : at(nullptr), end(nullptr), left(pf.lines), run(pf.run), gap(pf.gap) {
    if (left <= 0) return;  // nothing to prefetch (the thread's last panel): pf.p may be null
    const int64_t blk = pf.first / pf.run;
    at = pf.p + blk * pf.gap + 64 * (pf.first % pf.run);
    end = pf.p + blk * pf.gap + 64 * pf.run;
  }
  inline void next() {
    _mm_prefetch(at, _MM_HINT_T1);
    --left;
    at += 64;
    if (at == end) {  // on to the next block's run
      at += gap - 64 * run;
      end += gap;
    }
  }
};

// The AVX-512 walk of gemm_bf16 and gemm_f32_avx512. A weight is packed in 16-column blocks with one
// 64-byte line per step (a k pair for bf16, one k for fp32); a register tile of up to 6 rows x 4
// blocks (64 columns) walks one chunk of a panel (up to 1,024 lines: 256 KiB, in L2), while the
// next chunk's lines are prefetched into L2, spread over the row tiles. Between chunks the sums
// wait in an fp32 buffer. The dtypes differ only in what a trait S gives the walk:
//   A, C          x's and the output's element type;
//   kPerLine      k per line (2 for bf16 pairs);
//   bcast / madd  x's value(s) for one line broadcast to 16 lanes, and the step on one block;
//   kL1Prefetch   whether the tile also pulls its panel's lines into L1 ahead of the walk;
//   kGroupedSteps whether 5- and 6-row tiles issue their L2 prefetch in bursts between runs of
//                 steps instead of checking a countdown on each step (F32, below);
//   gate_in       the gated epilogue's view of a sum (bf16 rounds it, as a stored gate/up would be);
//   store         16 lanes of a row into the output, masked.
template <class C>
struct Out {
  C* c;             // output rows, ldc apart
  int64_t ldc;
  float* part;      // fp32 partial sums [rows, 64] between chunks
  const float* bias;
  int last_cols;    // valid columns of the tile's last block (16 unless at N's end)
  bool first, last;
  int act;          // 0: plain; 1 / 2: gated (blocks alternate gate, up): c gets silu / gelu_tanh(gate) * up
};

// act(gate) * up for 16 columns from the gate and up sums and their biases, each rounded as S stores
// it (as silu_mul / gelu_tanh_mul would read a stored gate/up): the gated epilogues of the walk's
// tiles and of gemm_bf16_amx.
template <class S>
inline __attribute__((always_inline)) __m512 gated16(__m512 gate, __m512 up, __m512 bg, __m512 bu, int act) {
  const __m512 g = S::gate_in(_mm512_add_ps(gate, bg)), u = S::gate_in(_mm512_add_ps(up, bu));
  return _mm512_mul_ps(act == 1 ? batchgen_cpu::silu16(g) : batchgen_cpu::gelu_tanh16(g), u);
}

// Out of line: inlined into rows(), the 5-row bf16 tiles ran at half speed, and GCC's choice of
// which tiles to inline moved the rate by up to 25% at 16 rows.
template <class S, int MR, int NB>
__attribute__((noinline)) void tile(const typename S::A* a, int64_t lda, const char* b, int64_t bstride, int64_t lines,
                                    const Out<typename S::C>& o, const Prefetch& pf) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j)
      acc[i][j] = o.first ? _mm512_setzero_ps() : _mm512_loadu_ps(o.part + i * 64 + j * kCols);
  PrefetchCursor next(pf);
  // `per` lines every `every` steps; a countdown, not l % every: a division per step cost 2-10%
  const int64_t per = lines > 0 ? std::max<int64_t>(1, (pf.lines + lines - 1) / lines) : 1;
  const int64_t every = pf.lines > 0 ? std::max<int64_t>(1, lines / pf.lines) : INT64_MAX;
  if constexpr (S::kGroupedSteps && MR >= 5) {
    static_assert(!S::kL1Prefetch, "the grouped walk has no L1 prefetch");
    // a burst of lines, then a run of steps of k with nothing else in the loop: the countdown's
    // `per` lines every `every` steps, with runs of `every` steps widened to 4 where `every` is 1 or 2.
    // The step is written out in both loops: as one shared lambda it changed GCC's bf16 tiles too.
    const int64_t run = every >= 4 ? every : 4 / every * every, burst = per * (run / every);
    for (int64_t l = 0; l < lines;) {
      for (int64_t i = 0; i < burst && next.left > 0; ++i) next.next();
      for (const int64_t stop = lines - l > run ? l + run : lines; l < stop; ++l) {
        __m512 w[NB];
        for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(b + j * bstride + l * 64);
        for (int i = 0; i < MR; ++i) {
          const __m512 x = S::bcast(a + i * lda, l);
          for (int j = 0; j < NB; ++j) acc[i][j] = S::madd(acc[i][j], x, w[j]);
        }
      }
    }
  } else {
    int64_t countdown = 0;
    for (int64_t l = 0; l < lines; ++l) {
      __m512 w[NB];
      for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(b + j * bstride + l * 64);
      if constexpr (S::kL1Prefetch)
        if ((l & 1) == 0)
          for (int j = 0; j < NB; ++j) _mm_prefetch(b + j * bstride + (l + 16) * 64, _MM_HINT_T0);
      if (--countdown <= 0 && next.left > 0) {
        for (int64_t i = 0; i < per && next.left > 0; ++i) next.next();
        countdown = every;
      }
      for (int i = 0; i < MR; ++i) {
        const __m512 x = S::bcast(a + i * lda, l);
        for (int j = 0; j < NB; ++j) acc[i][j] = S::madd(acc[i][j], x, w[j]);
      }
    }
  }
  while (next.left > 0) next.next();
  if constexpr (NB % 2 == 0) {
    if (o.last && o.act) {  // gate block j, up block j + 1 -> 16 output columns; the pair's bias first
      batchgen_cpu::FlushDenormals ftz;  // as silu_mul / gelu_tanh_mul run
      for (int j = 0; j < NB; j += 2) {
        const __m512 bg = o.bias ? _mm512_loadu_ps(o.bias + j * kCols) : _mm512_setzero_ps();
        const __m512 bu = o.bias ? _mm512_loadu_ps(o.bias + (j + 1) * kCols) : _mm512_setzero_ps();
        for (int i = 0; i < MR; ++i)
          S::store(o.c + i * o.ldc + j / 2 * kCols, 0xFFFF, gated16<S>(acc[i][j], acc[i][j + 1], bg, bu, o.act));
      }
      return;
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) {
      __m512 v = acc[i][j];
      if (!o.last) {
        _mm512_storeu_ps(o.part + i * 64 + j * kCols, v);
        continue;
      }
      const int cols = j == NB - 1 ? o.last_cols : static_cast<int>(kCols);
      const __mmask16 m = static_cast<__mmask16>((1u << cols) - 1u);
      if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, o.bias + j * kCols));
      S::store(o.c + i * o.ldc + j * kCols, m, v);
    }
}

// All rows of a, one chunk of one panel, in tiles of near-equal height (32 rows: 6, 6, 5, 5, 5, 5,
// not 6 x 5 + 2: a 2-row tile has too few sums to cover the FMA latency); the prefetch is spread
// over them.
template <class S, int NB>
void rows(const typename S::A* a, int64_t m, int64_t lda, const char* b, int64_t bstride, int64_t lines,
          Out<typename S::C> o, const Prefetch& pf) {
  const int64_t tiles = (m + kRows - 1) / kRows;
  const int64_t base = m / tiles, taller = m % tiles;
  for (int64_t r = 0, t = 0; t < tiles; ++t) {
    const int64_t h = base + (t < taller);
    const Share sh(pf.lines, tiles, t);
    Prefetch q = pf;
    q.first = sh.first;
    q.lines = sh.n;
    Out<typename S::C> ot = o;
    ot.c = o.c + r * o.ldc;
    ot.part = o.part + r * 64;
    const typename S::A* ar = a + r * lda;
    r += h;
    switch (h) {
      case 6: tile<S, 6, NB>(ar, lda, b, bstride, lines, ot, q); break;
      case 5: tile<S, 5, NB>(ar, lda, b, bstride, lines, ot, q); break;
      case 4: tile<S, 4, NB>(ar, lda, b, bstride, lines, ot, q); break;
      case 3: tile<S, 3, NB>(ar, lda, b, bstride, lines, ot, q); break;
      case 2: tile<S, 2, NB>(ar, lda, b, bstride, lines, ot, q); break;
      default: tile<S, 1, NB>(ar, lda, b, bstride, lines, ot, q); break;
    }
  }
}

// How a walk cuts W's k / kPerLine lines into chunks of at most kChunkLines (each one panel's
// chunk fits L2).
struct Chunks {
  int64_t lines, count, len;
  Chunks(int64_t k, int64_t per_line) : lines(k / per_line) {
    count = (lines + kChunkLines - 1) / kChunkLines;
    len = count ? (lines + count - 1) / count : 0;
  }
};

// Panel p of W (packed at w, nblk 16-column blocks) over all m rows of a: its chunks in turn, each
// one's walk prefetching the next chunk, and the last one the first chunk of panel next_p of next_w
// (the thread's next panel; null: none). c: the output's first row; part: m x 64 floats when the
// panel has more than one chunk.
template <class S>
void panel(typename S::C* c, const typename S::A* a, int64_t m, int64_t lda, const char* w, int64_t nblk, int64_t p,
           const Chunks& ck, int64_t n, const float* bias, int act, float* part, const char* next_w, int64_t next_p) {
  const int64_t bstride = ck.lines * 64;
  const int64_t blk0 = p * kPanel, nb = std::min<int64_t>(kPanel, nblk - blk0);
  const int64_t cols = std::min<int64_t>(kCols, n - (blk0 + nb - 1) * kCols);
  for (int64_t ch = 0; ch < ck.count; ++ch) {
    const int64_t l0 = ch * ck.len, ln = std::min(ck.len, ck.lines - l0);
    Prefetch pf;  // the next chunk of this panel, else the first chunk of the next panel
    const bool more = ch + 1 < ck.count;
    const char* nw = more ? w : next_w;
    if (nw) {
      const int64_t np = more ? p : next_p, nl0 = more ? l0 + ck.len : 0;
      pf.p = nw + np * kPanel * bstride + nl0 * 64;
      pf.run = std::min(ck.len, ck.lines - nl0);
      pf.gap = bstride;
      pf.lines = pf.run * std::min<int64_t>(kPanel, nblk - np * kPanel);
    }
    Out<typename S::C> o{c + blk0 * kCols / (act ? 2 : 1), act ? n / 2 : n, part,
                         bias ? bias + blk0 * kCols : nullptr, static_cast<int>(cols), ch == 0, ch == ck.count - 1,
                         act};
    const typename S::A* ak = a + l0 * S::kPerLine;
    const char* wk = w + blk0 * bstride + l0 * 64;
    switch (nb) {
      case 4: rows<S, 4>(ak, m, lda, wk, bstride, ln, o, pf); break;
      case 3: rows<S, 3>(ak, m, lda, wk, bstride, ln, o, pf); break;
      case 2: rows<S, 2>(ak, m, lda, wk, bstride, ln, o, pf); break;
      default: rows<S, 1>(ak, m, lda, wk, bstride, ln, o, pf); break;
    }
  }
}

// out (m rows, ldc = N, or N / 2 when gated) = a (m rows of k, lda apart) @ W.T + bias, W packed in
// nblk 16-column blocks of k / kPerLine lines; the panels split over the threads.
template <class S>
void walk(typename S::C* c, const typename S::A* a, int64_t m, int64_t lda, const char* w, int64_t nblk, int64_t k,
          int64_t n, const float* bias, int act) {
  const Chunks ck(k, S::kPerLine);
  const int64_t panels = (nblk + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> part(ck.count > 1 ? m * 64 : 0);
    for (int64_t p = begin; p < end; ++p)
      panel<S>(c, a, m, lda, w, nblk, p, ck, n, bias, act, part.data(), p + 1 < end ? w : nullptr, p + 1);
  });
}

// One GEMM of a group: c (m rows) = a (m rows) @ W.T, W packed at w.
template <class S>
struct Group {
  typename S::C* c;
  const typename S::A* a;
  int64_t m;
  const char* w;
};

// The GEMMs of several weights of one shape (a mixture's experts), each over its own rows, in one
// parallel region: their (group, panel) items are split over the threads by cost (the rows, plus
// kItemRows for the panel's weight stream, which costs the same at any row count), each thread
// walking its items in order and prefetching the next one's weights across group boundaries. One
// call per expert instead costs a fork and join per GEMM, and at a decode step's 1-16 rows per
// expert the single small call's panels split unevenly over the threads.
template <class S>
void walk_groups(const std::vector<Group<S>>& groups, int64_t lda, int64_t nblk, int64_t k, int64_t n, int act) {
  if (groups.empty()) return;
  const Chunks ck(k, S::kPerLine);
  const int64_t panels = (nblk + kPanel - 1) / kPanel;
  const ItemSplit split(groups, panels);
  int64_t rows_max = 0;
  for (const auto& g : groups) rows_max = std::max(rows_max, g.m);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), split.items());
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> part(ck.count > 1 ? rows_max * 64 : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const auto [begin, end] = split.range(t, threads);
      for (int64_t i = begin; i < end; ++i) {
        const Group<S>& g = groups[i / panels];
        const bool next = i + 1 < end;
        panel<S>(g.c, g.a, g.m, lda, g.w, nblk, i % panels, ck, n, nullptr, act, part.data(),
                 next ? groups[(i + 1) / panels].w : nullptr, (i + 1) % panels);
      }
    }
  });
}

// fp32 x and weights, one k per line, fp32 output. On 256-bit AVX-512 units (AMD Zen 4) oneDNN's
// fp32 GEMM ran at 64-85% of the FMA peak at a decode step's 8-32 rows on Qwen2.5-1.5B's shapes and
// this walk 1.10-1.46x faster at 8-16 rows with the prefetch cursor (0.95-0.98x from 64 rows up).
// kGroupedSteps: with the countdown's test and the prefetch loop inside the k loop, GCC's code for
// the 6-row tile ran 4-5% below the same FMAs in a bare loop (one thread, Zen 4: 104-108 against
// 110-113 GFLOP/s at 48-252 rows, a 116.5 GFLOP/s peak). Issuing the prefetch in bursts between
// runs of 3 or more steps (4 where it was due every step or two) took Qwen2.5-1.5B's layer GEMMs
// to 1.03-1.08x at 16-256 rows, level at 1-10 (ab_gemm_source, two threads; Qwen2.5-0.5B's alike).
// Runs of one step (a burst before every step, where a tile's share of the prefetch has as many
// lines as it has steps) ran the 5-row tiles 0.90-0.95x at 16 and 32 rows. Tiles of 4 rows and
// fewer keep the countdown: in the grouped loop GCC folded their weight loads into the FMAs (one
// load per row) and they ran 0.75-0.8x. The bf16 walk's code is unchanged (a grouped loop on it ran
// 0.96-1.02x at 1-256 rows, 0.97-0.98x at 12-24).
struct F32 {
  using A = float;
  using C = float;
  static constexpr int64_t kPerLine = 1;
  static constexpr bool kL1Prefetch = false;
  static constexpr bool kGroupedSteps = true;
  static inline __m512 bcast(const float* row, int64_t l) { return _mm512_set1_ps(row[l]); }
  static inline __m512 madd(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
  static inline __m512 gate_in(__m512 v) { return v; }
  static inline void store(float* c, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(c, m, v); }
};

#endif  // BATCHGEN_AVX512F

#ifdef BATCHGEN_DPBF16
// bf16 x and weights, one k pair per line (vdpbf16ps), bf16 output. Bf16L1 also pulls each
// panel's lines into L1 16 pairs ahead of the walk; Bf16 leaves that to the hardware.
struct Bf16 {
  using A = uint16_t;
  using C = uint16_t;
  static constexpr int64_t kPerLine = 2;
  static constexpr bool kL1Prefetch = false;
  static constexpr bool kGroupedSteps = false;
  static inline __m512 bcast(const uint16_t* row, int64_t l) {
    return _mm512_castsi512_ps(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(row + 2 * l)));
  }
  static inline __m512 madd(__m512 acc, __m512 x, __m512 w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  // round to bf16 and back, as a gate/up output stored in bf16 would be read again
  static inline __m512 gate_in(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  }
  static inline void store(uint16_t* c, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(c, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
};
struct Bf16L1 : Bf16 {
  static constexpr bool kL1Prefetch = true;
};

// Whether this CPU runs AVX-512 on 256-bit units: AMD family 25 (Zen 4; Zen 3, the same family,
// has no AVX-512 and never gets here), as workload.half_width_avx512 says on the Python side.
// There the L1 prefetch cost 0-8% at 4-2,048 rows once the L2 prefetch was spread (Qwen2.5-1.5B,
// Llama-3.2-1B and SmolLM2's layers, ab_gemm_source), so gemm_bf16 walks Bf16 on it; other
// AVX512-BF16 CPUs (Zen 5, Cooper Lake), where it was tuned, keep Bf16L1.
bool half_width_avx512() {
  static const bool half = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541u) return false;  // "Auth"enticAMD
    __get_cpuid(1, &a, &b, &c, &d);
    return ((a >> 8) & 0xFu) + ((a >> 20) & 0xFFu) == 25;
  }();
  return half;
}

// f(trait) with the bf16 walk's trait for this CPU (Bf16 or Bf16L1, above): gemm_bf16's and
// moe_experts' one choice.
template <class F>
void with_bf16_walk(F&& f) {
  if (half_width_avx512())
    f(Bf16{});
  else
    f(Bf16L1{});
}
#endif  // BATCHGEN_DPBF16

#ifdef BATCHGEN_FMA
// GEMMs for AVX2 CPUs without AVX-512 (AMD Zen 2/3, Intel Haswell to Alder Lake client parts), for
// fp32 weights (gemm_f32_fma) and bf16 ones (gemm_bf16_fma). oneDNN's AVX2 fp32 GEMM ran at 60-75%
// of this CPU's FMA peak at an fp32 model's shapes (Zen 2: 209 GFLOP/s on 2 cores; oneDNN 70-80 at
// 16 rows, 125-135 at 64, 145-155 at 2,048), and the GEMMs are ~89% of an fp32 run there. oneDNN
// has no bf16 kernels at all on these CPUs, and F.linear's bf16 fallback runs at a tenth of the
// fp32 rate.
//
// Both weights are packed once into 16-column panels with one 64-byte line per step of k: fp32 as
// [ceil(N / 16), K, 16] (one k per line), bf16 as pack_bf16_weight's [ceil(N / 16), K / 2, 16, 2]
// (one k pair per line; two integer ops widen it to fp32 in registers: k0 = the word shifted up
// 16 bits, k1 = its high half masked, so the weight stream stays bf16 and the arithmetic is fp32).
// A 6-row x 16-column register tile (12 accumulators, 2 weight vectors, 1 broadcast) walks one
// 16 KiB slice of a panel (256 k of fp32, 512 of bf16), which stays in L1 while every row tile of
// the call runs over it. Meanwhile the next slice is prefetched: at up to four tiles (24 rows) the
// tiles share its lines, each its share spread evenly over its steps, and from five tiles on the
// first tile alone prefetches all of them, one line per step. (The first tile alone at 8-24
// rows left the other tiles' FMAs with no requests in flight: the shared prefetch ran 8-20% faster
// there on Zen 3, fp32, at Qwen2.5-1.5B, Llama-3.2-1B and SmolLM2's shapes. Shared by five or six
// tiles, the last shares came too late for the slice after: 0.85-0.87x the first tile alone at
// 32-64 rows on Llama-3.2-1B fp32; the first tile alone above 24 rows then ran 1.12-1.27x fp32 at
// 32-64 rows on the three shapes (1.03-1.14x at 128), 0.98-1.21x bf16 at 32-128, and a whole
// Llama-3.2-1B fp32 prompt-heavy run 1.07x. Spread over all of a prefill block's tiles: 0.86x at
// 256 rows.)
// Each thread takes a contiguous run of panels and walks them panel by panel, slice by slice, so
// its share of the weight streams in memory order; at prefill rows it walks groups of panels slice by slice
// (group_panels). Between slices the sums stay in a 16-column fp32 buffer per panel (block()), not
// in the output's rows (an fp32 call whose k fits one slice writes the output directly). Calls with more than 256 rows run as 256-row blocks: the x of a block
// stays in L2/L3, and the output rows a tile writes stay within the TLB's reach (one unblocked pass
// over 2,048 rows ran 15-25% slower). bf16 x is widened once per block into an fp32 buffer.
namespace fma {

constexpr int kRows = 6;
constexpr int64_t kSliceBytes = 16384, kBlockRows = 256;  // columns per panel: kCols (16), as above

struct Tile {
  float* c;            // fp32 sums: block()'s sums buffer, or (fp32, k in one slice) the output, ldc apart
  int64_t ldc;
  uint16_t* c16;       // bf16 output rows (ldc16 apart), written on the last slice; null for fp32
  int64_t ldc16;
  const float* bias;   // at the panel, or null; added on the last slice
  int cols;            // valid columns of the panel (16 unless at N's end)
  bool first, last;    // slice 0 (start from zero) / the last slice
};

// MR rows of fp32 x (lda apart) times kn k of one packed panel (fp32 or bf16 pairs); pf: this
// tile's share of the next slice's lines (pf_lines of them, one every `every` steps), or null.
// (The countdown is written out in both loops below: as a struct's method the fp32 tile ran
// 0.92-0.95x at 16 rows in three A/B runs.)
template <int MR, bool BF16>
__attribute__((noinline)) void tile(const float* a, int64_t lda, const void* bp, int64_t kn, const Tile& t,
                                    const char* pf, int64_t pf_lines, int64_t every) {
  int64_t due = 0;
  const char* const pf_end = pf ? pf + pf_lines * 64 : nullptr;
  __m256 acc[MR][2];
  const bool full = BF16 || t.cols == kCols;  // the bf16 sums buffer is 16 wide
  const __m256i m0 = batchgen_cpu::lanes_below8(t.cols), m1 = batchgen_cpu::lanes_below8(t.cols - 8);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float* c = t.c + i * t.ldc;
    acc[i][0] = t.first ? _mm256_setzero_ps() : full ? _mm256_loadu_ps(c) : _mm256_maskload_ps(c, m0);
    acc[i][1] = t.first ? _mm256_setzero_ps() : full ? _mm256_loadu_ps(c + 8) : _mm256_maskload_ps(c + 8, m1);
  }
  if constexpr (!BF16) {
    const float* b = static_cast<const float*>(bp);
    for (int64_t k = 0; k < kn; ++k) {
      if (pf < pf_end && --due <= 0) {
        _mm_prefetch(pf, _MM_HINT_T0);
        pf += 64;
        due = every;
      }
      const __m256 b0 = _mm256_loadu_ps(b + k * kCols), b1 = _mm256_loadu_ps(b + k * kCols + 8);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 x = _mm256_broadcast_ss(a + i * lda + k);
        acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
      }
    }
  } else {
    const __m256i* b = static_cast<const __m256i*>(bp);
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t kp = 0; kp < kn / 2; ++kp) {
      if (pf < pf_end && --due <= 0) {
        _mm_prefetch(pf, _MM_HINT_T0);
        pf += 64;
        due = every;
      }
      const __m256i raw0 = _mm256_loadu_si256(b + 2 * kp), raw1 = _mm256_loadu_si256(b + 2 * kp + 1);
      __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw0, 16));
      __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(raw1, 16));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 x = _mm256_broadcast_ss(a + i * lda + 2 * kp);
        acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
      }
      w0 = _mm256_castsi256_ps(_mm256_and_si256(raw0, high));
      w1 = _mm256_castsi256_ps(_mm256_and_si256(raw1, high));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 x = _mm256_broadcast_ss(a + i * lda + 2 * kp + 1);
        acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
      }
    }
  }
  const bool add = t.last && t.bias;
  const __m256 z = _mm256_setzero_ps();
  const __m256 bias0 = !add ? z : t.cols == kCols ? _mm256_loadu_ps(t.bias) : _mm256_maskload_ps(t.bias, m0);
  const __m256 bias1 = !add ? z : t.cols == kCols ? _mm256_loadu_ps(t.bias + 8) : _mm256_maskload_ps(t.bias + 8, m1);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m256 v0 = _mm256_add_ps(acc[i][0], bias0), v1 = _mm256_add_ps(acc[i][1], bias1);
    if (BF16 && t.last) {
      alignas(32) float v[16];
      _mm256_store_ps(v, v0);
      _mm256_store_ps(v + 8, v1);
      batchgen_cpu::row_from_f32(v, reinterpret_cast<c10::BFloat16*>(t.c16 + i * t.ldc16), t.cols);
      continue;
    }
    float* c = t.c + i * t.ldc;
    if (full) {
      _mm256_storeu_ps(c, v0);
      _mm256_storeu_ps(c + 8, v1);
    } else {
      _mm256_maskstore_ps(c, m0, v0);
      _mm256_maskstore_ps(c + 8, m1, v1);
    }
  }
}

// Panels walked slice by slice together: a group's sums (rows x 16 columns x 4 bytes a panel) and
// one slice of x (rows x 256 k) then stay in L2 while the group's panels run over that slice, so x
// is read from L2 once per group, not streamed from L3 once per panel: less traffic on an L3 that
// other tenants share (Zen 3, 1.5B fp32 shapes: 0.99-1.03x at 128-2,048 rows on a quiet machine,
// where the plain walk already ran at ~95% of the FMA peak). One panel (the plain walk, the weight
// streamed in memory order) at a decode step's rows, which wait on the weight stream (grouping
// there ran 0.94x at 8 rows), and while a block of x fits in L2's budget.
inline int64_t group_panels(int64_t m, int64_t k) {
  constexpr int64_t kL2Budget = 256 * 1024, kSumsBudget = 128 * 1024, kMinRows = 64;
  if (m < kMinRows || m * k * 4 <= kL2Budget) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(16, kSumsBudget / (m * kCols * 4)));
}

// Rows [0, m) of fp32 x (m <= kBlockRows, lda apart) times panels [p0, p1) of w (k features);
// c / c16: the block's fp32 / bf16 output rows, ldc apart.
template <bool BF16>
void block(float* c, uint16_t* c16, int64_t ldc, const float* a, int64_t m, int64_t lda, const void* w, int64_t n,
           int64_t k, int64_t p0, int64_t p1, const float* bias) {
  constexpr int64_t kLine = BF16 ? 2 : 1;                       // k per 64-byte line
  const int64_t slices = (k + kSliceBytes / 64 * kLine - 1) / (kSliceBytes / 64 * kLine);
  const int64_t kc = ((k + slices - 1) / slices + kLine - 1) / kLine * kLine;  // whole k pairs for bf16
  const char* wb = static_cast<const char*>(w);
  const int64_t panel_bytes = k / kLine * 64;
  const char* end = wb + p1 * panel_bytes;
  const int64_t group = group_panels(m, k);
  // Each panel of the group keeps its m x 16 sums here between slices, 64 bytes a row: bf16 always,
  // fp32 wherever k takes several slices (copied into c after the last). In c itself a tile's rows
  // lie ldc apart, and at a power-of-two width they share cache sets (Llama-3.2-1B's gate/up: 64
  // KiB apart, one L2 set for every row): fp32 ran 1.05-1.10x at 128-1,024 rows there, 0.98-1.12x
  // (mostly 1.01-1.05x) at Qwen2.5-1.5B/3B and SmolLM2's shapes, level at a decode step's rows
  // (examples/ab_gemm_source.py, Zen 3).
  const bool own_sums = BF16 || slices > 1;
  std::vector<float> sums(own_sums ? group * m * kCols : 0);
  // ceil(m / 6) tiles of near-equal height (32 rows: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2): a tile of
  // few rows has too few accumulators to cover the FMA latency.
  const int64_t tiles = (m + kRows - 1) / kRows, base = m / tiles, taller = m % tiles;
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(g0 + group, p1);
    for (int64_t k0 = 0; k0 < k; k0 += kc) {
      const int64_t kn = std::min(kc, k - k0);
      for (int64_t p = g0; p < g1; ++p) {
        Tile t{own_sums ? sums.data() + (p - g0) * m * kCols : c + p * kCols, own_sums ? kCols : ldc,
               BF16 ? c16 + p * kCols : nullptr, ldc,
               bias ? bias + p * kCols : nullptr, static_cast<int>(std::min(kCols, n - p * kCols)), k0 == 0,
               k0 + kn >= k};
        const char* b = wb + p * panel_bytes + k0 / kLine * 64;
        // the slice walked next: the group's next panel at this k, else its first panel at the next
        // k, else the next group's first slice (null past the thread's run)
        const char* next = p + 1 < g1 ? b + panel_bytes
                           : k0 + kc < k ? wb + g0 * panel_bytes + (k0 + kc) / kLine * 64
                                         : wb + g1 * panel_bytes;
        if (next + kn / kLine * 64 > end) next = nullptr;
        // the next slice's lines: shared by the tiles up to four of them, else the first tile's
        const int64_t lines = kn / kLine, spread = tiles <= 4 ? tiles : 1;
        for (int64_t i = 0, r = 0; i < tiles; ++i) {
          const int64_t rows = base + (i < taller);
          Tile tr = t;
          tr.c = t.c + r * t.ldc;
          tr.c16 = BF16 ? t.c16 + r * ldc : nullptr;
          const float* ar = a + r * lda + k0;
          const Share sh(lines, spread, i);
          const char* pf = next ? next + sh.first * 64 : nullptr;
          const int64_t every = std::max<int64_t>(1, lines / std::max<int64_t>(1, sh.n));
          r += rows;
          switch (rows) {
            case 6: tile<6, BF16>(ar, lda, b, kn, tr, pf, sh.n, every); break;
            case 5: tile<5, BF16>(ar, lda, b, kn, tr, pf, sh.n, every); break;
            case 4: tile<4, BF16>(ar, lda, b, kn, tr, pf, sh.n, every); break;
            case 3: tile<3, BF16>(ar, lda, b, kn, tr, pf, sh.n, every); break;
            case 2: tile<2, BF16>(ar, lda, b, kn, tr, pf, sh.n, every); break;
            default: tile<1, BF16>(ar, lda, b, kn, tr, pf, sh.n, every); break;
          }
        }
      }
    }
    if (!BF16 && own_sums) {  // the group's fp32 sums into the output rows
      for (int64_t p = g0; p < g1; ++p) {
        const int64_t cols = std::min(kCols, n - p * kCols);
        const float* sp = sums.data() + (p - g0) * m * kCols;
        for (int64_t r = 0; r < m; ++r) std::memcpy(c + r * ldc + p * kCols, sp + r * kCols, cols * sizeof(float));
      }
    }
  }
}

}  // namespace fma
#endif  // BATCHGEN_FMA

// out = the bias in every row (zeros without one): a GEMM with K = 0.
void bias_only(at::Tensor& out, const c10::optional<at::Tensor>& bias) {
  if (bias.has_value()) out.copy_(bias->view({1, out.size(1)}).expand_as(out));
  else out.zero_();
}

// w [N, K] fp32 -> [ceil(N / 16), K, 16]: panel p, row k holds w[16p + j, k] for j = 0..15. Columns
// past N are zero.
at::Tensor pack_f32_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_f32_weight: a 2-D float32 weight");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kCols - 1) / kCols;
  auto src = w.contiguous();
  auto out = w.new_zeros({panels, k, kCols});
  const float* s = src.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < std::min(kCols, n - p * kCols); ++j) {
        const float* row = s + (p * kCols + j) * k;
        float* dst = d + p * k * kCols + j;
        for (int64_t kk = 0; kk < k; ++kk) dst[kk * kCols] = row[kk];
      }
  });
  return out;
}

// out [M, N] fp32 (contiguous) = x [M, K] fp32 (unit column stride) @ W.T + bias (fp32 [N] or none),
// W packed by pack_f32_weight.
void gemm_f32_fma(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
#ifdef BATCHGEN_FMA
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "gemm_f32_fma: x [M, K] fp32 rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(), "gemm_f32_fma: a weight from pack_f32_weight");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = packed.size(0);
  TORCH_CHECK(k == packed.size(1), "gemm_f32_fma: x has ", k, " features, the weight ", packed.size(1));
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == m && out.scalar_type() == at::kFloat &&
                  (n + kCols - 1) / kCols == panels, "gemm_f32_fma: out [M, N] fp32 for this weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "gemm_f32_fma: bias fp32 [N]");
  if (m == 0 || n == 0) return;
  if (k == 0) return bias_only(out, bias);  // no slices to walk
  const float* a = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t lda = x.stride(0);
  for (int64_t r = 0; r < m; r += fma::kBlockRows)
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      fma::block<false>(c + r * n, nullptr, n, a + r * lda, std::min(fma::kBlockRows, m - r), lda, w, n, k, p0, p1, bp);
    });
#else
  TORCH_CHECK(false, "gemm_f32_fma: this build has no AVX2/FMA (check has_fma_bf16_gemm first)");
#endif
}

// out [M, N] fp32 (contiguous) = x [M, K] fp32 (unit column stride) @ W.T + bias (fp32 [N] or none),
// W packed by pack_f32_weight, on AVX-512 (f512 above). act 1 (SiLU) or 2 (GELU-tanh): W's 16-row
// blocks alternate gate and up (and so does the bias), and out [M, N / 2] = act(gate) * up, the
// values silu_mul / gelu_tanh_mul give on the plain GEMM's output.
void gemm_f32_avx512(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t act) {
#ifdef BATCHGEN_AVX512F
  TORCH_CHECK(act >= 0 && act <= 2, "gemm_f32_avx512: act is 0 (none), 1 (silu) or 2 (gelu_tanh), got ", act);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "gemm_f32_avx512: x [M, K] fp32 rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(), "gemm_f32_avx512: a weight from pack_f32_weight");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1) * (act ? 2 : 1), nblk = packed.size(0);
  TORCH_CHECK(k == packed.size(1), "gemm_f32_avx512: x has ", k, " features, the weight ", packed.size(1));
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == m && out.scalar_type() == at::kFloat &&
                  (n + kCols - 1) / kCols == nblk, "gemm_f32_avx512: out [M, N] fp32 for this weight");
  TORCH_CHECK(!act || n % (2 * kCols) == 0, "gemm_f32_avx512: a gated GEMM needs whole 16-column gate and up blocks");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "gemm_f32_avx512: bias fp32 [N]");
  TORCH_CHECK(k > 0 || !act, "gemm_f32_avx512: a gated GEMM needs K > 0");
  if (m == 0 || n == 0) return;
  if (k == 0) return bias_only(out, bias);
  walk<F32>(out.data_ptr<float>(), x.data_ptr<float>(), m, x.stride(0), static_cast<const char*>(packed.data_ptr()),
            nblk, k, n, bias.has_value() ? bias->data_ptr<float>() : nullptr, static_cast<int>(act));
#else
  TORCH_CHECK(false, "gemm_f32_avx512: this build has no AVX-512 (check has_avx512_f32_gemm first)");
#endif
}

// gated: out has half the weight's columns (gemm_bf16's act).
void check_gemm_args(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, bool gated = false) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, op, ": x [M, K] bf16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              op, ": a weight from pack_bf16_weight");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1) * (gated ? 2 : 1), kp = packed.size(1);
  TORCH_CHECK(k == 2 * kp, op, ": x has ", k, " features, the weight ", 2 * kp);
  TORCH_CHECK(!gated || n % (2 * kCols) == 0, op, ": a gated GEMM needs whole 16-column gate and up blocks");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == m && out.scalar_type() == at::kBFloat16 &&
                  (n + kCols - 1) / kCols == packed.size(0), op, ": out [M, N] bf16 for this weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              op, ": bias fp32 [N]");
}

// gemm_bf16's contract, on AVX2 + FMA.
void gemm_bf16_fma(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
#ifdef BATCHGEN_FMA
  check_gemm_args("gemm_bf16_fma", out, x, packed, bias);
  const int64_t m = x.size(0), n = out.size(1), k = x.size(1), panels = packed.size(0), lda = x.stride(0);
  if (m == 0 || n == 0) return;
  if (k == 0) return bias_only(out, bias);  // no slices to walk
  const c10::BFloat16* a = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  uint16_t* c = reinterpret_cast<uint16_t*>(out.data_ptr());
  const void* w = packed.data_ptr();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // x widened once per 256-row block; +16 floats a row: rows 4 KiB apart would share L1 sets
  const int64_t ldf = k + 16;
  thread_local std::vector<float> buf;  // the calling thread's; the workers get its pointer
  buf.resize(std::min(fma::kBlockRows, m) * ldf);
  float* xf = buf.data();
  for (int64_t r = 0; r < m; r += fma::kBlockRows) {
    const int64_t rows = std::min(fma::kBlockRows, m - r);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) batchgen_cpu::row_to_f32(a + (r + i) * lda, xf + i * ldf, k);
    });
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      fma::block<true>(nullptr, c + r * n, n, xf, rows, ldf, w, n, k, p0, p1, bp);
    });
  }
#else
  TORCH_CHECK(false, "gemm_bf16_fma: this build has no AVX2/FMA (check has_fma_bf16_gemm first)");
#endif
}

// out [M, N] bf16 (contiguous) = x [M, K] bf16 (unit column stride) @ W.T + bias (fp32 [N] or none),
// W packed by pack_bf16_weight. act 1 (SiLU) or 2 (GELU-tanh): W's 16-row blocks alternate gate and
// up (and so does the bias), and out [M, N / 2] = act(gate) * up, the same values silu_mul /
// gelu_tanh_mul give on the plain GEMM's bf16 output, without writing and re-reading it.
void gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t act) {
#ifdef BATCHGEN_DPBF16
  TORCH_CHECK(act >= 0 && act <= 2, "gemm_bf16: act is 0 (none), 1 (silu) or 2 (gelu_tanh), got ", act);
  check_gemm_args("gemm_bf16", out, x, packed, bias, act != 0);
  TORCH_CHECK(x.size(1) > 0 || !act, "gemm_bf16: a gated GEMM needs K > 0");
  const int64_t m = x.size(0), n = out.size(1) * (act ? 2 : 1);
  if (m == 0 || n == 0) return;
  if (x.size(1) == 0) return bias_only(out, bias);  // no chunks to walk
  auto* c = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = static_cast<const char*>(packed.data_ptr());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  with_bf16_walk([&](auto s) {
    walk<decltype(s)>(c, a, m, x.stride(0), w, packed.size(0), x.size(1), n, b, static_cast<int>(act));
  });
#else
  TORCH_CHECK(false, "gemm_bf16: this build has no AVX512-BF16 (check has_dpbf16_gemm first)");
#endif
}

// ---------------------------------------------------------------------------------------------
// moe_experts: a sparse MoE block's experts, one op per layer, on gemm_bf16's and gemm_f32_avx512's
// walks (moe_walk) or on the AVX2 kernels (moe_fma). The Python loop it replaces ran each active
// expert as two GEMM calls and five torch ops around them; with 128 experts of which a decode
// step's tokens touch most, that is ~1,000 calls a layer, each with its fork and join. Here the
// pairs' rows are gathered once, each GEMM's (expert, panel) items are split over the threads in one
// parallel region (walk_groups, fma_groups), and the outputs are weighted and summed per token in
// ascending expert order, rounding as the loop did (the down output to the dtype, times the routing
// weight, rounded, then added slot by slot). slot_pair: each (token, slot)'s pair in expert order.

// moe_experts' buffers (the pairs' gathered rows, the activations, the down outputs): one block per
// calling thread, kept for the thread's life and grown as needed; 64-byte aligned, `bytes` long at
// least. At a 2,048-token prefill step they come to ~90 MB at Qwen3-30B-A3B's shapes (bf16), which
// glibc served with fresh mmaps (over its 32 MiB threshold) that each call faulted in again: ~35,000
// minor faults a layer, and the op took 421 ms a layer against 384 ms now (Zen 4).
char* scratch(size_t bytes) {
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buf;
  if (buf.bytes < bytes) {
    std::free(buf.p);
    buf.bytes = 0;
    buf.p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    TORCH_CHECK(buf.p, "moe_experts: could not allocate ", bytes, " bytes of scratch memory");
    buf.bytes = bytes;
  }
  return static_cast<char*>(buf.p);
}

// Arrays laid out one after another, each from a 64-byte boundary: add() each (its index), then
// scratch(end) and at(base, index).
struct Carve {
  std::vector<size_t> offsets;
  size_t end = 0;
  template <class T>
  size_t add(int64_t count) {
    offsets.push_back(end);
    end += (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
    return offsets.size() - 1;
  }
  template <class T>
  T* at(char* base, size_t i) const { return reinterpret_cast<T*>(base + offsets[i]); }
};

// out [n, h] (T: c10::BFloat16 or float): for each token, its k slots' down outputs (y's rows, in
// expert order: slot_pair) times their routing weights, each product rounded to T, added slot by
// slot with each partial sum rounded to T, as the loop's torch ops round them. A row at a time
// through fp32 rows (the conversions vectorised), so no product is fused into its add.
template <class T>
void weigh_and_sum(T* out, const T* y, const float* weights, const std::vector<int64_t>& slot_pair, int64_t n,
                   int64_t k, int64_t h) {
  at::parallel_for(0, n, 4, [&](int64_t b, int64_t e) {
    std::vector<float> acc(h), v(h);
    std::vector<T> rounded(h);
    const auto round = [&](std::vector<float>& f) {
      batchgen_cpu::row_from_f32(f.data(), rounded.data(), h);
      batchgen_cpu::row_to_f32(rounded.data(), f.data(), h);
    };
    for (int64_t i = b; i < e; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        batchgen_cpu::row_to_f32(y + slot_pair[i * k + j] * h, v.data(), h);
        const float w = weights[i * k + j];
        for (int64_t c = 0; c < h; ++c) v[c] *= w;
        round(v);
        if (j == 0) {
          acc.swap(v);
          continue;
        }
        for (int64_t c = 0; c < h; ++c) acc[c] += v[c];
        round(acc);
      }
      batchgen_cpu::row_from_f32(acc.data(), out + i * h, h);
    }
  });
}

#ifdef BATCHGEN_AMX
// defined with gemm_bf16_amx below
bool amx_permitted();
void gemm_amx(uint16_t* c, const uint16_t* a, int64_t m, int64_t lda, const char* w, int64_t nblk, int64_t k,
              int64_t n, const float* bias, int act);
#endif

#ifdef BATCHGEN_AVX512F
// amx_rows > 0 (bf16, AMX builds): the experts with at least that many pairs run each GEMM as one
// gemm_amx call (its own parallel region over the expert's 32-column units), the others in the
// grouped walk.
template <class S>
void moe_walk(at::Tensor& out, const at::Tensor& x, const at::Tensor& order, const std::vector<int64_t>& counts,
              const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, const at::Tensor& weights,
              const std::vector<int64_t>& slot_pair, int act, int64_t inter, int64_t gu_nblk, int64_t d_nblk,
              int64_t amx_rows) {
  using T = typename S::C;
  const int64_t n = x.size(0), h = x.size(1), pairs = order.numel(), k = pairs / n;
  const int64_t* ord = order.data_ptr<int64_t>();
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  // the gathered rows, then the down outputs over them (the gate/up GEMMs are done with them); the
  // activations
  Carve cv;
  const size_t rows_i = cv.add<T>(pairs * h), mid_i = cv.add<T>(pairs * inter);
  char* base = scratch(cv.end);
  T* xsp = cv.at<T>(base, rows_i);
  T* midp = cv.at<T>(base, mid_i);
  T* yp = xsp;
  at::parallel_for(0, pairs, 16, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) std::memcpy(xsp + p * h, xp + ord[p] / k * h, h * sizeof(T));
  });
  std::vector<Group<S>> up_groups, down_groups, amx_up, amx_down;
  for (int64_t ex = 0, r = 0; ex < static_cast<int64_t>(counts.size()); r += counts[ex++]) {
    if (counts[ex] == 0) continue;
    const bool amx = amx_rows > 0 && counts[ex] >= amx_rows;
    (amx ? amx_up : up_groups)
        .push_back({midp + r * inter, xsp + r * h, counts[ex], static_cast<const char*>(gate_up[ex].data_ptr())});
    (amx ? amx_down : down_groups)
        .push_back({yp + r * h, midp + r * inter, counts[ex], static_cast<const char*>(down[ex].data_ptr())});
  }
  walk_groups<S>(up_groups, h, gu_nblk, h, 2 * inter, act);
#ifdef BATCHGEN_AMX
  if constexpr (std::is_same_v<typename S::C, uint16_t>)
    for (const auto& g : amx_up) gemm_amx(g.c, g.a, g.m, h, g.w, gu_nblk, h, 2 * inter, nullptr, act);
#endif
  walk_groups<S>(down_groups, inter, d_nblk, inter, h, 0);
#ifdef BATCHGEN_AMX
  if constexpr (std::is_same_v<typename S::C, uint16_t>)
    for (const auto& g : amx_down) gemm_amx(g.c, g.a, g.m, inter, g.w, d_nblk, inter, h, nullptr, 0);
#endif
  using E = std::conditional_t<sizeof(T) == 2, c10::BFloat16, float>;
  weigh_and_sum(reinterpret_cast<E*>(out.data_ptr()), reinterpret_cast<const E*>(yp), weights.data_ptr<float>(),
                slot_pair, n, k, h);
}
#endif

#ifdef BATCHGEN_FMA
// walk_groups for the AVX2 kernels (fma::block): the (group, 16-column panel) items split over the
// threads by cost, each thread's run of one group's panels one block() call per 256 rows. a: the
// pairs' fp32 rows (lda apart); each group's output rows at its first row of c (fp32) or c16 (bf16),
// ldc apart.
struct FmaGroup {
  int64_t row0, m;
  const void* w;
};

template <bool BF16>
void fma_groups(const std::vector<FmaGroup>& groups, const float* a, int64_t lda, int64_t n, int64_t k, float* c,
                uint16_t* c16, int64_t ldc) {
  if (groups.empty()) return;
  const int64_t panels = (n + kCols - 1) / kCols;
  const ItemSplit split(groups, panels);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), split.items());
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [begin, end] = split.range(t, threads);
      for (int64_t i = begin; i < end;) {  // one group's run of panels at a time
        const int64_t p0 = i % panels, p1 = std::min(panels, p0 + (end - i));
        const FmaGroup& g = groups[i / panels];
        for (int64_t r = 0; r < g.m; r += fma::kBlockRows) {
          const int64_t row = g.row0 + r;
          fma::block<BF16>(BF16 ? nullptr : c + row * ldc, BF16 ? c16 + row * ldc : nullptr, ldc, a + row * lda,
                           std::min(fma::kBlockRows, g.m - r), lda, g.w, n, k, p0, p1, nullptr);
        }
        i += p1 - p0;
      }
    }
  });
}

// moe_experts on the AVX2 kernels, for weights packed as gemm_bf16_fma / gemm_f32_fma take them (gate
// rows, then up rows): the gate/up GEMMs, the activation op (silu_mul / gelu_tanh_mul) over all
// pairs, the down GEMMs, then the weighting and sum with moe_walk's roundings.
template <bool BF16>
void moe_fma(at::Tensor& out, const at::Tensor& x, const at::Tensor& order, const std::vector<int64_t>& counts,
             const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, const at::Tensor& weights,
             const std::vector<int64_t>& slot_pair, int act, int64_t inter) {
  using T = std::conditional_t<BF16, c10::BFloat16, float>;
  const int64_t n = x.size(0), h = x.size(1), pairs = order.numel(), k = pairs / n;
  const int64_t* ord = order.data_ptr<int64_t>();
  const T* xp = x.data_ptr<T>();
  // fp32 rows, +16 floats a row as gemm_bf16_fma widens them (rows 4 KiB apart would share L1 sets)
  const int64_t ldx = h + 16, ldm = BF16 ? inter + 16 : inter;
  // scratch (moe_walk's): the pairs' fp32 rows, then the down outputs over them; the gate/up output,
  // the activations, and (bf16) the activations in fp32
  Carve cv;
  const size_t xs_i = cv.add<float>(pairs * ldx), gu_i = cv.add<T>(pairs * 2 * inter), mid_i = cv.add<T>(pairs * inter),
               midf_i = cv.add<float>(BF16 ? pairs * ldm : 0);
  char* base = scratch(cv.end);
  float* xs = cv.at<float>(base, xs_i);
  float* midf = cv.at<float>(base, midf_i);
  at::parallel_for(0, pairs, 16, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) batchgen_cpu::row_to_f32(xp + ord[p] / k * h, xs + p * ldx, h);
  });
  std::vector<FmaGroup> up_groups, down_groups;
  for (int64_t ex = 0, r = 0; ex < static_cast<int64_t>(counts.size()); r += counts[ex++]) {
    if (counts[ex] == 0) continue;
    up_groups.push_back({r, counts[ex], gate_up[ex].data_ptr()});
    down_groups.push_back({r, counts[ex], down[ex].data_ptr()});
  }
  at::Tensor gu = at::from_blob(cv.at<T>(base, gu_i), {pairs, 2 * inter}, x.options());
  at::Tensor mid = at::from_blob(cv.at<T>(base, mid_i), {pairs, inter}, x.options());
  at::Tensor y = at::from_blob(cv.at<T>(base, xs_i), {pairs, h}, x.options());
  const auto c32 = [](at::Tensor& t) { return BF16 ? nullptr : reinterpret_cast<float*>(t.data_ptr()); };
  const auto c16 = [](at::Tensor& t) { return BF16 ? reinterpret_cast<uint16_t*>(t.data_ptr()) : nullptr; };
  fma_groups<BF16>(up_groups, xs, ldx, 2 * inter, h, c32(gu), c16(gu), 2 * inter);
  static const auto silu = c10::Dispatcher::singleton().findSchemaOrThrow("batchgen_cpu::silu_mul", "")
                               .typed<void(at::Tensor, at::Tensor)>();
  static const auto gelu = c10::Dispatcher::singleton().findSchemaOrThrow("batchgen_cpu::gelu_tanh_mul", "")
                               .typed<void(at::Tensor, at::Tensor)>();
  (act == 1 ? silu : gelu).call(mid, gu);
  const float* a = BF16 ? midf : reinterpret_cast<const float*>(mid.data_ptr());
  if constexpr (BF16) {
    const T* mp = mid.data_ptr<T>();
    at::parallel_for(0, pairs, 16, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) batchgen_cpu::row_to_f32(mp + p * inter, midf + p * ldm, inter);
    });
  }
  fma_groups<BF16>(down_groups, a, ldm, h, inter, c32(y), c16(y), h);
  weigh_and_sum(out.data_ptr<T>(), y.data_ptr<T>(), weights.data_ptr<float>(), slot_pair, n, k, h);
}
#endif

// out [n, H] = the sum over each token's k experts of weight * down(act(gate) * up), the MLPs of a
// sparse MoE block. x [n, H]; order [n * k]: the (token, slot) pairs (slot j of token t is t * k + j,
// its experts ascending) sorted by expert, stably; counts [E]: each expert's pairs, in that order;
// gate_up [2I, H] / down [H, I]: each expert's weights from pack_bf16_weight (x bf16) or
// pack_f32_weight (x fp32); act 1 (SiLU) or 2 (GELU-tanh) over the gate/up output; weights [n, k]
// fp32: each pair's routing weight (as the dtype the family rounds it to). interleaved: gate_up's
// 16-row gate and up blocks alternate (the gated layout of gemm_bf16 and gemm_f32_avx512, whose
// epilogue applies act: the AVX-512 walks); else its gate rows come first, then its up rows, as the
// AVX2 kernels (gemm_bf16_fma, gemm_f32_fma) take them, with act applied between the GEMMs.
// amx_rows (bf16, interleaved; AMX builds, H and I multiples of 32): the experts with at least that
// many pairs run on the AMX tiles (gemm_amx, the same packed weights), the rest on the walk; 0: all
// on the walk.
void moe_experts(at::Tensor out, at::Tensor x, at::Tensor order, std::vector<int64_t> counts,
                 std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, at::Tensor weights, int64_t act,
                 bool interleaved, int64_t amx_rows) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (bf16 || x.scalar_type() == at::kFloat),
              "moe_experts: x [n, H] contiguous, bf16 or fp32");
  TORCH_CHECK(act == 1 || act == 2, "moe_experts: act is 1 (silu) or 2 (gelu_tanh), got ", act);
  const int64_t n = x.size(0), h = x.size(1), pairs = order.numel(), experts = counts.size();
  TORCH_CHECK((n > 0 ? pairs % n == 0 : pairs == 0) && order.scalar_type() == at::kLong && order.is_contiguous(),
              "moe_experts: order int64 [n * k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.numel() == pairs,
              "moe_experts: weights fp32 [n, k]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "moe_experts: out like x");
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == experts && static_cast<int64_t>(down.size()) == experts &&
                  experts > 0, "moe_experts: one gate_up and one down weight per expert count");
  int64_t total = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "moe_experts: a negative expert count");
    total += c;
  }
  TORCH_CHECK(total == pairs, "moe_experts: the expert counts add up to ", total, ", not the ", pairs, " pairs");
  std::vector<int64_t> slot_pair(pairs, -1);  // the op writes through it: order must be a permutation
  const int64_t* ord = order.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ord[p] >= 0 && ord[p] < pairs && slot_pair[ord[p]] < 0, "moe_experts: order is not a permutation of "
                "the ", pairs, " pairs (entry ", p, ": ", ord[p], ")");
    slot_pair[ord[p]] = p;
  }
  // packed shapes: bf16 [blocks, K / 2, 16, 2], fp32 [blocks, K, 16]
  const int64_t per_line = bf16 ? 2 : 1, dims = bf16 ? 4 : 3;
  const auto k_of = [&](const at::Tensor& w) { return w.size(1) * per_line; };
  const int64_t gu_nblk = gate_up[0].size(0), inter = gu_nblk * kCols / 2, d_nblk = down[0].size(0);
  TORCH_CHECK(gu_nblk % 2 == 0 && d_nblk == (h + kCols - 1) / kCols, "moe_experts: gate_up [2I, H] with I a multiple "
              "of 16, down [H, I], packed");
  for (int64_t e = 0; e < experts; ++e) {
    const auto& g = gate_up[e];
    const auto& d = down[e];
    TORCH_CHECK(g.dim() == dims && d.dim() == dims && g.is_contiguous() && d.is_contiguous() &&
                    g.scalar_type() == x.scalar_type() && d.scalar_type() == x.scalar_type() &&
                    g.size(0) == gu_nblk && k_of(g) == h && d.size(0) == d_nblk && k_of(d) == inter,
                "moe_experts: expert ", e, "'s weights are not packed [2I, H] and [H, I] like expert 0's, for x's dtype");
  }
  TORCH_CHECK(amx_rows >= 0, "moe_experts: amx_rows is 0 (no AMX) or a row count, got ", amx_rows);
  if (amx_rows > 0) {
    TORCH_CHECK(bf16 && interleaved, "moe_experts: amx_rows takes bf16 weights in the interleaved gated layout");
#ifdef BATCHGEN_AMX
    TORCH_CHECK(amx_permitted(), "moe_experts: the OS refused AMX tile data to this process");
    TORCH_CHECK(h % 32 == 0 && inter % 32 == 0, "moe_experts: the AMX tiles take H and I in multiples of 32, got H ",
                h, ", I ", inter);
#else
    TORCH_CHECK(false, "moe_experts: amx_rows given, but this build has no AMX (check has_amx_gemm first)");
#endif
  }
  if (n == 0) return;
  if (!interleaved) {
#ifdef BATCHGEN_FMA
    if (bf16)
      moe_fma<true>(out, x, order, counts, gate_up, down, weights, slot_pair, act, inter);
    else
      moe_fma<false>(out, x, order, counts, gate_up, down, weights, slot_pair, act, inter);
#else
    TORCH_CHECK(false, "moe_experts: this build has no AVX2/FMA (check has_fma_bf16_gemm first)");
#endif
    return;
  }
  if (bf16) {
#ifdef BATCHGEN_DPBF16
    with_bf16_walk([&](auto s) {
      moe_walk<decltype(s)>(out, x, order, counts, gate_up, down, weights, slot_pair, act, inter, gu_nblk, d_nblk,
                            amx_rows);
    });
#else
    TORCH_CHECK(false, "moe_experts: this build has no AVX512-BF16 (check has_dpbf16_gemm first)");
#endif
  } else {
#ifdef BATCHGEN_AVX512F
    moe_walk<F32>(out, x, order, counts, gate_up, down, weights, slot_pair, act, inter, gu_nblk, d_nblk, 0);
#else
    TORCH_CHECK(false, "moe_experts: this build has no AVX-512 (check has_avx512_f32_gemm first)");
#endif
  }
}

// ---------------------------------------------------------------------------------------------
// gemm_bf16_amx: gemm_bf16's contract on AMX tiles (Intel Sapphire Rapids and later), on the same
// packed weight. pack_bf16_weight's layout is AMX's B layout as it is: one 16-column block's 16
// k pairs of a 32-k step are 16 rows of 64 bytes, contiguous (one tile load, stride 64).
//
// oneDNN's AMX kernels run a 1.5B model's prefill rows at 650-800 GFLOP/s on 2 cores, but a
// decode step's 17-64 rows at 200-500 GFLOP/s, as slowly as 64 rows at 17-32: there the GEMMs are
// bound by the weight stream, and oneDNN's ran at 8-12 GB/s where our dpbf16 walk streamed 19
// GB/s at one row. Here each thread walks its 32-column units (two blocks) and, for each pair of
// 16-row tiles of x, K in 32-k steps: 2 A tiles x 2 B tiles into 4 fp32 C tiles (2 x 2 blocking:
// 8 tile registers), the weights of the step `kPfSteps` ahead (into the next unit at the end)
// prefetched into L2. Rows past M come from a zero-padded copy of x's last ragged 16 rows.
#ifdef BATCHGEN_AMX
}  // namespace
#include <sys/syscall.h>
#include <unistd.h>
namespace {

constexpr int64_t kPfSteps = 4;  // prefetch distance, in 32-k steps

// Linux hands AMX tile data to a process only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One unit (NB blocks) x one pair of row tiles (TWO: both): C tiles 0, 1 (rows of tile a0, blocks
// 0, 1), 2, 3 (tile a1); A tiles 4, 5; B tiles 6, 7. The C tiles go to cbuf [4][16][16].
template <bool TWO, int NB>
__attribute__((noinline)) void amx_unit(const char* a0, int64_t lda0, const char* a1, int64_t lda1, const char* wb,
                                        int64_t bstride, int64_t steps, const char* pf, const char* pf_next,
                                        float* cbuf) {
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (TWO) _tile_zero(2);
  if (TWO && NB == 2) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    // the weights kPfSteps ahead: this unit's (pf), else the next unit's first steps (pf_next); either
    // may be null (nothing to prefetch)
    const int64_t ps = s + kPfSteps;
    const char* p = ps < steps ? (pf ? pf + ps * 1024 : nullptr)
                               : (pf_next && ps - steps < steps ? pf_next + (ps - steps) * 1024 : nullptr);
    if (p)
      for (int j = 0; j < NB; ++j)
        for (int l = 0; l < 16; ++l) _mm_prefetch(p + j * bstride + l * 64, _MM_HINT_T1);
    _tile_loadd(4, a0 + s * 64, lda0);
    if (TWO) _tile_loadd(5, a1 + s * 64, lda1);
    _tile_loadd(6, wb + s * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO) _tile_dpbf16ps(2, 5, 6);
    if (NB == 2) {
      _tile_loadd(7, wb + bstride + s * 1024, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (TWO) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 64);
  if (NB == 2) _tile_stored(1, cbuf + 256, 64);
  if (TWO) _tile_stored(2, cbuf + 512, 64);
  if (TWO && NB == 2) _tile_stored(3, cbuf + 768, 64);
}

void gemm_amx(uint16_t* c, const uint16_t* a, int64_t m, int64_t lda, const char* w, int64_t nblk, int64_t k,
              int64_t n, const float* bias, int act) {
  const int64_t steps = k / 32, bstride = k / 2 * 64, units = (nblk + 1) / 2, tiles = (m + 15) / 16;
  const int64_t ldc = act ? n / 2 : n, full = m / 16;
  std::vector<uint16_t> tail;  // x's last m % 16 rows, zero-padded to 16
  if (m % 16) {
    tail.assign(16 * k, 0);
    for (int64_t i = full * 16; i < m; ++i)
      std::memcpy(tail.data() + (i - full * 16) * k, a + i * lda, k * sizeof(uint16_t));
  }
  auto tile_rows = [&](int64_t t, int64_t& ld) -> const char* {
    if (t < full) {
      ld = lda * 2;
      return reinterpret_cast<const char*>(a + t * 16 * lda);
    }
    ld = k * 2;
    return reinterpret_cast<const char*>(tail.data());
  };
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    alignas(64) float cbuf[4 * 256];
    batchgen_cpu::FlushDenormals ftz;  // as silu_mul / gelu_tanh_mul run
    for (int64_t u = begin; u < end; ++u) {
      const int64_t blk0 = 2 * u, nb = std::min<int64_t>(2, nblk - blk0);
      const char* wb = w + blk0 * bstride;
      const char* next = u + 1 < end ? wb + 2 * bstride : nullptr;
      for (int64_t t = 0; t < tiles; t += 2) {
        int64_t ld0 = 0, ld1 = 0;
        const char* a0 = tile_rows(t, ld0);
        const bool two = t + 1 < tiles;
        const char* a1 = two ? tile_rows(t + 1, ld1) : a0;
        // the prefetch runs ahead of the first row-tile pair only; later pairs find the unit in L2
        const char* pf = t == 0 ? wb : nullptr;
        const char* pfn = t + 2 >= tiles ? next : nullptr;
        const auto unit = two ? (nb == 2 ? amx_unit<true, 2> : amx_unit<true, 1>)
                              : (nb == 2 ? amx_unit<false, 2> : amx_unit<false, 1>);
        unit(a0, ld0, a1, ld1, wb, bstride, steps, pf, pfn, cbuf);
        // epilogue: rows of tile t (cbuf 0, 1) and t + 1 (cbuf 2, 3)
        for (int h = 0; h < (two ? 2 : 1); ++h) {
          const int64_t r0 = (t + h) * 16, rn = std::min<int64_t>(16, m - r0);
          const float* cb = cbuf + h * 512;
          if (act) {  // block 0 gate, block 1 up -> 16 output columns
            const __m512 bg = bias ? _mm512_loadu_ps(bias + blk0 * kCols) : _mm512_setzero_ps();
            const __m512 bu = bias ? _mm512_loadu_ps(bias + (blk0 + 1) * kCols) : _mm512_setzero_ps();
            for (int64_t i = 0; i < rn; ++i)
              Bf16::store(c + (r0 + i) * ldc + u * kCols, 0xFFFF,
                          gated16<Bf16>(_mm512_load_ps(cb + i * 16), _mm512_load_ps(cb + 256 + i * 16), bg, bu, act));
            continue;
          }
          for (int64_t j = 0; j < nb; ++j) {
            const int cols = static_cast<int>(std::min<int64_t>(kCols, n - (blk0 + j) * kCols));
            const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
            const __m512 bj = bias ? _mm512_maskz_loadu_ps(mask, bias + (blk0 + j) * kCols) : _mm512_setzero_ps();
            for (int64_t i = 0; i < rn; ++i)
              Bf16::store(c + (r0 + i) * ldc + (blk0 + j) * kCols, mask,
                          _mm512_add_ps(_mm512_load_ps(cb + j * 256 + i * 16), bj));
          }
        }
      }
    }
    _tile_release();
  });
}
#endif  // BATCHGEN_AMX

bool has_amx_gemm() {
#ifdef BATCHGEN_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// gemm_bf16's contract on AMX tiles; K a multiple of 32 (check has_amx_gemm first).
void gemm_bf16_amx(at::Tensor out, at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t act) {
#ifdef BATCHGEN_AMX
  TORCH_CHECK(amx_permitted(), "gemm_bf16_amx: the OS refused AMX tile data to this process");
  TORCH_CHECK(act >= 0 && act <= 2, "gemm_bf16_amx: act is 0 (none), 1 (silu) or 2 (gelu_tanh), got ", act);
  check_gemm_args("gemm_bf16_amx", out, x, packed, bias, act != 0);
  TORCH_CHECK(x.size(1) % 32 == 0, "gemm_bf16_amx: K must be a multiple of 32, got ", x.size(1));
  const int64_t m = x.size(0), n = out.size(1) * (act ? 2 : 1);
  if (m == 0 || n == 0) return;
  if (x.size(1) == 0) return bias_only(out, bias);
  gemm_amx(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()), m,
           x.stride(0), static_cast<const char*>(packed.data_ptr()), packed.size(0), x.size(1), n,
           bias.has_value() ? bias->data_ptr<float>() : nullptr, static_cast<int>(act));
#else
  TORCH_CHECK(false, "gemm_bf16_amx: this build has no AMX (check has_amx_gemm first)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen_cpu, m) {
  m.def("has_dpbf16_gemm() -> bool", &has_dpbf16_gemm);
  m.def("has_fma_bf16_gemm() -> bool", &has_fma_bf16_gemm);
  m.def("has_avx512_f32_gemm() -> bool", &has_avx512_f32_gemm);
  m.def("gemm_f32_avx512(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int act=0) -> ()", &gemm_f32_avx512);
  m.def("pack_bf16_weight(Tensor w) -> Tensor", &pack_bf16_weight);
  m.def("gemm_bf16(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int act=0) -> ()", &gemm_bf16);
  m.def("gemm_bf16_fma(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()", &gemm_bf16_fma);
  m.def("pack_f32_weight(Tensor w) -> Tensor", &pack_f32_weight);
  m.def("gemm_f32_fma(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()", &gemm_f32_fma);
  m.def("has_amx_gemm() -> bool", &has_amx_gemm);
  m.def("moe_experts(Tensor(a!) out, Tensor x, Tensor order, int[] counts, Tensor[] gate_up, Tensor[] down, "
        "Tensor weights, int act, bool interleaved=True, int amx_rows=0) -> ()", &moe_experts);
  m.def("gemm_bf16_amx(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int act=0) -> ()", &gemm_bf16_amx);
}
