#include "diff/value_stats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ckptfs::diff {

void ValueStats::Merge(const ValueStats& other) {
  differing += other.differing;
  max_abs = std::max(max_abs, other.max_abs);
  max_rel = std::max(max_rel, other.max_rel);
  sumsq_a += other.sumsq_a;
  sumsq_diff += other.sumsq_diff;
}

// The sums run in four lanes, added at the end of each call: a call covers a few thousand
// values, so each partial sum stays short and the float64 rounding error of a tensor's norm
// grows with the number of calls, not of values (torch's norm sums pairwise, to ~1e-16).
void AddValuePairs(const double* a, const double* b, size_t count, double atol, double rtol, ValueStats* stats) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double sq_a[4] = {0, 0, 0, 0}, sq_d[4] = {0, 0, 0, 0};
  uint64_t differing = 0;
  double max_abs = stats->max_abs, max_rel = stats->max_rel;
  for (size_t i = 0; i < count; ++i) {
    const double x = a[i], y = b[i];
    if (!std::isnan(x)) sq_a[i & 3] += x * x;
    if (x == y) continue;  // also +0 and -0, and equal infinities
    const bool nan_x = std::isnan(x), nan_y = std::isnan(y);
    if (nan_x || nan_y) {
      if (!(nan_x && nan_y)) ++differing;
      continue;
    }
    const double d = std::fabs(x - y);  // infinite when either is
    max_abs = std::max(max_abs, d);
    max_rel = std::max(max_rel, x == 0 ? kInf : d / std::fabs(x));
    sq_d[i & 3] += d * d;
    if (!(d <= atol + rtol * std::fabs(y))) ++differing;
  }
  stats->differing += differing;
  stats->max_abs = max_abs;
  stats->max_rel = max_rel;
  stats->sumsq_a += (sq_a[0] + sq_a[1]) + (sq_a[2] + sq_a[3]);
  stats->sumsq_diff += (sq_d[0] + sq_d[1]) + (sq_d[2] + sq_d[3]);
}

void AddSquares(const double* a, size_t count, ValueStats* stats) {
  double sq[4] = {0, 0, 0, 0};
  for (size_t i = 0; i < count; ++i)
    if (!std::isnan(a[i])) sq[i & 3] += a[i] * a[i];
  stats->sumsq_a += (sq[0] + sq[1]) + (sq[2] + sq[3]);
}

}  // namespace ckptfs::diff
