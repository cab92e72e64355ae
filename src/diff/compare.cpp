// CompareViews: the pairs of two views matched by key, read in chunks by worker threads and
// reduced to each pair's figures.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ckptfs/diff.hpp"
#include "diff/decode.hpp"
#include "diff/value_stats.hpp"
#include "io/checked_math.hpp"
#include "io/parallel.hpp"

namespace ckptfs {
namespace {

// Values taken to float64 at a time: small enough to stay in a core's cache beside the
// chunk being read, large enough that each call's partial sums are few.
constexpr size_t kBlockValues = 8192;
constexpr unsigned kDefaultMaxThreads = 8;
// Each worker holds two chunks: more threads than this would only hold more memory.
constexpr unsigned kMaxThreads = 64;

// Elements [first, first + count) of pair `pair`.
struct Item {
  size_t pair = 0;
  uint64_t first = 0, count = 0;
};

// What the workers gather of one pair.
struct PairState {
  diff::ValueStats stats;
  bool bytes_differ = false;   // some chunk had other bytes (or the dtypes differ)
  bool some_identical = false; // some chunk had the same bytes: pass 2 sums its ||A||^2
  // The sums of squares of each chunk, kept while the pair's chunks come in and added in
  // chunk order once all have: the figures do not depend on which thread ended first.
  std::vector<std::pair<double, double>> chunk_sums;
  uint64_t chunks_merged = 0;
};

// One worker's buffers: a chunk of each side and a block of values of each as float64.
struct Buffers {
  std::vector<char> a, b;
  std::vector<double> values_a, values_b;
  std::vector<float> scratch;
  explicit Buffers(uint64_t chunk_bytes)
      : a(chunk_bytes), b(chunk_bytes), values_a(kBlockValues), values_b(kBlockValues), scratch(kBlockValues) {}
};

bool IsComplex(DType t) { return diff::ValueType(t) != t; }

// The pairs whose values are read (same shape, both complex or neither), by index.
bool ValuesCompared(const PairDiff& p) {
  return p.shape_a == p.shape_b && IsComplex(p.dtype_a) == IsComplex(p.dtype_b);
}

class Comparison {
 public:
  Comparison(const View& a, const View& b, const DiffOptions& options,
             const std::function<void(uint64_t, uint64_t)>& progress, DiffResult* result)
      : a_(a), b_(b), options_(options), progress_(progress), result_(result), states_(result->pairs.size()) {}

  // Pass 1 compares every pair; pass 2 sums ||A||^2 again, whole, for pairs that had both
  // identical and differing chunks (identical chunks skip the arithmetic).
  Status Run(DiffSide* failed) {
    std::vector<size_t> pass1;
    for (size_t p = 0; p < result_->pairs.size(); ++p)
      if (ValuesCompared(result_->pairs[p])) pass1.push_back(p);
    CKPTFS_RETURN_IF_ERROR(RunPass(pass1, /*norm_only=*/false, failed));
    std::vector<size_t> pass2;
    for (size_t p : pass1)
      if (states_[p].bytes_differ && states_[p].some_identical) {
        states_[p].stats.sumsq_a = 0;
        states_[p].chunks_merged = 0;
        pass2.push_back(p);
      }
    if (!pass2.empty()) CKPTFS_RETURN_IF_ERROR(RunPass(pass2, /*norm_only=*/true, failed));
    for (size_t p : pass1) Finish(p);
    return Status::OK();
  }

 private:
  uint64_t ChunkElements(const PairDiff& p) const {
    const uint64_t widest = std::max(Info(p.dtype_a).itemsize, Info(p.dtype_b).itemsize);
    return std::max<uint64_t>(1, options_.chunk_bytes / widest);
  }

  Status RunPass(const std::vector<size_t>& pairs, bool norm_only, DiffSide* failed) {
    pairs_ = &pairs;
    norm_only_ = norm_only;
    cursor_pair_ = 0;
    cursor_element_ = 0;
    stop_ = false;
    for (size_t p : pairs) {
      const PairDiff& d = result_->pairs[p];
      total_ += a_.served()[d.index_a].nbytes() + (norm_only ? 0 : b_.served()[d.index_b].nbytes());
    }
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const size_t workers = options_.threads ? std::min(options_.threads, kMaxThreads) : std::min(cores, kDefaultMaxThreads);
    RunOnWorkers(workers, [this](size_t) { Work(); });
    if (!error_.ok() && failed) *failed = error_side_;
    return error_;
  }

  // The next chunk to compare, or false when none is left.
  bool Next(Item* item) {
    std::lock_guard<std::mutex> lock(cursor_mutex_);
    while (!stop_ && cursor_pair_ < pairs_->size()) {
      const size_t p = (*pairs_)[cursor_pair_];
      const uint64_t numel = result_->pairs[p].elements;
      if (cursor_element_ >= numel) {
        ++cursor_pair_;
        cursor_element_ = 0;
        continue;
      }
      item->pair = p;
      item->first = cursor_element_;
      item->count = std::min(ChunkElements(result_->pairs[p]), numel - cursor_element_);
      cursor_element_ += item->count;
      return true;
    }
    return false;
  }

  void Work() {
    Buffers buffers(std::max<uint64_t>(options_.chunk_bytes, 16));
    Item item;
    while (Next(&item)) {
      PairState local;
      DiffSide side = DiffSide::kNone;
      Status s = Compare(item, &buffers, &local, &side);
      std::lock_guard<std::mutex> lock(merge_mutex_);
      if (!s.ok()) {
        if (error_.ok()) {
          error_ = s;
          error_side_ = side;
        }
        std::lock_guard<std::mutex> stop_lock(cursor_mutex_);
        stop_ = true;
        return;
      }
      const PairDiff& d = result_->pairs[item.pair];
      Merge(item, local, &states_[item.pair]);
      done_ += item.count * Info(d.dtype_a).itemsize + (norm_only_ ? 0 : item.count * Info(d.dtype_b).itemsize);
      if (progress_) progress_(done_, total_);
    }
  }

  // Adds one chunk's figures to its pair's (under merge_mutex_).
  void Merge(const Item& item, const PairState& local, PairState* state) const {
    const PairDiff& d = result_->pairs[item.pair];
    const uint64_t per_chunk = ChunkElements(d);
    const uint64_t chunks = (d.elements + per_chunk - 1) / per_chunk;
    diff::ValueStats figures = local.stats;
    state->bytes_differ |= local.bytes_differ;
    state->some_identical |= local.some_identical;
    if (chunks > 1) {
      if (state->chunk_sums.empty()) state->chunk_sums.assign(chunks, {0.0, 0.0});
      state->chunk_sums[item.first / per_chunk] = {figures.sumsq_a, figures.sumsq_diff};
      figures.sumsq_a = figures.sumsq_diff = 0;
      if (++state->chunks_merged == chunks) {
        for (const auto& [sumsq_a, sumsq_diff] : state->chunk_sums) {
          figures.sumsq_a += sumsq_a;
          figures.sumsq_diff += sumsq_diff;
        }
        std::vector<std::pair<double, double>>().swap(state->chunk_sums);
      }
    }
    state->stats.Merge(figures);
  }

  // Reads the chunk `item` of both sides (A only in pass 2) and adds it to *state.
  Status Compare(const Item& item, Buffers* buf, PairState* state, DiffSide* side) const {
    const PairDiff& d = result_->pairs[item.pair];
    const size_t size_a = Info(d.dtype_a).itemsize, size_b = Info(d.dtype_b).itemsize;
    // Within the tensor's nbytes, which its catalog checked to fit in 64 bits.
    const uint64_t bytes_a = item.count * size_a, bytes_b = item.count * size_b;
    *side = DiffSide::kA;
    CKPTFS_RETURN_IF_ERROR(a_.ReadTensorData(d.index_a, item.first * size_a, bytes_a, buf->a.data()));
    if (!norm_only_) {
      *side = DiffSide::kB;
      CKPTFS_RETURN_IF_ERROR(b_.ReadTensorData(d.index_b, item.first * size_b, bytes_b, buf->b.data()));
      if (d.dtype_a == d.dtype_b && std::memcmp(buf->a.data(), buf->b.data(), bytes_a) == 0) {
        state->some_identical = true;
        return Status::OK();
      }
      state->bytes_differ = true;
    }
    const DType value_a = diff::ValueType(d.dtype_a), value_b = diff::ValueType(d.dtype_b);
    const size_t value_size_a = Info(value_a).itemsize, value_size_b = Info(value_b).itemsize;
    const uint64_t values = bytes_a / value_size_a;
    for (uint64_t v = 0; v < values; v += kBlockValues) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kBlockValues, values - v));
      diff::DecodeToDouble(value_a, buf->a.data() + v * value_size_a, n, buf->values_a.data(), buf->scratch.data());
      if (norm_only_) {
        diff::AddSquares(buf->values_a.data(), n, &state->stats);
        continue;
      }
      diff::DecodeToDouble(value_b, buf->b.data() + v * value_size_b, n, buf->values_b.data(), buf->scratch.data());
      diff::AddValuePairs(buf->values_a.data(), buf->values_b.data(), n, options_.atol, options_.rtol,
                          &state->stats);
    }
    return Status::OK();
  }

  void Finish(size_t p) {
    PairDiff& d = result_->pairs[p];
    const PairState& state = states_[p];
    d.differing = state.stats.differing;
    d.max_abs = state.stats.max_abs;
    d.max_rel = state.stats.max_rel;
    d.norm_a = std::sqrt(state.stats.sumsq_a);
    d.norm_diff = std::sqrt(state.stats.sumsq_diff);
    if (!state.bytes_differ && d.dtype_a == d.dtype_b) {
      d.verdict = PairVerdict::kIdentical;
      d.norm_a = 0;  // not summed: identical chunks skip the arithmetic
    } else {
      d.verdict = d.differing == 0 ? PairVerdict::kEqual : PairVerdict::kDifferent;
    }
  }

  const View& a_;
  const View& b_;
  const DiffOptions& options_;
  const std::function<void(uint64_t, uint64_t)>& progress_;
  DiffResult* result_;
  std::vector<PairState> states_;

  const std::vector<size_t>* pairs_ = nullptr;
  bool norm_only_ = false;
  std::mutex cursor_mutex_;  // the cursor and stop_
  size_t cursor_pair_ = 0;
  uint64_t cursor_element_ = 0;
  bool stop_ = false;
  std::mutex merge_mutex_;  // states_, progress, the first error
  uint64_t done_ = 0, total_ = 0;
  Status error_;
  DiffSide error_side_ = DiffSide::kNone;
};

}  // namespace

std::string_view VerdictName(PairVerdict verdict) {
  switch (verdict) {
    case PairVerdict::kIdentical: return "identical";
    case PairVerdict::kEqual: return "equal";
    case PairVerdict::kDifferent: return "different";
    case PairVerdict::kShape: return "shape";
    case PairVerdict::kIncomparable: return "incomparable";
  }
  return "different";
}

double PairDiff::rel_l2() const {
  if (norm_diff == 0) return 0;
  if (norm_a == 0) return std::numeric_limits<double>::infinity();
  return norm_diff / norm_a;
}

bool DiffResult::equal() const {
  if (!only_a.empty() || !only_b.empty()) return false;
  return std::all_of(pairs.begin(), pairs.end(), [](const PairDiff& p) { return p.equal(); });
}

Status CompareViews(const View& a, const View& b, const DiffOptions& options,
                    const std::function<void(uint64_t, uint64_t)>& progress, DiffResult* out, DiffSide* failed) {
  if (failed) *failed = DiffSide::kNone;
  if (!(options.atol >= 0) || !(options.rtol >= 0))
    return Status::InvalidArgument("diff", "atol and rtol must be numbers >= 0");
  DiffResult result;
  result.source_a = a.source().source;
  result.source_b = b.source().source;
  result.atol = options.atol;
  result.rtol = options.rtol;
  const ServedTensors& ta = a.served();
  const ServedTensors& tb = b.served();
  result.tensors_a = ta.size();
  result.tensors_b = tb.size();
  std::unordered_map<std::string_view, size_t> in_b;
  in_b.reserve(tb.size());
  for (size_t j = 0; j < tb.size(); ++j) in_b.emplace(tb[j].key(), j);
  std::vector<bool> matched(tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    auto it = in_b.find(ta[i].key());
    if (it == in_b.end()) {
      result.only_a.emplace_back(ta[i].key());
      continue;
    }
    matched[it->second] = true;
    PairDiff p;
    p.key = ta[i].key();
    p.index_a = i;
    p.index_b = it->second;
    p.dtype_a = ta[i].dtype;
    p.dtype_b = tb[it->second].dtype;
    p.shape_a = ta[i].shape();
    p.shape_b = tb[it->second].shape();
    if (p.shape_a != p.shape_b) {
      p.verdict = PairVerdict::kShape;
    } else if (IsComplex(p.dtype_a) != IsComplex(p.dtype_b)) {
      p.verdict = PairVerdict::kIncomparable;
    } else {
      p.elements = ta[i].numel();
      const uint64_t per_element = Info(p.dtype_a).itemsize / Info(diff::ValueType(p.dtype_a)).itemsize;
      if (!CheckedMul(p.elements, per_element, &p.numel))
        return Status::Corruption(p.key, "element count overflows");
    }
    result.pairs.push_back(std::move(p));
  }
  for (size_t j = 0; j < tb.size(); ++j)
    if (!matched[j]) result.only_b.emplace_back(tb[j].key());

  // The buffers are the only allocations that grow with the options (threads, chunk size):
  // their failure is an error of this call, not of the process.
  try {
    Comparison comparison(a, b, options, progress, &result);
    CKPTFS_RETURN_IF_ERROR(comparison.Run(failed));
  } catch (const std::bad_alloc&) {
    return Status::FromErrno("diff", "cannot allocate its buffers", ENOMEM);
  }
  *out = std::move(result);
  return Status::OK();
}

}  // namespace ckptfs
