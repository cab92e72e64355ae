// The per-value arithmetic of a diff: what a stretch of float64 value pairs adds to a pair's
// figures (differing count, largest differences, sums of squares).
#ifndef CKPTFS_DIFF_VALUE_STATS_HPP_
#define CKPTFS_DIFF_VALUE_STATS_HPP_

#include <cstddef>
#include <cstdint>

namespace ckptfs::diff {

struct ValueStats {
  uint64_t differing = 0;
  double max_abs = 0;
  double max_rel = 0;
  double sumsq_a = 0;     // sum of a^2 over A's non-NaN values
  double sumsq_diff = 0;  // sum of (a - b)^2 over pairs where both are numbers

  // Adds `other`'s figures (a stretch compared elsewhere) to these.
  void Merge(const ValueStats& other);
};

// Adds the pairs (a[i], b[i]), i < count, to *stats: a pair differs unless a == b, both are
// NaN, or |a - b| <= atol + rtol * |b|.
void AddValuePairs(const double* a, const double* b, size_t count, double atol, double rtol, ValueStats* stats);

// Adds only a^2 of A's values (stretches whose bytes are identical on both sides).
void AddSquares(const double* a, size_t count, ValueStats* stats);

}  // namespace ckptfs::diff

#endif  // CKPTFS_DIFF_VALUE_STATS_HPP_
