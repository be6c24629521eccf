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

// top-p over the tokens of weight >= lo: the largest weight v whose tokens of weight >= v
// hold at least `want` (the weight of the first token, in likelihood order, whose running
// mass reaches it), by bisection on the bits of v (positive floats order as their bits).
float top_p_weight(SampleScratch& s, int64_t V, float lo, double want) {
  double mass = 0;
  for (float tau : {0x1p-8f, 0x1p-24f, 0.f}) {
    gather(s, V, std::max(tau, lo), s.vals);
    mass = mass_from(s.vals, 0.f);
    if (mass >= want) break;
  }
  if (s.vals.empty() || mass < want) return lo;  // rounding: everything is kept
  const auto [mn, mx] = std::minmax_element(s.vals.begin(), s.vals.end());
  int32_t a = __builtin_bit_cast(int32_t, *mn), b = __builtin_bit_cast(int32_t, *mx);
  while (a < b) {  // invariant: mass_from(bits a) >= want
    const int32_t mid = a + (b - a + 1) / 2;
    if (mass_from(s.vals, __builtin_bit_cast(float, mid)) >= want) {
      a = mid;
    } else {
      b = mid - 1;
    }
  }
  return __builtin_bit_cast(float, a);
}

int64_t sample_row(const float* x, int64_t V, double temp, int64_t k, double p, double min_p, double u,
                   SampleScratch& s) {
  if (temp <= 0) return argmax_row(x, V);
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
// tokens above it are sorted.
void topk_indices(const float* xp, int64_t R, int64_t V, int64_t k, int64_t* op) {
  const int64_t nc = (V + kChunk - 1) / kChunk;
  parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> maxima(nc);
    std::vector<int32_t> cand(V);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      const auto key = [row](int32_t i) {
        return std::isnan(row[i]) ? -std::numeric_limits<float>::infinity() : row[i];
      };
      for (int64_t c = 0; c < nc; ++c) maxima[c] = row_max(row + c * kChunk, std::min(V, (c + 1) * kChunk) - c * kChunk);
      float lo = -std::numeric_limits<float>::infinity();
      if (k <= nc) {
        std::vector<float> sorted(maxima);
        std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
        lo = sorted[k - 1];
      }
      int64_t n = 0;
      for (int64_t c = 0; c < nc; ++c) {
        if (!(maxima[c] >= lo)) continue;  // no token of this chunk reaches the bound
        const int64_t e = std::min(V, (c + 1) * kChunk);
        for (int64_t i = c * kChunk; i < e; ++i) {  // branch-free: most fail
          cand[n] = static_cast<int32_t>(i);
          n += row[i] >= lo;
        }
      }
      if (n < k) {  // NaNs fooled the bound: take every index
        for (int64_t i = 0; i < V; ++i) cand[i] = static_cast<int32_t>(i);
        n = V;
      }
      std::partial_sort(cand.begin(), cand.begin() + k, cand.begin() + n, [&](int32_t a, int32_t b) {
        const float ka = key(a), kb = key(b);
        return ka > kb || (ka == kb && a < b);
      });
      for (int64_t j = 0; j < k; ++j) op[r * k + j] = cand[j];
    }
  });
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
