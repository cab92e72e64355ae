#include "format/megatron/megatron_fragments.hpp"

#include <algorithm>

#include "io/checked_math.hpp"

namespace ckptfs {

bool PlanMegatronReformulation(std::span<const uint64_t> real, std::span<const uint64_t> reformulated,
                               MegatronReformulation* out, std::string* why) {
  const size_t n_dims = real.size();
  if (n_dims == 0) {
    *why = "its real shape has no dimensions, and a flattened fragment needs at least one";
    return false;
  }
  if (reformulated.size() != n_dims + 1) {
    *why = "its real shape has " + std::to_string(n_dims) + " dimensions, so the reformulated shape should have " +
           std::to_string(n_dims + 1) + ", not " + std::to_string(reformulated.size());
    return false;
  }
  MegatronReformulation plan;
  plan.real.assign(real.begin(), real.end());
  plan.grid.assign(reformulated.begin(), reformulated.begin() + n_dims);
  plan.chunk.resize(n_dims);
  uint64_t numel = 1;
  for (size_t d = 0; d < n_dims; ++d) {
    if (plan.grid[d] == 0 || real[d] % plan.grid[d] != 0) {
      *why = "dimension " + std::to_string(d) + " of the real shape (" + std::to_string(real[d]) +
             ") is not split into " + std::to_string(plan.grid[d]) + " equal chunks";
      return false;
    }
    plan.chunk[d] = real[d] / plan.grid[d];
    if (!CheckedMul(numel, plan.chunk[d], &numel)) {
      *why = "its chunk size overflows";
      return false;
    }
  }
  plan.chunk_numel = reformulated[n_dims];
  if (numel != plan.chunk_numel) {
    *why = "a chunk of the real shape holds " + std::to_string(numel) + " elements but the reformulated shape gives " +
           std::to_string(plan.chunk_numel);
    return false;
  }
  // The last dimension split into several chunks must not come after the first one whose
  // chunk extent is over 1 (the proof is in doc/FORMATS.md).
  size_t last_split = 0, first_partial = n_dims;
  bool any_split = false;
  for (size_t d = 0; d < n_dims; ++d) {
    if (plan.grid[d] > 1) last_split = d, any_split = true;
    if (plan.chunk[d] > 1 && first_partial == n_dims) first_partial = d;
  }
  plan.row_major = !any_split || first_partial == n_dims || last_split <= first_partial;
  *out = std::move(plan);
  return true;
}

bool PlaceMegatronFragment(const MegatronReformulation& plan, std::span<const uint64_t> offsets,
                           std::span<const uint64_t> sizes, uint32_t file, uint64_t base, uint64_t itemsize,
                           BoxList* out, std::string* why) {
  const size_t n_dims = plan.real.size();
  if (offsets.size() != n_dims + 1 || sizes.size() != n_dims + 1) {
    *why = "a fragment's rank differs from the reformulated shape's";
    return false;
  }
  for (size_t d = 0; d < n_dims; ++d) {
    if (sizes[d] != 1) {
      *why = "a fragment spans " + std::to_string(sizes[d]) + " chunks along dimension " + std::to_string(d) +
             " (each Megatron fragment lies in one chunk)";
      return false;
    }
    if (offsets[d] >= plan.grid[d]) {
      *why = "a fragment lies outside the chunk grid along dimension " + std::to_string(d);
      return false;
    }
  }
  const uint64_t start = offsets[n_dims], length = sizes[n_dims];
  uint64_t end, bytes, last_byte;
  if (!CheckedAdd(start, length, &end) || end > plan.chunk_numel || !CheckedMul(length, itemsize, &bytes) ||
      !CheckedAdd(base, bytes, &last_byte)) {
    *why = "a fragment lies outside its chunk";
    return false;
  }
  if (length == 0) return true;

  if (plan.row_major) {
    // The fragment's place in the reformulated tensor's row-major order is its place in the
    // real tensor's.
    uint64_t chunk_index = 0, first;
    for (size_t d = 0; d < n_dims; ++d)
      if (!CheckedMul(chunk_index, plan.grid[d], &chunk_index) || !CheckedAdd(chunk_index, offsets[d], &chunk_index)) {
        *why = "a fragment's position overflows";
        return false;
      }
    if (!CheckedMul(chunk_index, plan.chunk_numel, &first) || !CheckedAdd(first, start, &first)) {
      *why = "a fragment's position overflows";
      return false;
    }
    out->push_back(Box::Range(file, base, first, length));
    return true;
  }

  // Row-major strides of one chunk; they fit because their product, the chunk's element
  // count, was computed with checks.
  BoxDims strides;
  strides.resize(n_dims);
  uint64_t step = 1;
  for (size_t d = n_dims; d-- > 0;) {
    strides[d] = step;
    step *= plan.chunk[d];
  }
  // Elements [start, end) of the chunk's row-major order as boxes: from the current
  // element, the outermost dimension k at whose boundary it lies gives a box of m whole
  // (k+1..N-1) blocks along k.
  uint64_t at = start;
  while (at < end) {
    for (size_t k = 0; k < n_dims; ++k) {
      if (at % strides[k] != 0) continue;
      const uint64_t index_k = (at / strides[k]) % plan.chunk[k];
      const uint64_t m = std::min(plan.chunk[k] - index_k, (end - at) / strides[k]);
      if (m == 0) continue;
      Box box;
      box.file = file;
      box.base_offset = base + (at - start) * itemsize;
      box.offset.resize(n_dims);
      box.extent.resize(n_dims);
      for (size_t d = 0; d < n_dims; ++d) {
        // Inside the real shape: offsets[d] < grid[d], so offsets[d] * chunk[d] + index <
        // real[d].
        box.offset[d] = offsets[d] * plan.chunk[d] + (at / strides[d]) % plan.chunk[d];
        box.extent[d] = d < k ? 1 : d == k ? m : plan.chunk[d];
      }
      box.strides = strides;
      out->push_back(std::move(box));
      at += m * strides[k];
      break;
    }
  }
  return true;
}

}  // namespace ckptfs
