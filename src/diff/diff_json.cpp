// DiffToJson: the diff as data, for `ckptfs diff --json` and ckptfs_diff.
#include <cmath>
#include <string>

#include "ckptfs/diff.hpp"

namespace ckptfs {
namespace {

// JSON has no infinity: an infinite figure is written as null (doc/CLI.md says so).
nlohmann::json Number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

nlohmann::json ShapeJson(const Shape& shape) {
  nlohmann::json out = nlohmann::json::array();
  for (uint64_t d : shape) out.push_back(d);
  return out;
}

}  // namespace

nlohmann::json DiffToJson(const DiffResult& result) {
  nlohmann::json counts = {{"identical", 0}, {"equal", 0}, {"different", 0}, {"shape", 0}, {"incomparable", 0}};
  nlohmann::json pairs = nlohmann::json::array();
  for (const PairDiff& p : result.pairs) {
    const std::string verdict(VerdictName(p.verdict));
    counts[verdict] = counts[verdict].get<uint64_t>() + 1;
    nlohmann::json entry = {{"key", p.key},
                            {"status", verdict},
                            {"dtype_a", std::string(Info(p.dtype_a).torch_name)},
                            {"dtype_b", std::string(Info(p.dtype_b).torch_name)},
                            {"shape_a", ShapeJson(p.shape_a)},
                            {"shape_b", ShapeJson(p.shape_b)}};
    if (p.verdict != PairVerdict::kShape && p.verdict != PairVerdict::kIncomparable) {
      entry["numel"] = p.numel;
      entry["differing"] = p.differing;
      entry["max_abs"] = Number(p.max_abs);
      entry["max_rel"] = Number(p.max_rel);
      entry["rel_l2"] = Number(p.rel_l2());
      if (p.verdict != PairVerdict::kIdentical) {
        entry["norm_a"] = Number(p.norm_a);
        entry["norm_diff"] = Number(p.norm_diff);
      }
    }
    pairs.push_back(std::move(entry));
  }
  counts["only_in_a"] = result.only_a.size();
  counts["only_in_b"] = result.only_b.size();
  return {{"equal", result.equal()},
          {"a", {{"source", result.source_a}, {"tensors", result.tensors_a}}},
          {"b", {{"source", result.source_b}, {"tensors", result.tensors_b}}},
          {"atol", result.atol},
          {"rtol", result.rtol},
          {"counts", std::move(counts)},
          {"only_in_a", result.only_a},
          {"only_in_b", result.only_b},
          {"tensors", std::move(pairs)}};
}

}  // namespace ckptfs
