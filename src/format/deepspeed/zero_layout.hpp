// The extent arithmetic of DeepSpeed ZeRO checkpoints, apart from any file: given the
// parameter shapes, the data-parallel world size and every rank's flat partitions (as
// tensors whose boxes say where their elements are stored), the boxes of each consolidated
// parameter, in the order zero_to_fp32 concatenates them. The reader (zero.cpp) fills these
// structures from the pickles; the unit tests fill them by hand.
// Rules: doc/FORMATS.md, "DeepSpeed stage 1/2 layout", "DeepSpeed stage 3 layout",
// "DeepSpeed Adam moments".
#ifndef CKPTFS_FORMAT_DEEPSPEED_ZERO_LAYOUT_HPP_
#define CKPTFS_FORMAT_DEEPSPEED_ZERO_LAYOUT_HPP_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// param_shapes: per optimizer group (stage 3: per sub-group), (name, shape) in flat-buffer order.
using ZeroParamShapes = std::vector<std::vector<std::pair<std::string, std::vector<uint64_t>>>>;

// One data-parallel rank's flat tensors: its fp32 partitions, or an Adam moment laid out
// like them.
struct ZeroRankFlats {
  std::string path;                 // the rank's optimizer file: errors name it
  std::vector<TensorEntry> groups;  // one flat 1-D tensor per group (stage 3: per sub-group)
};

// How the trainable parameters of one model-parallel rank are laid out in its ranks' flat
// partitions.
struct ZeroLayout {
  int stage = 0;       // 1, 2, 3; -1 for the BF16_Optimizer (laid out as stage 1/2)
  uint64_t world = 0;  // data-parallel ranks
  ZeroParamShapes shapes;
  // Stage 1/2 parameter_alignment: align_pads[g][i] elements of padding follow parameter i
  // of group g (param_alignment_paddings); groups or parameters past its end have none.
  std::vector<std::vector<uint64_t>> align_pads;
  // Filled by CheckZeroPartitions. Stage 1/2: lengths[g][r], rank r's saved share of group
  // g (the fp32 partitions'; moments keep their padding, so their own lengths would be
  // wrong). Stage 3: lengths[j][r], sub-group j's size, the same on every rank.
  std::vector<std::vector<uint64_t>> lengths;
};

// Elements in `shape` (1 for a scalar). Only for shapes ZeroShapeFits accepted.
uint64_t ZeroNumel(const std::vector<uint64_t>& shape);

// Whether a shape's byte size fits in 64 bits at 8 bytes an element (the widest ZeRO
// dtype). ZeroNumel wraps otherwise, and a wrapped count can equal the flat partition's
// length exactly, which would serve bytes that do not match the shape: such shapes are
// refused where they are read.
bool ZeroShapeFits(const std::vector<uint64_t>& shape);

// Stage 3 cuts a parameter of n elements into `world` chunks of ceil(n / world); the
// first min(P, n - r·P) elements of rank r's chunk are real, the rest padding.
uint64_t ZeroChunkElements(uint64_t n, uint64_t world);
uint64_t ZeroRealChunkElements(uint64_t n, uint64_t world, uint64_t rank);

// Appends elements [start, start + count) of the contiguous 1-D tensor `flat` to `target`'s
// rank-1 boxes, where its last box ends (adjacent byte ranges of one file merge into one
// box). Errors name `where`.
Status SliceBoxes(const TensorEntry& flat, const std::string& where, uint64_t start, uint64_t count,
                  TensorEntry* target);

// Checks the ranks' fp32 partitions agree with `layout` (stage 1/2: as many groups as
// param_shapes; stage 3: each sub-group the same size on every rank) and records their
// lengths in layout->lengths. `fp32` holds layout->world ranks with the same group count.
Status CheckZeroPartitions(const std::vector<ZeroRankFlats>& fp32, ZeroLayout* layout);

// The boxes of every trainable parameter, in param_shapes order, in per-rank flat tensors
// laid out like the fp32 partitions that CheckZeroPartitions measured (the partitions
// themselves, or an Adam moment). Each entry's key is the bare parameter name, its dtype
// the flat tensors'. `flats` holds layout.world ranks, each with layout.lengths.size() groups.
Status WalkZeroTrainable(const ZeroLayout& layout, const std::vector<ZeroRankFlats>& flats,
                         std::vector<TensorEntry>* out);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_DEEPSPEED_ZERO_LAYOUT_HPP_
