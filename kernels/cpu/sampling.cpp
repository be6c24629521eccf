// The sampler's row kernels (sampling.h).
//
// The kernels of localllm/engine/sampler.py's sample_rows and argmax_rows (their torch
// reference and the semantics are there): a row is a temperature softmax whose top-k, top-p
// and min-p cuts are each a weight threshold, drawn by inverse CDF at a given u in (0, 1],
// in vocabulary order. Torch needs ~1 ms for that on a 49k vocabulary on a 2-core CPU (topk,
// softmax, cumsum: a pass and an allocation each); here it is a few vectorised passes, and
// the thresholds are found among the few tokens that can hold them.

#include "sampling.h"

#include <functional>
#include <utility>
#include <vector>

#include "common.h"

namespace localllm_cpu {
namespace {

constexpr int64_t kChunk = 256;  // the draw and the candidate search skip whole chunks

// The largest value of x[0..n) (-inf for none; NaN is skipped).
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;  // std::max does not vectorise here
  return m;
}

// The first index of the row's largest value (NaN is never the largest here; torch's argmax
// would return it, but a NaN row has no right answer anyway).
int64_t argmax_row(const float* x, int64_t V) {
  const float m = row_max(x, V);
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t e = std::min(V, c + kChunk);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c; i < e; ++i) hit |= x[i] == m;
    if (hit)
      for (int64_t i = c; i < e; ++i)
        if (x[i] == m) return i;
  }
  return 0;
}

struct SampleScratch {
  std::vector<float> w;          // the row's weights, exp((x - max) / T): the likeliest is 1
  std::vector<double> chunk_sum;
  std::vector<float> chunk_max;
  std::vector<float> vals;       // candidate weights
  std::vector<int32_t> idx;      // top-k first: the candidates' tokens, in vocabulary order
  std::vector<float> maxima;     // scratch for nth_element
};

// The weights of w >= lo (and > 0) in the chunks whose largest weight reaches lo.
void gather(const SampleScratch& s, int64_t V, float lo, std::vector<float>& out) {
  out.resize(V);
  float* o = out.data();
  const float* w = s.w.data();
  int64_t n = 0;
  for (size_t c = 0; c < s.chunk_max.size(); ++c) {
    if (s.chunk_max[c] < lo || s.chunk_max[c] <= 0.f) continue;
    const int64_t e = std::min<int64_t>(V, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < e; ++i) {  // branch-free: most tokens fail the test
      o[n] = w[i];
      n += w[i] >= lo && w[i] > 0.f;
    }
  }
  out.resize(n);
}

double mass_from(const std::vector<float>& vals, float v) {
  double acc = 0;
  const float* p = vals.data();
  const int64_t n = static_cast<int64_t>(vals.size());
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += p[i] >= v ? p[i] : 0.f;
  return acc;
}

// top-k: the k-th largest weight (0: fewer than k tokens have weight). At least k tokens
// lie in the k chunks of largest maxima, so the k-th largest chunk maximum bounds it below.
float kth_weight(SampleScratch& s, int64_t V, int64_t k) {
  float lo = 0.f;
  if (k <= static_cast<int64_t>(s.chunk_max.size())) {
    std::vector<float> maxima(s.chunk_max);
    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
    lo = maxima[k - 1];
  }
  gather(s, V, lo, s.vals);
  if (static_cast<int64_t>(s.vals.size()) < k) return 0.f;
  std::nth_element(s.vals.begin(), s.vals.begin() + (k - 1), s.vals.end(), std::greater<float>());
  return s.vals[k - 1];
}

// top-p's threshold by a radix select on the bits of the weights (positive floats order as
// their bits): three levels of 2048, 1024 and 1024 buckets, each bucket's mass summed, the
// race narrowed each time to the bucket where the mass from the top reaches `want`. Three
// passes over the candidates where a bisection on the bits made ~30.
struct RadixSelect {
  static constexpr int kShift[3] = {20, 10, 0};
  static constexpr int kBuckets[3] = {2048, 1024, 1024};
  int32_t base = 0;  // every value still in the race has bits in [base, base + span(level))
  double above = 0;  // the mass of the values above that range
  double mass[2048];

  static int64_t span(int level) { return int64_t{kBuckets[level]} << kShift[level]; }
  void clear(int level) { std::fill(mass, mass + kBuckets[level], 0.0); }
  void add(int level, const float* v, int64_t n) {
    const int64_t sp = span(level);
    const int shift = kShift[level];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = int64_t{__builtin_bit_cast(int32_t, v[i])} - base;
      if (off >= 0 && off < sp) mass[off >> shift] += v[i];
    }
  }
  // narrows the race to the bucket where the mass from the top first reaches want
  void pick(int level, double want) {
    int b = kBuckets[level] - 1;
    while (b > 0 && above + mass[b] < want) above += mass[b--];
    base += b << kShift[level];
  }
  float value() const { return __builtin_bit_cast(float, base); }
};

// The largest of `vals` (positive weights, their sum at least `want`, but for rounding) whose
// values at or above it hold at least `want`.
float top_p_value(const std::vector<float>& vals, double want) {
  RadixSelect r;
  for (int level = 0; level < 3; ++level) {
    r.clear(level);
    r.add(level, vals.data(), static_cast<int64_t>(vals.size()));
    r.pick(level, want);
  }
  return r.value();
}

// top-p over the tokens of weight >= lo: the largest weight v whose tokens of weight >= v
// hold at least `want` (the weight of the first token, in likelihood order, whose running
// mass reaches it). The likeliest tokens are looked at first: in a peaked row the few of
// weight >= 2^-8 hold the mass wanted, and only their chunks are read.
float top_p_weight(SampleScratch& s, int64_t V, float lo, double want) {
  double mass = 0;
  for (float tau : {0x1p-8f, 0x1p-24f, 0.f}) {
    gather(s, V, std::max(tau, lo), s.vals);
    mass = mass_from(s.vals, 0.f);
    if (mass >= want) break;
  }
  if (s.vals.empty() || mass < want) return lo;  // rounding: everything is kept
  return std::max(lo, top_p_value(s.vals, want));
}

// A row with a top-k cut (k < V), the same cuts and draw as sample_row's full pass but for
// rounding, without a weight for every token: weights grow with logits, so the k likeliest
// tokens lie in the k chunks of largest logit (at least k tokens reach the k-th largest chunk
// maximum), and only the tokens there at or above that bound get a weight. Top-p, min-p and
// the draw then work on the few tokens top-k keeps. On Gemma's 262k vocabulary that is one
// read of the row instead of an exp, a write and several gathers over it (16 rows at top-k
// 40: 0.96 ms of CPU instead of 2.97, docs/benchmarks.md).
int64_t sample_row_top_k(const float* x, int64_t V, double temp, int64_t k, double p, double min_p, double u,
                         SampleScratch& s) {
  const int64_t nc = (V + kChunk - 1) / kChunk;
  s.chunk_max.resize(nc);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t b = c * kChunk;
    s.chunk_max[c] = row_max(x + b, std::min(V, b + kChunk) - b);
    m = s.chunk_max[c] > m ? s.chunk_max[c] : m;
  }
  if (!(m > -std::numeric_limits<float>::infinity()) || std::isinf(m)) return argmax_row(x, V);
  float lo = -std::numeric_limits<float>::infinity();
  if (k <= nc) {
    s.maxima.assign(s.chunk_max.begin(), s.chunk_max.end());
    std::nth_element(s.maxima.begin(), s.maxima.begin() + (k - 1), s.maxima.end(), std::greater<float>());
    lo = s.maxima[k - 1];
  }
  int64_t chunks = 0;
  for (int64_t c = 0; c < nc; ++c) chunks += s.chunk_max[c] >= lo;
  s.idx.resize(chunks * kChunk);
  s.vals.resize(chunks * kChunk);
  const float inv = static_cast<float>(1.0 / temp);
  float wbuf[kChunk];
  int64_t n = 0;
  for (int64_t c = 0; c < nc; ++c) {
    if (!(s.chunk_max[c] >= lo)) continue;
    const int64_t b = c * kChunk, e = std::min(V, b + kChunk);
#pragma omp simd
    for (int64_t i = b; i < e; ++i) {
      const float d = (x[i] - m) * inv;
      wbuf[i - b] = d < -87.f ? 0.f : fast_exp(d);  // as sample_row weighs it
    }
    for (int64_t i = b; i < e; ++i) {  // branch-free: most fail
      const float wi = wbuf[i - b];
      s.idx[n] = static_cast<int32_t>(i);
      s.vals[n] = wi;
      n += (x[i] >= lo) & (wi > 0.f);
    }
  }
  // top-k: the k-th largest weight (0: fewer than k tokens have weight, and all are kept)
  float thr = 0.f;
  if (n >= k) {
    s.maxima.assign(s.vals.begin(), s.vals.begin() + n);
    std::nth_element(s.maxima.begin(), s.maxima.begin() + (k - 1), s.maxima.end(), std::greater<float>());
    thr = s.maxima[k - 1];
  }
  int64_t kept = 0;  // compact to the tokens top-k keeps, still in vocabulary order
  for (int64_t j = 0; j < n; ++j) {
    s.idx[kept] = s.idx[j];
    s.vals[kept] = s.vals[j];
    kept += s.vals[j] >= thr;
  }
  s.vals.resize(kept);
  if (p < 1.0 && kept > 0) {
    // top-p of what top-k keeps: the largest weight v whose tokens of weight >= v hold p of it
    const double mass = mass_from(s.vals, 0.f);
    thr = std::max(thr, top_p_value(s.vals, p * mass));
  }
  thr = std::max(thr, static_cast<float>(min_p));
  double total = 0;
  for (int64_t j = 0; j < kept; ++j) total += s.vals[j] >= thr ? s.vals[j] : 0.f;
  const double target = u * total;
  double acc = 0;
  int64_t pos = -1;
  for (int64_t j = 0; j < kept; ++j) {
    if (!(s.vals[j] >= thr)) continue;
    acc += s.vals[j];
    pos = s.idx[j];
    if (acc >= target) return pos;
  }
  return pos >= 0 ? pos : argmax_row(x, V);  // rounding: the last kept token
}

int64_t sample_row(const float* x, int64_t V, double temp, int64_t k, double p, double min_p, double u,
                   SampleScratch& s) {
  if (temp <= 0) return argmax_row(x, V);
  if (k < V) return sample_row_top_k(x, V, temp, k, p, min_p, u, s);
  const float m = row_max(x, V);
  if (!(m > -std::numeric_limits<float>::infinity()) || std::isinf(m)) return argmax_row(x, V);
  const int64_t nc = (V + kChunk - 1) / kChunk;
  s.w.resize(V);
  s.chunk_sum.resize(nc);
  s.chunk_max.resize(nc);
  float* w = s.w.data();
  const float inv = static_cast<float>(1.0 / temp);
  double total = 0;
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t b = c * kChunk, e = std::min(V, b + kChunk);
    float cs = 0.f, cm = 0.f;
#pragma omp simd reduction(+ : cs) reduction(max : cm)
    for (int64_t i = b; i < e; ++i) {
      const float d = (x[i] - m) * inv;
      const float wi = d < -87.f ? 0.f : fast_exp(d);  // -inf (a masked token) gives exactly 0
      w[i] = wi;
      cs += wi;
      cm = wi > cm ? wi : cm;
    }
    s.chunk_sum[c] = cs;
    s.chunk_max[c] = cm;
    total += cs;
  }
  // every cut is a weight floor: top-k's k-th weight, top-p's, and min-p's (the likeliest
  // token weighs exactly 1, fast_exp(0))
  float thr = 0.f;
  if (k < V) thr = kth_weight(s, V, k);
  if (p < 1.0) {
    const double mass = thr > 0.f ? mass_from(s.vals, thr) : total;  // top-p's share is of top-k's tokens
    thr = top_p_weight(s, V, thr, p * mass);
  }
  thr = std::max(thr, static_cast<float>(min_p));
  if (thr > 0.f) {
    total = 0;
    for (int64_t c = 0; c < nc; ++c) {
      if (s.chunk_max[c] < thr) {
        s.chunk_sum[c] = 0;
        continue;
      }
      const int64_t b = c * kChunk, e = std::min(V, b + kChunk);
      float cs = 0.f;
#pragma omp simd reduction(+ : cs)
      for (int64_t i = b; i < e; ++i) {
        w[i] = w[i] >= thr ? w[i] : 0.f;
        cs += w[i];
      }
      s.chunk_sum[c] = cs;
      total += cs;
    }
  }
  // the draw: the first token whose running mass reaches u of the total, a chunk at a time
  const double target = u * total;
  double acc = 0;
  int64_t last = -1;
  for (int64_t c = 0; c < nc; ++c) {
    if (s.chunk_sum[c] <= 0) continue;
    last = c;
    if (acc + s.chunk_sum[c] < target) {
      acc += s.chunk_sum[c];
      continue;
    }
    const int64_t b = c * kChunk, e = std::min(V, b + kChunk);
    int64_t pos = -1;
    for (int64_t i = b; i < e; ++i) {
      if (w[i] <= 0.f) continue;
      acc += w[i];
      pos = i;
      if (acc >= target) return i;
    }
    return pos;  // rounding: the chunk's sum said it is here
  }
  for (int64_t i = std::min(V, (last + 1) * kChunk) - 1; i >= 0; --i)  // rounding past the end
    if (w[i] > 0.f) return i;
  return argmax_row(x, V);
}

}  // namespace

// The row is split into one part per thread, in the order parallel_for hands out the columns
// of the head's gguf_linear that wrote it, so each thread reads what it wrote, from its own
// cache (one thread reading a whole 49k row fresh from the other core's: ~100 us, not ~10).
void argmax_rows(const float* xp, int64_t R, int64_t V, int64_t* op) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(num_threads(), V / 4096));
  std::vector<std::pair<float, int64_t>> best(R * parts);
  parallel_for(0, R * parts, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t part = u / R, r = u % R, b = part * V / parts, e = (part + 1) * V / parts;
      const int64_t i = b + argmax_row(xp + r * V + b, e - b);
      best[u] = {xp[r * V + i], i};
    }
  });
  for (int64_t r = 0; r < R; ++r) {
    auto top = best[r];
    for (int64_t part = 1; part < parts; ++part)  // a later part wins only if strictly larger: first index
      if (best[part * R + r].first > top.first) top = best[part * R + r];
    op[r] = top.second;
  }
}

// The indices of each row's k largest values, largest first (ties: the lower index first;
// NaN counts as the smallest). torch.topk takes ~300 us for k = 8 of a 49k row on a 2-core
// CPU; here the k-th largest chunk maximum bounds the k-th value from below, so only the
// tokens above it are sorted. As in argmax_rows, each row is split into one part per thread,
// in the order the head's gguf_linear wrote its columns, so each thread reads what it wrote
// (a row per thread read half of each 262k row from the other core: ~3x argmax's time); each
// part's k best then merge.
void topk_indices(const float* xp, int64_t R, int64_t V, int64_t k, int64_t* op) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(num_threads(), V / 4096));
  std::vector<int64_t> best(R * parts * k);  // per (part, row): its k best indices, best first
  parallel_for(0, R * parts, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> maxima, sorted;
    std::vector<int32_t> cand;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t part = u / R, r = u % R, b = part * V / parts, n_part = (part + 1) * V / parts - b;
      const float* row = xp + r * V;
      const auto key = [row](int64_t i) {
        return std::isnan(row[i]) ? -std::numeric_limits<float>::infinity() : row[i];
      };
      const int64_t nc = (n_part + kChunk - 1) / kChunk;
      maxima.resize(nc);
      for (int64_t c = 0; c < nc; ++c)
        maxima[c] = row_max(row + b + c * kChunk, std::min(n_part, (c + 1) * kChunk) - c * kChunk);
      float lo = -std::numeric_limits<float>::infinity();
      if (k <= nc) {
        sorted.assign(maxima.begin(), maxima.end());
        std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
        lo = sorted[k - 1];
      }
      int64_t chunks = 0;
      for (int64_t c = 0; c < nc; ++c) chunks += maxima[c] >= lo;
      cand.resize(std::max(chunks * kChunk, n_part >= k ? k : n_part));
      int64_t n = 0;
      for (int64_t c = 0; c < nc; ++c) {
        if (!(maxima[c] >= lo)) continue;  // no token of this chunk reaches the bound
        const int64_t e = b + std::min(n_part, (c + 1) * kChunk);
        for (int64_t i = b + c * kChunk; i < e; ++i) {  // branch-free: most fail
          cand[n] = static_cast<int32_t>(i);
          n += row[i] >= lo;
        }
      }
      if (n < std::min(k, n_part)) {  // NaNs fooled the bound: take every index of the part
        cand.resize(n_part);
        for (int64_t i = 0; i < n_part; ++i) cand[i] = static_cast<int32_t>(b + i);
        n = n_part;
      }
      const int64_t m = std::min(k, n);
      std::partial_sort(cand.begin(), cand.begin() + m, cand.begin() + n, [&](int32_t a, int32_t c) {
        const float ka = key(a), kc = key(c);
        return ka > kc || (ka == kc && a < c);
      });
      int64_t* out = best.data() + u * k;
      for (int64_t j = 0; j < k; ++j) out[j] = j < m ? cand[j] : -1;  // -1: a part of fewer than k tokens
    }
  });
  std::vector<int64_t> merged;
  for (int64_t r = 0; r < R; ++r) {
    const float* row = xp + r * V;
    const auto key = [row](int64_t i) {
      return std::isnan(row[i]) ? -std::numeric_limits<float>::infinity() : row[i];
    };
    merged.clear();
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t j = 0; j < k; ++j)
        if (best[(part * R + r) * k + j] >= 0) merged.push_back(best[(part * R + r) * k + j]);
    std::partial_sort(merged.begin(), merged.begin() + k, merged.end(), [&](int64_t a, int64_t c) {
      const float ka = key(a), kc = key(c);
      return ka > kc || (ka == kc && a < c);
    });
    std::copy(merged.begin(), merged.begin() + k, op + r * k);
  }
}

void sample_rows(const float* xp, int64_t R, int64_t V, const double* temps, const int64_t* top_ks,
                 const double* top_ps, const double* min_ps, const double* u, int64_t* op) {
  parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    thread_local SampleScratch scratch;
    for (int64_t r = r0; r < r1; ++r)
      op[r] = sample_row(xp + r * V, V, temps[r], std::max<int64_t>(top_ks[r], 1), top_ps[r], min_ps[r], u[r],
                         scratch);
  });
}

}  // namespace localllm_cpu
