// Recognising torch.distributed's sharded tensors in a torch pickle, without running anything:
// a DTensor (torch.distributed.tensor, FSDP2's state dicts) and a ShardedTensor
// (torch.distributed._shard, FSDP1's SHARDED_STATE_DICT and LOCAL_STATE_DICT). Both pickle as
// _rebuild_from_type_v2(_rebuild_wrapper_subclass, <class>, <wrapper args>, <state>): the
// wrapper args give the global dtype and shape, the state the rank's local tensor(s) and
// where they lie in the global tensor. doc/FORMATS.md, "DTensor and ShardedTensor rank files".
#ifndef CKPTFS_FORMAT_TORCH_TORCH_DISTRIBUTED_HPP_
#define CKPTFS_FORMAT_TORCH_TORCH_DISTRIBUTED_HPP_

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/catalog.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/status.hpp"
#include "codec/pickle.hpp"

namespace ckptfs {

class StorageResolver;

// One DTensor placement, per mesh dimension.
struct Placement {
  enum class Kind { kShard, kReplicate, kPartial, kStridedShard };
  Kind kind = Kind::kReplicate;
  uint64_t dim = 0;           // kShard, kStridedShard
  uint64_t split_factor = 0;  // kStridedShard
  std::string reduce_op;      // kPartial
  std::string Describe() const;  // "Shard(0)", "Replicate()", "Partial(sum)", "_StridedShard(0, 2)"
};

// A local shard: a tensor of the rank's file that is the block [offsets, offsets + shape) of
// the global tensor.
struct LocalShard {
  BoxDims offsets;
  TensorEntry tensor;  // dtype, shape (the block's extent), boxes in the rank file
  // The pickled local tensor, while the pickle lives (the walker names it by this).
  const PyValue* value = nullptr;
};

struct DistributedTensor {
  enum class Kind { kDTensor, kShardedTensor };
  Kind kind = Kind::kDTensor;
  DType dtype = DType::kF32;
  Shape shape;  // global
  std::vector<LocalShard> local;
  // The rank that wrote the file, as the tensor records it (DTensor: the mesh's `_rank`;
  // ShardedTensor: the process group's global rank; -1 when not recorded); world_size
  // likewise (the mesh's size, the process group's).
  int64_t rank = -1;
  uint64_t world_size = 0;

  // DTensor: the placements per mesh dimension, the mesh's shape and this rank's coordinate.
  std::vector<Placement> placements;
  std::vector<uint64_t> mesh_shape, coordinate;
  // Whether this rank's shard is a copy of one a rank with a lower coordinate holds (a
  // Replicate mesh dimension where its coordinate is not 0): served from that rank only.
  bool replica = false;

  // ShardedTensor: every shard of the tensor, on every rank (ShardedTensorMetadata).
  struct ShardMeta {
    BoxDims offsets;
    Shape shape;
    int64_t rank = -1;  // the placement's rank; -1 when the shard names none
  };
  std::vector<ShardMeta> shards;

  // Why the shards cannot be assembled into the tensor (Partial, _StridedShard placements);
  // empty when they can.
  std::string not_assembled;

  const char* class_name() const { return kind == Kind::kDTensor ? "DTensor" : "ShardedTensor"; }
  // What metadata.json records in the tensor's place in a single rank file: the class, global
  // dtype and shape, the layout and the keys its local shards are served under.
  nlohmann::json Describe(const std::vector<std::string>& local_keys) const;
};

// Whether `v` is a pickled DTensor or ShardedTensor (by the class _rebuild_wrapper_subclass
// makes). When it is, *found is set and *out filled, its local tensors resolved through
// `storages`; one that cannot be read as documented is refused with a line naming the key
// `path` flattens to.
Status RecognizeDistributedTensor(const PyValue* v, const StorageResolver& storages,
                                  const std::vector<PathElement>& path, bool* found, DistributedTensor* out);

// How a single rank file serves the local shards of a tensor at key K: "K.local_shards.<i>"
// (path K + ["local_shards", i]). A local shard is never served under K itself: it is not
// the tensor K names.
inline constexpr const char* kLocalShardsName = "local_shards";

// Where the torch.save walker hands the distributed tensors it meets when they are not to be
// served as local shards (a set of rank files being consolidated).
class DistributedTensorSink {
 public:
  virtual ~DistributedTensorSink() = default;
  // `tensor` met at `path`, where the walk's next plain tensor will be catalog->tensors
  // [tensors_before] once the read ends (the walk's order). Its shards' `value`s are not
  // valid after the call.
  virtual Status Add(DistributedTensor tensor, const std::vector<PathElement>& path, size_t tensors_before) = 0;
};

// Reads the torch.save zip `path` (through catalog->files) like ReadTorchZip, but hands its
// DTensors and ShardedTensors to `sink` instead of serving their local shards. Its plain
// tensors are appended to catalog->tensors, its non-tensor values to *metadata.
Status ReadTorchZipDistributed(const std::string& path, Catalog* catalog, nlohmann::json* metadata,
                               const ReadLimits& limits, DistributedTensorSink* sink);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_TORCH_TORCH_DISTRIBUTED_HPP_
