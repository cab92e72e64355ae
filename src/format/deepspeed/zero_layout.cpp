// The extent arithmetic of DeepSpeed ZeRO checkpoints (format/deepspeed/zero_layout.hpp): which byte
// ranges of the ranks' flat partitions make up each consolidated parameter.
// Rules: doc/FORMATS.md, "DeepSpeed stage 1/2 layout" and "DeepSpeed stage 3 layout".
#include "format/deepspeed/zero_layout.hpp"

#include <algorithm>

#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

// Stage 3: each parameter contributes ceil(n/W) elements to every rank's sub-groups, which
// concatenate into one rank-local address space; rank r's chunk of a parameter at offset O
// holds its real elements first.
Status WalkStage3(const ZeroLayout& layout, const std::vector<ZeroRankFlats>& flats, std::vector<TensorEntry>* out) {
  const uint64_t world = layout.world;
  // bounds[j]: where sub-group j starts in the rank-local space. Sums of the lengths of
  // tensors already checked against their files: they cannot wrap.
  std::vector<uint64_t> bounds = {0};
  for (const auto& len : layout.lengths) bounds.push_back(bounds.back() + len[0]);
  uint64_t offset = 0;
  for (const auto& group : layout.shapes)
    for (const auto& [name, shape] : group) {
      TensorEntry t;
      t.key = name;
      t.shape = shape;
      t.dtype = flats[0].groups.empty() ? DType::kF32 : flats[0].groups[0].dtype;
      const uint64_t n = ZeroNumel(shape);
      for (uint64_t r = 0; r < world; ++r) {
        uint64_t len = ZeroRealChunkElements(n, world, r);
        // DeepSpeed closes a sub-group only between parameters, so a chunk never straddles
        // two; split it at the boundary if one does rather than assume it.
        for (uint64_t at = offset; len > 0;) {
          const size_t j = std::upper_bound(bounds.begin(), bounds.end(), at) - bounds.begin() - 1;
          if (j >= flats[r].groups.size())
            return Status::Corruption(flats[r].path, "parameters run past the flat groups");
          const uint64_t take = std::min(len, bounds[j + 1] - at);
          CKPTFS_RETURN_IF_ERROR(SliceBoxes(flats[r].groups[j], flats[r].path, at - bounds[j], take, &t));
          at += take;
          len -= take;
        }
      }
      // Bounded by the sub-groups: a parameter with elements past them was refused above.
      offset += ZeroChunkElements(n, world);
      out->push_back(std::move(t));
    }
  if (offset != bounds.back())
    return Status::Corruption(flats[0].path, "parameters use " + std::to_string(offset) +
                                                 " elements per rank but the flat groups hold " +
                                                 std::to_string(bounds.back()));
  return Status::OK();
}

// Stage 1/2 and the BF16_Optimizer: per group, the ranks' saved partitions concatenate, in
// rank order, to the group's flat vector, in which the parameters follow each other (with
// their alignment pads).
Status WalkStage12(const ZeroLayout& layout, const std::vector<ZeroRankFlats>& flats, std::vector<TensorEntry>* out) {
  const uint64_t world = layout.world;
  const std::string& rank0 = flats[0].path;
  for (size_t g = 0; g < layout.shapes.size(); ++g) {
    // starts[r] (C_r): where rank r's share starts in the group; sums of checked tensors' lengths.
    std::vector<uint64_t> starts = {0};
    for (uint64_t r = 0; r < world; ++r) starts.push_back(starts.back() + layout.lengths[g][r]);
    const std::vector<uint64_t> no_pads;
    const auto& pads = g < layout.align_pads.size() ? layout.align_pads[g] : no_pads;
    uint64_t a = 0;  // the parameter's offset in the group's flat vector
    const auto& params = layout.shapes[g];
    for (size_t i = 0; i < params.size(); ++i) {
      TensorEntry t;
      t.key = params[i].first;
      t.shape = params[i].second;
      t.dtype = flats[0].groups[g].dtype;
      const uint64_t n = ZeroNumel(t.shape);
      uint64_t end = 0;
      if (!CheckedAdd(a, n, &end) || end > starts[world])
        return Status::Corruption(rank0, "parameter '" + t.key + "' runs past the end of the flat partitions");
      for (uint64_t r = 0; r < world; ++r) {
        const uint64_t lo = std::max(a, starts[r]), hi = std::min(end, starts[r + 1]);
        if (lo < hi)
          CKPTFS_RETURN_IF_ERROR(SliceBoxes(flats[r].groups[g], flats[r].path, lo - starts[r], hi - lo, &t));
      }
      // The pad is read from the file: refuse one that would wrap the offset.
      if (!CheckedAdd(end, i < pads.size() ? pads[i] : 0, &a))
        return Status::Corruption(rank0, "the alignment padding after parameter '" + t.key + "' overflows");
      out->push_back(std::move(t));
    }
    // zero_to_fp32's check: both totals agree once rounded up to the 2·W alignment (the
    // saved partitions lack the group's trailing padding). BF16_Optimizer partitions keep
    // it, so the parameters need only fit.
    const uint64_t align = 2 * world;
    auto round_up = [align](uint64_t x) { return x / align * align + (x % align ? align : 0); };
    if (layout.stage < 0 ? a > starts[world] : round_up(a) != round_up(starts[world]))
      return Status::Corruption(rank0, "group " + std::to_string(g) + ": parameters use " + std::to_string(a) +
                                           " elements but the partitions hold " + std::to_string(starts[world]));
  }
  return Status::OK();
}

}  // namespace

uint64_t ZeroNumel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

bool ZeroShapeFits(const std::vector<uint64_t>& shape) {
  uint64_t n = 8;
  for (uint64_t d : shape)
    if (!CheckedMul(n, d, &n)) return false;
  return true;
}

uint64_t ZeroChunkElements(uint64_t n, uint64_t world) { return n / world + (n % world ? 1 : 0); }

uint64_t ZeroRealChunkElements(uint64_t n, uint64_t world, uint64_t rank) {
  const uint64_t per_rank = ZeroChunkElements(n, world);
  // rank < world, so rank·P < n + world: no wrap.
  return std::min(per_rank, n > rank * per_rank ? n - rank * per_rank : 0);
}

Status SliceBoxes(const TensorEntry& flat, const std::string& where, uint64_t start, uint64_t count,
                  TensorEntry* target) {
  if (count == 0) return Status::OK();
  uint64_t end = 0;
  if (!StoredAsExtents(flat) || !CheckedAdd(start, count, &end) || end > flat.numel())
    return Status::Corruption(where, "a flat partition is shorter than its parameters need");
  if (flat.dtype != target->dtype) return Status::Corruption(where, "a flat partition's dtype differs from its parameter's");
  const uint64_t itemsize = Info(flat.dtype).itemsize;
  BoxList& out = target->boxes;
  uint64_t skip = start * itemsize, want = count * itemsize;
  for (const Extent& e : ExtentsOf(flat)) {
    if (skip >= e.length) {
      skip -= e.length;
      continue;
    }
    const uint64_t take = std::min(e.length - skip, want);
    Box* last = out.empty() ? nullptr : &out.back();
    if (last && last->file == e.file && last->base_offset + last->extent[0] * itemsize == e.offset + skip)
      last->extent[0] += take / itemsize;  // adjacent ranges of one file merge into one read
    else
      out.push_back(Box::Range(e.file, e.offset + skip, last ? last->offset[0] + last->extent[0] : 0, take / itemsize));
    want -= take;
    skip = 0;
    if (want == 0) break;
  }
  return Status::OK();
}

Status CheckZeroPartitions(const std::vector<ZeroRankFlats>& fp32, ZeroLayout* layout) {
  const size_t groups = fp32[0].groups.size();
  if (layout->stage != 3 && layout->shapes.size() != groups)
    return Status::Corruption(fp32[0].path, "holds " + std::to_string(groups) + " parameter groups but param_shapes lists " +
                                                std::to_string(layout->shapes.size()));
  layout->lengths.assign(groups, {});
  for (size_t g = 0; g < groups; ++g) {
    for (uint64_t r = 0; r < layout->world; ++r) {
      if (layout->stage == 3 && fp32[r].groups[g].numel() != fp32[0].groups[g].numel())
        return Status::Corruption(fp32[r].path, "sub-group " + std::to_string(g) + " differs in size from rank 0's");
      layout->lengths[g].push_back(fp32[r].groups[g].numel());
    }
  }
  return Status::OK();
}

Status WalkZeroTrainable(const ZeroLayout& layout, const std::vector<ZeroRankFlats>& flats,
                         std::vector<TensorEntry>* out) {
  return layout.stage == 3 ? WalkStage3(layout, flats, out) : WalkStage12(layout, flats, out);
}

}  // namespace ckptfs
