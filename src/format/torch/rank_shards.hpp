// Consolidating the rank files of one distributed save: torch.save files written one per rank
// (FSDP2 `model.state_dict()` / `optimizer.state_dict()` of DTensors, FSDP1
// SHARDED_STATE_DICT of ShardedTensors) become one catalog of full tensors, each a list of
// boxes over the rank files' local shards. Nothing is copied: a full tensor is read from the
// rank files' bytes where they lie. Rules and the pickled forms: doc/FORMATS.md, "DTensor and
// ShardedTensor rank files".
//
// Readers of framework folders (veRL's model_/optim_world_size_W_rank_R.pt, ...) call
// ConsolidateRankFiles once per set of files they know to be one save; the set is always
// given explicitly, in rank order: nothing here guesses which files belong together.
#ifndef CKPTFS_FORMAT_TORCH_RANK_SHARDS_HPP_
#define CKPTFS_FORMAT_TORCH_RANK_SHARDS_HPP_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/catalog.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// The rank files of one save.
struct RankFileSet {
  // files[r] is the file rank r wrote (a path the Env of catalog->files opens): every rank
  // of the save, in rank order. The world size is files.size(); a save whose DTensor meshes
  // or ShardedTensor process groups say otherwise is refused, naming what is missing.
  std::vector<std::string> files;
  // Put before the path of every tensor of the set (e.g. {"optimizer"}); may be empty.
  std::vector<PathElement> prefix;
  // Called with the path of each tensor the set serves (prefix included), in order: returns
  // false to leave the tensor out, and may rewrite the path (a rename). Unset: every tensor,
  // under its own path.
  std::function<bool(std::vector<PathElement>* path)> select;
};

// What ConsolidateRankFiles found, for metadata.json and `ckptfs info`.
struct RankSetSummary {
  uint64_t world_size = 0;
  // DTensors and ShardedTensors assembled from the ranks' shards.
  uint64_t distributed_tensors = 0;
  // Tensors that are not distributed (an optimizer's `step`): every rank holds one of the
  // same dtype and shape, and rank 0's is served.
  uint64_t plain_tensors = 0;
  // "dtensor", "sharded_tensor", both joined by "+", or "" when none was met.
  std::string kinds;
  // The mesh shape of the DTensors (of the first one: they may differ per tensor).
  std::vector<uint64_t> mesh_shape;
  nlohmann::json ToJson() const;
};

// Reads every file of `set` (each a torch.save zip) and appends to catalog->tensors, in the
// order of rank 0's file, one full tensor per DTensor / ShardedTensor key, whose boxes are the
// ranks' local shards at their offsets (Shard(d) along any dimension and mesh dimension,
// Replicate served from the lowest coordinate only, uneven and empty last shards), and one
// tensor per plain tensor (rank 0's). Checks what torch.distributed.checkpoint checks: every
// rank holds the same keys with the same dtype, global shape and placements, the shards tile
// the tensor with no hole and no overlap, every rank of the mesh / process group has its
// file. Refuses Partial and _StridedShard placements (their shards are not boxes of the
// tensor) and plain tensors that view a local shard (FSDP1 LOCAL_STATE_DICT's flat-parameter
// views). `*metadata` gets rank 0's non-tensor values (a JSON tree, tensors left out, without
// the prefix). Every error is one line naming a rank file and, where one tensor is at fault,
// its key.
Status ConsolidateRankFiles(const RankFileSet& set, const ReadLimits& limits, Catalog* catalog,
                            nlohmann::json* metadata, RankSetSummary* summary = nullptr);

// A file name that carries a rank number: "<before>rank<sep><R><after>" where <sep> is
// "", "_" or "-" ("model_world_size_2_rank_0.pt", "rank1.pt", "shard-rank-3.bin"), with the
// world size when the name says it ("world_size_<W>", "ws<W>", "_of_<W>").
struct RankFileName {
  // The name with the rank number replaced by "{rank}": files of one set share it.
  std::string group;
  uint64_t rank = 0;
  std::optional<uint64_t> world_size;
};
// False when `name` has no rank number (or more than one "rank" followed by digits).
bool ParseRankFileName(std::string_view name, RankFileName* out);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_TORCH_RANK_SHARDS_HPP_
