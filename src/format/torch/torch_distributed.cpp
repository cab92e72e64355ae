// DTensor and ShardedTensor in torch pickles: what their pickled forms hold (doc/FORMATS.md,
// "DTensor and ShardedTensor rank files"), read field by field, every number checked.
#include "format/torch/torch_distributed.hpp"

#include <algorithm>
#include <string_view>

#include "format/torch/torch_archive.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// Whether global `g` is class `name` of a torch.distributed module (the modules moved between
// torch versions: torch.distributed._tensor.api, torch.distributed.tensor._api, ...).
bool IsDistributedGlobal(const PyValue* g, std::string_view name) {
  if (!g || g->kind() != Kind::kGlobal || g->name() != name) return false;
  const std::string_view module = g->s();
  return module == "torch.distributed" || module.substr(0, 18) == "torch.distributed.";
}

// The class an object was made of (NEWOBJ cls() / REDUCE cls(...)), when it is a global.
bool IsDistributedObject(const PyValue* v, std::string_view name) {
  return v && v->kind() == Kind::kObject && IsDistributedGlobal(v->callable(), name);
}

std::string_view ObjectClassName(const PyValue* v) {
  if (!v || v->kind() != Kind::kObject || !v->callable() || v->callable()->kind() != Kind::kGlobal) return {};
  return v->callable()->name();
}

// Attribute `name` of an object: its BUILD state is a dict, or (dataclasses with slots) a
// (dict or None, slots dict) pair.
const PyValue* Field(const PyValue* obj, std::string_view name) {
  if (!obj) return nullptr;
  if (obj->kind() == Kind::kDict) return Find(obj, name);
  if (obj->kind() != Kind::kObject || !obj->state()) return nullptr;
  const PyValue* state = obj->state();
  if (state->kind() == Kind::kDict) return Find(state, name);
  if (state->kind() == Kind::kTuple)
    for (const PyValue* part : state->items())
      if (part->kind() == Kind::kDict)
        if (const PyValue* found = Find(part, name)) return found;
  return nullptr;
}

bool AsInt(const PyValue* v, int64_t* out) {
  if (!v || v->kind() != Kind::kInt) return false;
  *out = v->i();
  return true;
}

// torch.chunk's split of `size` elements into `chunks`: the block of chunk `index`
// (Shard.local_shard_size_and_offset). Chunks past the end are empty, at offset `size`.
void ChunkOf(uint64_t size, uint64_t chunks, uint64_t index, uint64_t* offset, uint64_t* length) {
  const uint64_t full = size / chunks + (size % chunks != 0);
  uint64_t start;
  if (!CheckedMul(full, index, &start) || start > size) start = size;
  *offset = start;
  *length = std::min(full, size - start);
}

class Recognizer {
 public:
  Recognizer(const StorageResolver& storages, const std::vector<PathElement>& path, DistributedTensor* out)
      : storages_(storages), path_(path), out_(out) {}

  Status DTensor(const PyValue* wrapper_args, const PyValue* state);
  Status ShardedTensor(const PyValue* wrapper_args, const PyValue* state);

 private:
  std::string Key() const { return path_.empty() ? "tensor" : FlattenKey(path_); }
  Status Bad(const std::string& what) const {
    return Status::NotSupported(storages_.path(), std::string("key '") + Key() + "': " + out_->class_name() + " " + what);
  }
  // The wrapper's (cls, dtype, size, stride, storage_offset, layout, device, requires_grad).
  Status GlobalDtypeAndShape(const PyValue* wrapper_args);
  Status LocalTensor(const PyValue* value, LocalShard* shard);
  Status MeshShape(const PyValue* mesh);
  Status ParsePlacement(const PyValue* p, Placement* out);

  const StorageResolver& storages_;
  const std::vector<PathElement>& path_;
  DistributedTensor* out_;
};

Status Recognizer::GlobalDtypeAndShape(const PyValue* args) {
  if (!args || args->kind() != Kind::kTuple || args->items().size() < 3) return Bad("with malformed wrapper arguments");
  const PyValue* dtype = args->items()[1];
  std::optional<DType> d;
  if (!dtype || dtype->kind() != Kind::kGlobal || dtype->s() != "torch" || !(d = DTypeFromTorchName(dtype->name())))
    return Bad("with an unsupported dtype");
  out_->dtype = *d;
  if (!AsUintTuple(args->items()[2], &out_->shape)) return Bad("with a malformed global shape");
  return Status::OK();
}

Status Recognizer::LocalTensor(const PyValue* value, LocalShard* shard) {
  bool is_tensor = false;
  if (value) CKPTFS_RETURN_IF_ERROR(RebuildTensor(value, storages_, &shard->tensor, &is_tensor));
  if (!is_tensor) return Bad("whose local tensor is not a plain tensor");
  if (shard->tensor.dtype != out_->dtype)
    return Bad(std::string("whose local tensor is ") + std::string(Info(shard->tensor.dtype).torch_name) +
               " where the tensor is " + std::string(Info(out_->dtype).torch_name));
  if (shard->tensor.shape.size() != out_->shape.size())
    return Bad("whose local tensor has " + std::to_string(shard->tensor.shape.size()) + " dimensions where the tensor has " +
               std::to_string(out_->shape.size()));
  shard->value = value;
  return Status::OK();
}

Status Recognizer::MeshShape(const PyValue* mesh) {
  out_->mesh_shape.clear();
  if (const PyValue* layout = Field(mesh, "_layout")) {
    // _MeshLayout: one _FlatLayout per mesh dimension, whose size is the product of its shape.
    const PyValue* axes = Field(layout, "axes");
    if (!axes || (axes->kind() != Kind::kTuple && axes->kind() != Kind::kList)) return Bad("with a malformed mesh layout");
    for (const PyValue* axis : axes->items()) {
      std::vector<uint64_t> sizes;
      if (!AsUintTuple(Field(axis, "shape"), &sizes)) return Bad("with a malformed mesh layout");
      uint64_t n = 1;
      for (uint64_t s : sizes)
        if (!CheckedMul(n, s, &n)) return Bad("with a mesh too large");
      out_->mesh_shape.push_back(n);
    }
  } else if (const PyValue* ranks = Field(mesh, "mesh")) {
    // Older meshes pickle their rank tensor, whose shape is the mesh's.
    TensorEntry t;
    bool is_tensor = false;
    CKPTFS_RETURN_IF_ERROR(RebuildTensor(ranks, storages_, &t, &is_tensor));
    if (!is_tensor) return Bad("with a malformed device mesh");
    out_->mesh_shape.assign(t.shape.begin(), t.shape.end());
  } else {
    return Bad("whose device mesh records no shape");
  }
  if (!AsUintTuple(Field(mesh, "_coordinate_on_dim"), &out_->coordinate))
    return Bad("whose device mesh records no coordinate for the rank that saved it");
  int64_t rank = 0;
  if (AsInt(Field(mesh, "_rank"), &rank) && rank >= 0) out_->rank = rank;
  if (out_->coordinate.size() != out_->mesh_shape.size()) return Bad("whose mesh coordinate and shape disagree");
  out_->world_size = 1;
  for (size_t i = 0; i < out_->mesh_shape.size(); ++i) {
    if (out_->mesh_shape[i] == 0 || out_->coordinate[i] >= out_->mesh_shape[i])
      return Bad("whose mesh coordinate " + ShapeText(out_->coordinate) + " is outside its mesh " + ShapeText(out_->mesh_shape));
    if (!CheckedMul(out_->world_size, out_->mesh_shape[i], &out_->world_size)) return Bad("with a mesh too large");
  }
  return Status::OK();
}

Status Recognizer::ParsePlacement(const PyValue* p, Placement* out) {
  const std::string_view cls = ObjectClassName(p);
  if (!p || !IsDistributedObject(p, cls)) return Bad("with a placement that is not a torch.distributed placement");
  auto Dim = [&](uint64_t* dim) {
    int64_t d;
    if (!AsInt(Field(p, "dim"), &d)) return Bad("with a " + std::string(cls) + " placement without a dimension");
    const int64_t rank = static_cast<int64_t>(out_->shape.size());
    if (d < 0) d += rank;
    if (d < 0 || d >= rank) return Bad("sharded along dimension " + std::to_string(d) + " of a tensor of " +
                                       std::to_string(rank) + " dimensions");
    *dim = static_cast<uint64_t>(d);
    return Status::OK();
  };
  if (cls == "Shard") {
    out->kind = Placement::Kind::kShard;
    return Dim(&out->dim);
  }
  if (cls == "Replicate") {
    out->kind = Placement::Kind::kReplicate;
    return Status::OK();
  }
  if (cls == "_StridedShard") {
    out->kind = Placement::Kind::kStridedShard;
    CKPTFS_RETURN_IF_ERROR(Dim(&out->dim));
    AsUint(Field(p, "split_factor"), &out->split_factor);
    return Status::OK();
  }
  if (cls == "Partial" || cls == "MaskPartial" || cls == "_Partial" || cls == "_MaskPartial" || cls == "NormPartial" ||
      cls == "_NormPartial") {
    out->kind = Placement::Kind::kPartial;
    const PyValue* op = Field(p, "reduce_op");
    out->reduce_op = op && op->kind() == Kind::kStr ? std::string(op->s()) : std::string(cls);
    return Status::OK();
  }
  return Bad("with a placement of unknown class " + std::string(cls));
}

Status Recognizer::DTensor(const PyValue* args, const PyValue* state) {
  out_->kind = DistributedTensor::Kind::kDTensor;
  CKPTFS_RETURN_IF_ERROR(GlobalDtypeAndShape(args));
  // The object's state: its __dict__, or (__dict__ or None, slots) as _rebuild_from_type_v2
  // takes it.
  if (state && state->kind() == Kind::kTuple && state->items().size() == 2) {
    const PyValue* dict = state->items()[0];
    const PyValue* slots = state->items()[1];
    state = dict && dict->kind() == Kind::kDict && Find(dict, "_spec") ? dict : slots;
  }
  if (!state || state->kind() != Kind::kDict) return Bad("without its state (local tensor and spec)");
  const PyValue* spec = Find(state, "_spec");
  if (!IsDistributedObject(spec, "DTensorSpec")) return Bad("without a DTensorSpec");
  const PyValue* mesh = Field(spec, "mesh");
  if (!IsDistributedObject(mesh, "DeviceMesh")) return Bad("without a DeviceMesh");
  CKPTFS_RETURN_IF_ERROR(MeshShape(mesh));
  const PyValue* placements = Field(spec, "placements");
  if (!placements || (placements->kind() != Kind::kTuple && placements->kind() != Kind::kList))
    return Bad("without placements");
  if (placements->items().size() != out_->mesh_shape.size())
    return Bad("with " + std::to_string(placements->items().size()) + " placements on a mesh of " +
               std::to_string(out_->mesh_shape.size()) + " dimensions");
  for (const PyValue* p : placements->items()) {
    Placement placement;
    CKPTFS_RETURN_IF_ERROR(ParsePlacement(p, &placement));
    out_->placements.push_back(std::move(placement));
  }
  // The spec repeats the global shape (TensorMeta(shape, stride, dtype)): both must agree.
  if (const PyValue* meta = Field(spec, "tensor_meta"); meta && meta->kind() == Kind::kObject) {
    Shape meta_shape;
    if (AsUintTuple(Arg(meta, 0), &meta_shape) && meta_shape != out_->shape)
      return Bad("whose spec's shape " + ShapeText(meta_shape) + " is not its shape " + ShapeText(out_->shape));
  }
  LocalShard shard;
  CKPTFS_RETURN_IF_ERROR(LocalTensor(Find(state, "_local_tensor"), &shard));

  // The block this rank holds: each mesh dimension in turn splits the block along its Shard
  // dimension as torch.chunk does (compute_local_shape_and_global_offset).
  Shape block = out_->shape;
  shard.offsets.assign(out_->shape.size(), 0);
  for (size_t i = 0; i < out_->placements.size(); ++i) {
    const Placement& p = out_->placements[i];
    if (p.kind == Placement::Kind::kReplicate) {
      out_->replica |= out_->coordinate[i] != 0;
    } else if (p.kind == Placement::Kind::kShard) {
      uint64_t offset, length;
      ChunkOf(block[p.dim], out_->mesh_shape[i], out_->coordinate[i], &offset, &length);
      shard.offsets[p.dim] += offset;
      block[p.dim] = length;
    } else if (out_->not_assembled.empty()) {
      out_->not_assembled = p.kind == Placement::Kind::kPartial
                                ? "placement " + p.Describe() + ": each rank holds a partial value to be reduced, not a block"
                                : "placement " + p.Describe() + ": each rank holds interleaved pieces, not a block";
    }
  }
  // A tensor dimension split by several mesh dimensions in an order other than theirs
  // (shard_order) is laid out differently from the block computed above.
  if (const PyValue* order = Field(spec, "shard_order");
      order && (order->kind() == Kind::kTuple || order->kind() == Kind::kList) && out_->not_assembled.empty()) {
    for (const PyValue* entry : order->items()) {
      std::vector<uint64_t> mesh_dims;
      if (!entry || entry->kind() != Kind::kObject || !AsUintTuple(Arg(entry, 1), &mesh_dims))
        return Bad("with a malformed shard order");
      if (!std::is_sorted(mesh_dims.begin(), mesh_dims.end()))
        out_->not_assembled = "a shard order " + ShapeText(mesh_dims) + " other than the mesh's";
    }
  }
  if (out_->not_assembled.empty() && !std::equal(block.begin(), block.end(), shard.tensor.shape.begin(),
                                                 shard.tensor.shape.end()))
    return Bad("whose local tensor's shape " + ShapeText(shard.tensor.shape) + " is not the block " + ShapeText(block) +
               " its placements give at mesh coordinate " + ShapeText(out_->coordinate));
  out_->local.push_back(std::move(shard));
  return Status::OK();
}

Status Recognizer::ShardedTensor(const PyValue* args, const PyValue* state) {
  out_->kind = DistributedTensor::Kind::kShardedTensor;
  CKPTFS_RETURN_IF_ERROR(GlobalDtypeAndShape(args));
  // __getstate__: (local shards, ShardedTensorMetadata, ProcessGroupState, sharding spec, ...).
  if (!state || state->kind() != Kind::kTuple || state->items().size() < 3)
    return Bad("without its state (local shards, metadata, process group)");
  const PyValue* local = state->items()[0];
  const PyValue* meta = state->items()[1];
  const PyValue* pg = state->items()[2];
  if (!local || local->kind() != Kind::kList) return Bad("without a list of local shards");
  if (!IsDistributedObject(meta, "ShardedTensorMetadata")) return Bad("without a ShardedTensorMetadata");
  Shape meta_shape;
  if (!AsUintTuple(Field(meta, "size"), &meta_shape) || meta_shape != out_->shape)
    return Bad("whose metadata's size is not its shape " + ShapeText(out_->shape));
  uint64_t local_rank = 0, local_world = 0, global_rank = 0, global_world = 0;
  if (!AsUint(Field(pg, "local_rank"), &local_rank) || !AsUint(Field(pg, "global_rank"), &global_rank) ||
      !AsUint(Field(pg, "local_world_size"), &local_world) || !AsUint(Field(pg, "global_world_size"), &global_world))
    return Bad("without the process group's ranks");
  if (local_world != global_world || local_rank != global_rank)
    return Bad("saved by a process group of " + std::to_string(local_world) + " of " + std::to_string(global_world) +
               " ranks (only the default group is read)");
  out_->rank = static_cast<int64_t>(global_rank);
  out_->world_size = global_world;

  // A shard's offsets and sizes, inside the tensor.
  auto ShardBlock = [&](const PyValue* shard_meta, DistributedTensor::ShardMeta* out) {
    if (!IsDistributedObject(shard_meta, "ShardMetadata")) return Bad("with a shard without ShardMetadata");
    if (!AsUintTuple(Field(shard_meta, "shard_offsets"), &out->offsets) ||
        !AsUintTuple(Field(shard_meta, "shard_sizes"), &out->shape) || out->offsets.size() != out_->shape.size() ||
        out->shape.size() != out_->shape.size())
      return Bad("with a malformed shard offset or size");
    for (size_t d = 0; d < out_->shape.size(); ++d) {
      uint64_t end;
      if (!CheckedAdd(out->offsets[d], out->shape[d], &end) || end > out_->shape[d])
        return Bad("with a shard at " + ShapeText(out->offsets) + " of size " + ShapeText(out->shape) +
                   " outside its shape " + ShapeText(out_->shape));
    }
    int64_t rank;
    out->rank = AsInt(Field(Field(shard_meta, "placement"), "_rank"), &rank) && rank >= 0 ? rank : -1;
    return Status::OK();
  };
  const PyValue* all = Field(meta, "shards_metadata");
  if (!all || all->kind() != Kind::kList) return Bad("without its shards' metadata");
  for (const PyValue* m : all->items()) {
    DistributedTensor::ShardMeta shard;
    CKPTFS_RETURN_IF_ERROR(ShardBlock(m, &shard));
    out_->shards.push_back(std::move(shard));
  }
  for (const PyValue* s : local->items()) {
    if (!IsDistributedObject(s, "Shard")) return Bad("with a local shard that is not a Shard");
    DistributedTensor::ShardMeta block;
    CKPTFS_RETURN_IF_ERROR(ShardBlock(Field(s, "metadata"), &block));
    LocalShard shard;
    CKPTFS_RETURN_IF_ERROR(LocalTensor(Field(s, "tensor"), &shard));
    if (shard.tensor.shape != block.shape)
      return Bad("whose local shard's tensor has shape " + ShapeText(shard.tensor.shape) + " where its metadata says " +
                 ShapeText(block.shape));
    const bool listed = std::any_of(out_->shards.begin(), out_->shards.end(), [&](const DistributedTensor::ShardMeta& m) {
      return m.offsets == block.offsets && m.shape == block.shape;
    });
    if (!listed) return Bad("whose local shard at " + ShapeText(block.offsets) + " is not in its metadata's shards");
    if (block.rank >= 0 && static_cast<uint64_t>(block.rank) != local_rank)
      return Bad("whose local shard at " + ShapeText(block.offsets) + " is placed on rank " + std::to_string(block.rank) +
                 ", not on the rank that saved it (" + std::to_string(local_rank) + ")");
    shard.offsets = block.offsets;
    out_->local.push_back(std::move(shard));
  }
  return Status::OK();
}

}  // namespace

std::string Placement::Describe() const {
  switch (kind) {
    case Kind::kShard: return "Shard(" + std::to_string(dim) + ")";
    case Kind::kReplicate: return "Replicate()";
    case Kind::kPartial: return "Partial(" + reduce_op + ")";
    case Kind::kStridedShard:
      return "_StridedShard(dim=" + std::to_string(dim) + ", split_factor=" + std::to_string(split_factor) + ")";
  }
  return "?";
}

json DistributedTensor::Describe(const std::vector<std::string>& local_keys) const {
  json d = {{"class", class_name()},
            {"dtype", std::string(Info(dtype).torch_name)},
            {"shape", std::vector<uint64_t>(shape.begin(), shape.end())},
            {"rank", rank},
            {"world_size", world_size}};
  if (kind == Kind::kDTensor) {
    json placements = json::array();
    for (const Placement& p : this->placements) placements.push_back(p.Describe());
    d["placements"] = std::move(placements);
    d["mesh_shape"] = mesh_shape;
    d["coordinate"] = coordinate;
  } else {
    json shards_json = json::array();
    for (const ShardMeta& s : shards)
      shards_json.push_back({{"offsets", std::vector<uint64_t>(s.offsets.begin(), s.offsets.end())},
                             {"shape", std::vector<uint64_t>(s.shape.begin(), s.shape.end())},
                             {"rank", s.rank}});
    d["shards"] = std::move(shards_json);
  }
  json locals = json::array();
  for (size_t i = 0; i < local.size(); ++i)
    locals.push_back({{"key", i < local_keys.size() ? local_keys[i] : std::string()},
                      {"offsets", std::vector<uint64_t>(local[i].offsets.begin(), local[i].offsets.end())},
                      {"shape", std::vector<uint64_t>(local[i].tensor.shape.begin(), local[i].tensor.shape.end())}});
  d["local_shards"] = std::move(locals);
  if (!not_assembled.empty()) d["not_assembled"] = not_assembled;
  return json{{"$distributed_tensor", std::move(d)}};
}

Status RecognizeDistributedTensor(const PyValue* v, const StorageResolver& storages,
                                  const std::vector<PathElement>& path, bool* found, DistributedTensor* out) {
  *found = false;
  // _rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, wrapper args, state)
  if (!v || v->kind() != Kind::kObject || !IsCall(v, "torch._tensor._rebuild_from_type_v2")) return Status::OK();
  const PyValue* func = Arg(v, 0);
  const PyValue* cls = Arg(v, 1);
  if (!func || !IsGlobal(func, "torch._utils._rebuild_wrapper_subclass")) return Status::OK();
  const bool dtensor = IsDistributedGlobal(cls, "DTensor");
  if (!dtensor && !IsDistributedGlobal(cls, "ShardedTensor")) return Status::OK();
  *found = true;
  *out = DistributedTensor();
  Recognizer r(storages, path, out);
  return dtensor ? r.DTensor(Arg(v, 2), Arg(v, 3)) : r.ShardedTensor(Arg(v, 2), Arg(v, 3));
}

}  // namespace ckptfs
