// Diff: two views compared tensor by tensor, the way `ckptfs diff` and ckptfs_diff report it.
//
// Tensors are matched by served key. A pair of the same shape is read in bounded chunks from
// both views (several worker threads, each with its own buffers, so reads of both sides are
// in flight together and memory does not grow with the checkpoint); chunks of equal served
// dtype are compared byte for byte first and skip the arithmetic when identical. Otherwise
// every element of both sides is taken to float64 and the pair's differing-element count,
// largest absolute and relative difference and the sums of ||A||^2 and ||A-B||^2 are
// accumulated in float64.
#ifndef CKPTFS_DIFF_HPP_
#define CKPTFS_DIFF_HPP_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/catalog.hpp"
#include "ckptfs/dtype.hpp"
#include "ckptfs/status.hpp"
#include "ckptfs/view.hpp"

namespace ckptfs {

struct DiffOptions {
  // Elements a and b (A's and B's) are equal when |a - b| <= atol + rtol * |b|, as
  // torch.isclose(A, B) decides; NaN equals NaN. 0 and 0: equal values only.
  double atol = 0;
  double rtol = 0;
  unsigned threads = 0;              // worker threads (at most 64); 0: one per core, at most 8
  uint64_t chunk_bytes = 4u << 20;   // bytes of one side read per step of a worker
};

// How a tensor present on both sides compares.
enum class PairVerdict : uint8_t {
  kIdentical,     // same served dtype and the same bytes
  kEqual,         // every element pair equal within the tolerance
  kDifferent,     // some element pair is not
  kShape,         // the shapes differ: values not compared
  kIncomparable,  // one side complex, the other not: values not compared
};
std::string_view VerdictName(PairVerdict verdict);  // "identical", "equal", ...

struct PairDiff {
  std::string key;
  size_t index_a = 0, index_b = 0;  // in each view's served tensors
  DType dtype_a = DType::kF32, dtype_b = DType::kF32;  // as served
  Shape shape_a, shape_b;
  PairVerdict verdict = PairVerdict::kIdentical;
  uint64_t elements = 0;    // elements of each side, when values are compared
  uint64_t numel = 0;       // values compared (complex: two per element)
  uint64_t differing = 0;   // value pairs not equal within the tolerance
  double max_abs = 0;       // largest |a - b| over pairs where both are numbers
  double max_rel = 0;       // largest |a - b| / |a|: infinite where a is 0 and b is not
  double norm_a = 0;        // ||A||, float64
  double norm_diff = 0;     // ||A - B||, float64, NaN pairs left out
  // ||A - B|| / ||A||: 0 when both are 0, infinite when only ||A|| is.
  double rel_l2() const;
  bool equal() const { return verdict == PairVerdict::kIdentical || verdict == PairVerdict::kEqual; }
};

struct DiffResult {
  std::string source_a, source_b;
  size_t tensors_a = 0, tensors_b = 0;
  std::vector<std::string> only_a, only_b;  // keys, in each view's order
  std::vector<PairDiff> pairs;              // tensors on both sides, in A's order
  double atol = 0, rtol = 0;
  bool equal() const;
};

// Which side a failure of CompareViews came from.
enum class DiffSide : uint8_t { kNone, kA, kB };

// Compares every tensor of `a` with the tensor of the same key in `b`. `progress` (may be
// empty) is called, from one thread at a time, with the bytes of both sides read so far and
// their total. On a read error, *failed (if given) says which side it came from.
Status CompareViews(const View& a, const View& b, const DiffOptions& options,
                    const std::function<void(uint64_t done, uint64_t total)>& progress, DiffResult* out,
                    DiffSide* failed = nullptr);

// The result as `ckptfs diff --json` prints it and ckptfs_diff returns it (doc/CLI.md).
nlohmann::json DiffToJson(const DiffResult& result);

}  // namespace ckptfs

#endif  // CKPTFS_DIFF_HPP_
