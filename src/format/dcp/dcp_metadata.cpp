// Parser of DCP `.metadata` pickles. Classes are matched by name only: DCP moved them
// between modules across torch releases, and nothing here imports or calls them.
#include "format/dcp/dcp_metadata.hpp"

#include <algorithm>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include "codec/pickle.hpp"
#include "format/torch/torch_archive.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// The class an object was made from: NEWOBJ/REDUCE on the class itself, or the
// protocol 0-1 forms that name the class as the first argument.
std::string_view ClassName(const PyValue* v) {
  if (!v || v->kind() != Kind::kObject || !v->callable() || v->callable()->kind() != Kind::kGlobal) return {};
  const PyValue* cls = v->callable();
  if (cls->name() == "__newobj__" || cls->name() == "_reconstructor") {
    cls = Arg(v, 0);
    if (!cls || cls->kind() != Kind::kGlobal) return {};
  }
  return cls->name();
}

// Attribute `name` of a dataclass instance: its BUILD state is a dict (or, with slots, a
// (dict, slots dict) pair).
const PyValue* Field(const PyValue* obj, std::string_view name) {
  if (!obj || !obj->state()) return nullptr;
  const PyValue* state = obj->state();
  if (state->kind() == Kind::kTuple && state->items().size() == 2) {
    if (const PyValue* f = Find(AsMapping(state->items()[0]), name)) return f;
    return Find(AsMapping(state->items()[1]), name);
  }
  return Find(AsMapping(state), name);
}

bool AsString(const PyValue* v, std::string* out) {
  if (!v || v->kind() != Kind::kStr) return false;
  out->assign(v->s());
  return true;
}

// A storage_data entry as it is looked up: DCP compares a MetadataIndex's fqn and offset
// alone (the index is only a hint). Entries are grouped by fqn and sorted by offsets, so a
// tensor's chunks are found by binary search: a million chunks would otherwise be a
// million map keys built as strings. The offsets lie in one shared array.
struct StoredSlice {
  bool is_chunk = false;  // objects (BytesStorageMetadata) have no offsets
  uint32_t rank = 0;
  size_t at = 0;  // the offsets: StorageIndex::offsets[at .. at + rank)
  DcpSlice slice;
};

// What a chunk is looked up by: objects first, then chunks by their offsets.
struct SliceKey {
  bool is_chunk;
  std::span<const uint64_t> offsets;
  bool operator<(const SliceKey& other) const {
    if (is_chunk != other.is_chunk) return !is_chunk;
    return std::lexicographical_compare(offsets.begin(), offsets.end(), other.offsets.begin(), other.offsets.end());
  }
};

// A relative path that names a file inside the folder: no absolute path, no "..", no empty
// or "." component.
bool StaysInFolder(std::string_view path) {
  if (path.empty() || path.front() == '/' || path.find('\0') != std::string_view::npos) return false;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    std::string_view part = path.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

// pathlib.PosixPath('a', 'b') and the like, as "a/b"; a str as is.
bool AsPathText(const PyValue* v, std::string* out) {
  if (AsString(v, out)) return true;
  const std::string_view cls = ClassName(v);
  if (cls != "PosixPath" && cls != "WindowsPath" && cls != "PurePosixPath" && cls != "Path") return false;
  out->clear();
  if (!v->args() || v->args()->kind() != Kind::kTuple) return false;
  for (const PyValue* part : v->args()->items()) {
    if (part->kind() != Kind::kStr) return false;
    if (!out->empty() && out->back() != '/') out->push_back('/');
    out->append(part->s());
  }
  return true;
}

class MetadataParser {
 public:
  MetadataParser(std::string_view where, DcpMetadata* out, const ReadLimits& limits)
      : where_(where), out_(out), limits_(limits) {}

  Status Parse(const PyValue* root);

 private:
  Status Bad(const std::string& what) const { return Status::Corruption(where_, what); }
  Status BadItem(std::string_view fqn, const std::string& what) const {
    return Status::Corruption(where_, "'" + std::string(fqn) + "': " + what);
  }
  Status ReadStorageData(const PyValue* storage_data);
  Status ReadItem(const std::string& fqn, const PyValue* value, DcpItem* item);
  Status ReadMcoreData(const PyValue* mcore_data);
  Status ReadProperties(const std::string& fqn, const PyValue* props, DType* dtype);
  // The slice of `fqn`'s object (no offsets) or of its chunk at `offsets`.
  Status Slice(const std::string& fqn, const std::span<const uint64_t>* offsets, DcpSlice* slice) const;
  SliceKey Key(const StoredSlice& s) const {
    return SliceKey{s.is_chunk, std::span<const uint64_t>(stored_offsets_).subspan(s.at, s.rank)};
  }
  // The number of data file `path` in DcpMetadata::files, checked to stay in the folder
  // when first seen.
  Status FileNumber(std::string_view fqn, const std::string& path, uint32_t* number);
  void ReadStorageMeta(const PyValue* meta);

  std::string where_;
  DcpMetadata* out_;
  ReadLimits limits_;
  // storage_data by fqn (a view into the pickle, which outlives the parser), sorted.
  std::unordered_map<std::string_view, std::vector<StoredSlice>> slices_;
  std::vector<uint64_t> stored_offsets_;
  std::unordered_map<std::string, uint32_t> file_numbers_;
  // The same by the address of the pickled value (see ReadStorageData).
  std::unordered_map<const PyValue*, std::vector<StoredSlice>*> group_by_value_;
  std::unordered_map<const PyValue*, uint32_t> file_by_value_;
  // mcore_data: fqn -> the real shape of a reformulated tensor (a view into the pickle).
  std::unordered_map<std::string_view, std::vector<uint64_t>> megatron_shapes_;
  std::vector<uint64_t> scratch_;  // a tuple being read
  uint64_t dims_bytes_ = 0;        // what the items' chunk_dims take
};

Status MetadataParser::Parse(const PyValue* root) {
  if (ClassName(root) != "Metadata") return Bad("not a DCP .metadata file (the pickle is not a Metadata object)");
  const PyValue* sdm = AsMapping(Field(root, "state_dict_metadata"));
  if (!sdm) return Bad("Metadata has no state_dict_metadata dict");
  if (const PyValue* version = Field(root, "version"); version && version->kind() != Kind::kNone &&
                                                       !AsString(version, &out_->version))
    return Bad("Metadata.version is not a string");
  ReadStorageMeta(Field(root, "storage_meta"));
  CKPTFS_RETURN_IF_ERROR(ReadStorageData(Field(root, "storage_data")));
  CKPTFS_RETURN_IF_ERROR(ReadMcoreData(Field(root, "mcore_data")));

  // planner_data: fqn -> the key path in the nested state dict (the default planner's).
  std::unordered_map<std::string_view, const PyValue*> planner;
  if (const PyValue* pd = AsMapping(Field(root, "planner_data")))
    for (const auto& [k, v] : pd->entries())
      if (k->kind() == Kind::kStr) planner[k->s()] = v;

  if (sdm->entries().size() > limits_.tensors)
    return Status::Refused(where_, std::to_string(sdm->entries().size()) + " state-dict entries, over the limit of " +
                                       std::to_string(limits_.tensors)).WithLimitOption("max_tensors");
  std::unordered_set<std::string_view> seen;
  out_->items.reserve(sdm->entries().size());
  for (const auto& [k, v] : sdm->entries()) {
    if (k->kind() != Kind::kStr) return Bad("a state_dict_metadata key is not a string");
    if (!seen.insert(k->s()).second) return BadItem(std::string(k->s()), "listed twice in state_dict_metadata");
    DcpItem item;
    item.fqn.assign(k->s());
    CKPTFS_RETURN_IF_ERROR(ReadItem(item.fqn, v, &item));
    if (auto it = planner.find(k->s()); it != planner.end()) {
      const PyValue* path = it->second;
      if (!path || (path->kind() != Kind::kTuple && path->kind() != Kind::kList))
        return BadItem(item.fqn, "planner_data path is not a tuple");
      for (const PyValue* part : path->items()) {
        if (part->kind() == Kind::kStr) item.path.emplace_back(std::string(part->s()));
        else if (part->kind() == Kind::kInt) item.path.emplace_back(part->i());
        else return BadItem(item.fqn, "planner_data path holds something other than str and int keys");
      }
    }
    if (item.path.empty()) item.path.emplace_back(item.fqn);
    if (auto it = megatron_shapes_.find(k->s()); it != megatron_shapes_.end()) {
      if (!item.is_tensor)
        return Status::NotSupported(where_, "'" + item.fqn + "': mcore_data gives a real shape (nd_reformulated_orig_global_shape) "
                                                              "for an entry that is not a tensor");
      item.megatron_reformulated = true;
      item.megatron_shape = std::move(it->second);
    }
    out_->items.push_back(std::move(item));
  }
  return Status::OK();
}

Status MetadataParser::FileNumber(std::string_view fqn, const std::string& path, uint32_t* number) {
  auto it = file_numbers_.find(path);
  if (it == file_numbers_.end()) {
    if (!StaysInFolder(path)) return BadItem(fqn, "storage path '" + path + "' leaves the checkpoint folder");
    it = file_numbers_.emplace(path, static_cast<uint32_t>(out_->files.size())).first;
    out_->files.push_back(path);
  }
  *number = it->second;
  return Status::OK();
}

Status MetadataParser::ReadStorageData(const PyValue* storage_data) {
  const PyValue* sd = AsMapping(storage_data);
  if (!sd) return Bad("Metadata.storage_data is not a dict (a storage layout other than the file system writer's?)");
  std::string path;
  for (const auto& [k, v] : sd->entries()) {
    const PyValue* fqn_value = Field(k, "fqn");
    if (ClassName(k) != "MetadataIndex" || !fqn_value || fqn_value->kind() != Kind::kStr)
      return Bad("a storage_data key is not a MetadataIndex with an fqn");
    // A view into the pickle: a million chunks' names are not copied (they are only
    // copied into messages).
    const std::string_view fqn = fqn_value->s();
    const PyValue* offset = Field(k, "offset");
    StoredSlice stored;
    stored.is_chunk = offset && offset->kind() != Kind::kNone;
    if (stored.is_chunk) {
      if (!AsUintTuple(offset, &scratch_)) return BadItem(fqn, "storage_data offset is not a tuple of ints");
      stored.at = stored_offsets_.size();
      stored.rank = static_cast<uint32_t>(scratch_.size());
      stored_offsets_.insert(stored_offsets_.end(), scratch_.begin(), scratch_.end());
    }
    if (ClassName(v) != "_StorageInfo") return BadItem(fqn, "storage_data value is not a _StorageInfo");
    if (const PyValue* td = Field(v, "transform_descriptors");
        td && td->kind() != Kind::kNone && !((td->kind() == Kind::kList || td->kind() == Kind::kTuple) && td->items().empty())) {
      std::string names;
      if (td->kind() == Kind::kList || td->kind() == Kind::kTuple)
        for (const PyValue* d : td->items()) names += (names.empty() ? "" : ", ") + (d->kind() == Kind::kStr ? std::string(d->s()) : "?");
      return Status::NotSupported(where_, "'" + std::string(fqn) + "' is stored with transforms (" + names +
                                              "); only untransformed torch.save slices can be served");
    }
    const PyValue* path_value = Field(v, "relative_path");
    if (!path_value || !AsUint(Field(v, "offset"), &stored.slice.offset) || !AsUint(Field(v, "length"), &stored.slice.length))
      return BadItem(fqn, "storage_data entry lacks relative_path, offset or length");
    // A rank's path and a tensor's fqn are pickled once and referenced through the memo by
    // every chunk: look them up by value address, hashing each string once, not per chunk.
    if (auto known = file_by_value_.find(path_value); known != file_by_value_.end()) {
      stored.slice.file = known->second;
    } else {
      if (!AsPathText(path_value, &path)) return BadItem(fqn, "storage_data entry lacks relative_path, offset or length");
      CKPTFS_RETURN_IF_ERROR(FileNumber(fqn, path, &stored.slice.file));
      file_by_value_.emplace(path_value, stored.slice.file);
    }
    uint64_t end;
    if (!CheckedAdd(stored.slice.offset, stored.slice.length, &end))
      return BadItem(fqn, "storage offset + length overflows");
    std::vector<StoredSlice>*& group = group_by_value_[fqn_value];
    if (!group) group = &slices_[fqn];
    group->push_back(stored);
  }
  for (auto& [group_fqn, group] : slices_) {
    std::sort(group.begin(), group.end(), [&](const StoredSlice& a, const StoredSlice& b) { return Key(a) < Key(b); });
    for (size_t i = 1; i < group.size(); ++i)
      if (!(Key(group[i - 1]) < Key(group[i])))
        return BadItem(group_fqn, "two storage_data entries for one chunk");
  }
  return Status::OK();
}

Status MetadataParser::Slice(const std::string& fqn, const std::span<const uint64_t>* offsets, DcpSlice* slice) const {
  const std::vector<StoredSlice>* group = nullptr;
  if (auto it = slices_.find(fqn); it != slices_.end()) group = &it->second;
  const SliceKey wanted{offsets != nullptr, offsets ? *offsets : std::span<const uint64_t>()};
  auto found = group ? std::lower_bound(group->begin(), group->end(), wanted,
                                        [&](const StoredSlice& s, const SliceKey& key) { return Key(s) < key; })
                     : std::vector<StoredSlice>::const_iterator{};
  if (!group || found == group->end() || wanted < Key(*found)) {
    std::string at;
    if (offsets) {
      for (uint64_t o : *offsets) at += (at.empty() ? "" : ", ") + std::to_string(o);
      at = " at offsets (" + at + ")";
    }
    return BadItem(fqn, "no storage_data entry for the " + std::string(offsets ? "chunk" : "object") + at);
  }
  *slice = found->slice;
  return Status::OK();
}

Status MetadataParser::ReadProperties(const std::string& fqn, const PyValue* props, DType* dtype) {
  if (ClassName(props) != "TensorProperties") return BadItem(fqn, "tensor properties are not a TensorProperties");
  // Saved as a tuple (dtype, layout, requires_grad, memory format, pin_memory[, strides])
  // by TensorProperties.__getstate__, as a dict by releases without it.
  const PyValue* state = props->state();
  const PyValue* d = nullptr;
  const PyValue* layout = nullptr;
  if (state && state->kind() == Kind::kTuple && state->items().size() >= 2) {
    d = state->items()[0];
    layout = state->items()[1];
  } else {
    d = Field(props, "dtype");
    layout = Field(props, "layout");
  }
  std::optional<DType> parsed;
  if (!d || d->kind() != Kind::kGlobal || d->s() != "torch" || !(parsed = DTypeFromTorchName(d->name())))
    return Status::NotSupported(where_, "'" + fqn + "': unsupported dtype " +
                                            (d && d->kind() == Kind::kGlobal ? QualifiedName(d) : std::string("?")));
  *dtype = *parsed;
  // torch.serialization._get_layout("torch.strided"), or the layout GLOBAL itself.
  if (layout && layout->kind() != Kind::kNone) {
    const PyValue* name = layout->kind() == Kind::kObject ? Arg(layout, 0) : nullptr;
    const bool strided = (name && name->kind() == Kind::kStr && name->s() == "torch.strided") ||
                         IsGlobal(layout, "torch.strided");
    if (!strided) return Status::NotSupported(where_, "'" + fqn + "': only strided (dense) tensors are supported");
  }
  return Status::OK();
}

Status MetadataParser::ReadItem(const std::string& fqn, const PyValue* value, DcpItem* item) {
  const std::string_view cls = ClassName(value);
  if (cls == "BytesStorageMetadata") {
    item->is_tensor = false;
    return Slice(fqn, nullptr, &item->object);
  }
  if (cls != "TensorStorageMetadata")
    return BadItem(fqn, "entry is neither a TensorStorageMetadata nor a BytesStorageMetadata");
  item->is_tensor = true;
  CKPTFS_RETURN_IF_ERROR(ReadProperties(fqn, Field(value, "properties"), &item->dtype));
  if (!AsUintTuple(Field(value, "size"), &item->shape)) return BadItem(fqn, "tensor size is not a tuple of ints");
  uint64_t numel = 1;
  for (uint64_t d : item->shape)
    if (!CheckedMul(numel, d, &numel)) return BadItem(fqn, "tensor size overflows");
  const PyValue* chunks = Field(value, "chunks");
  if (!chunks || chunks->kind() != Kind::kList) return BadItem(fqn, "tensor chunks are not a list");
  const size_t rank = item->shape.size();
  // One ChunkStorageMetadata repeated by memo references costs the pickle a few bytes per
  // repeat but 16 x rank bytes here: charge the numbers to the pickle's memory limit.
  uint64_t dims_bytes;
  if (!CheckedMul(uint64_t{chunks->items().size()}, 16 * uint64_t{rank}, &dims_bytes) ||
      !CheckedAdd(dims_bytes_, dims_bytes, &dims_bytes_) || dims_bytes_ > limits_.pickle_memory)
    return Status::Refused(where_, "'" + fqn + "': its chunk offsets and sizes would take more than " +
                                       std::to_string(limits_.pickle_memory) + " bytes")
                                           .WithLimitOption("max_pickle_memory");
  item->chunk_slices.resize(chunks->items().size());
  item->chunk_dims.resize(chunks->items().size() * 2 * rank);
  for (size_t k = 0; k < chunks->items().size(); ++k) {
    const PyValue* c = chunks->items()[k];
    if (ClassName(c) != "ChunkStorageMetadata") return BadItem(fqn, "a chunk is not a ChunkStorageMetadata with offsets and sizes");
    uint64_t* dims = item->chunk_dims.data() + 2 * k * rank;
    for (const auto& [name, at] : {std::pair<const char*, uint64_t*>{"offsets", dims}, {"sizes", dims + rank}}) {
      if (!AsUintTuple(Field(c, name), &scratch_))
        return BadItem(fqn, "a chunk is not a ChunkStorageMetadata with offsets and sizes");
      if (scratch_.size() != rank)
        return BadItem(fqn, "a chunk's rank differs from the tensor's (" + std::to_string(rank) + ")");
      std::copy(scratch_.begin(), scratch_.end(), at);
    }
    const std::span<const uint64_t> offsets = item->offsets(k), sizes = item->sizes(k);
    for (size_t d = 0; d < rank; ++d) {
      uint64_t end;
      if (!CheckedAdd(offsets[d], sizes[d], &end) || end > item->shape[d])
        return BadItem(fqn, "a chunk extends past the tensor along dimension " + std::to_string(d));
    }
    CKPTFS_RETURN_IF_ERROR(Slice(fqn, &offsets, &item->chunk_slices[k]));
  }
  return Status::OK();
}

// megatron-core's `mcore_data`: {fqn: {}} for a plain tensor, {fqn:
// {"nd_reformulated_orig_global_shape": (real shape)}} for one saved as flattened fragments.
Status MetadataParser::ReadMcoreData(const PyValue* mcore_data) {
  if (!mcore_data || mcore_data->kind() == Kind::kNone) return Status::OK();
  const PyValue* entries = AsMapping(mcore_data);
  if (!entries) return Bad("Metadata.mcore_data (Megatron's) is not a dict");
  for (const auto& [k, v] : entries->entries()) {
    if (k->kind() != Kind::kStr) return Bad("a key of Metadata.mcore_data (Megatron's) is not a string");
    const PyValue* fields = AsMapping(v);
    if (!fields) return BadItem(k->s(), "its mcore_data entry (Megatron's) is not a dict");
    for (const auto& [name, value] : fields->entries()) {
      if (name->kind() == Kind::kStr && name->s() == "nd_reformulated_orig_global_shape") {
        std::vector<uint64_t> shape;
        if (!AsUintTuple(value, &shape))
          return BadItem(k->s(), "mcore_data's nd_reformulated_orig_global_shape is not a tuple of ints");
        megatron_shapes_[k->s()] = std::move(shape);
        continue;
      }
      // Another Megatron record of how the tensor was saved: what it changes is unknown, so
      // the tensor's layout cannot be trusted.
      return Status::NotSupported(where_, "'" + std::string(k->s()) + "': mcore_data (Megatron's) holds '" +
                                              (name->kind() == Kind::kStr ? std::string(name->s()) : std::string("?")) +
                                              "', which ckptfs does not know");
    }
  }
  return Status::OK();
}

void MetadataParser::ReadStorageMeta(const PyValue* meta) {
  if (ClassName(meta) != "StorageMeta") return;
  json info = json::object();
  std::string text;
  if (AsPathText(Field(meta, "checkpoint_id"), &text)) info["checkpoint_id"] = text;
  if (AsString(Field(meta, "save_id"), &text)) info["save_id"] = text;
  if (AsString(Field(meta, "load_id"), &text)) info["load_id"] = text;
  if (const PyValue* modules = Field(meta, "modules"); modules && modules->kind() == Kind::kList) {
    json list = json::array();
    for (const PyValue* m : modules->items())
      if (m->kind() == Kind::kStr) list.push_back(std::string(m->s()));
    info["modules"] = std::move(list);
  }
  out_->storage_meta = std::move(info);
}

}  // namespace

Status ParseDcpMetadata(std::string bytes, std::string_view where, DcpMetadata* out, const ReadLimits& limits) {
  if (bytes.size() > limits.pickle_bytes)
    return Status::Refused(where, "the .metadata pickle is " + std::to_string(bytes.size()) +
                                      " bytes, over the limit of " + std::to_string(limits.pickle_bytes))
                                          .WithLimitOption("max_pickle");
  Pickle pickle;
  CKPTFS_RETURN_IF_ERROR(ParseOwnedPickle(std::move(bytes), where, &pickle, limits.pickle_memory));
  *out = DcpMetadata{};
  MetadataParser parser(where, out, limits);
  return parser.Parse(pickle.root);
}

}  // namespace ckptfs
