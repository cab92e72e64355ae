// Reader for torch.save zip archives (torch >= 1.6).
//
// data.pkl is parsed by the non-executing pickle machine; this file interprets the
// resulting nodes: tensor rebuild calls become catalog tensors whose bytes are ranges
// of the stored data/<key> records, containers are flattened to dotted keys, and every
// other value becomes JSON metadata. Layout facts: ../shared/reference/
// torch-safetensors-dcp.md sections A.2-A.5.
#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_set>

#include "format/byte_reader.hpp"
#include "format/pickle.hpp"
#include "format/readers.hpp"
#include "format/zip.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// data.pkl of a 100k-tensor checkpoint is ~10 MB; anything near this is not a checkpoint.
constexpr uint64_t kMaxPickleSize = uint64_t{4} << 30;
// Real checkpoints nest a handful of levels; deeper means a cycle or an attack.
constexpr int kMaxDepth = 256;

struct StorageRecord {
  uint64_t data_offset = 0;
  uint64_t nbytes = 0;
};

class TorchZipReader {
 public:
  TorchZipReader(const std::string& path, Catalog* catalog) : path_(path), catalog_(catalog) {}

  Status Read(json* metadata);

 private:
  Status Walk(const PyValue* v, std::vector<PathElement>* path, int depth, json* out, bool* keep);
  Status WalkOpaque(const PyValue* v, std::vector<PathElement>* path, int depth, json* out);
  // Sets *is_tensor and fills *t when `v` is a tensor rebuild call.
  Status AsTensor(const PyValue* v, int depth, TensorEntry* t, bool* is_tensor);
  Status Storage(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype,
                 std::string* key, StorageRecord* rec);
  Status AddTensor(TensorEntry t, const std::vector<PathElement>& path);
  Status Bad(const std::string& what) const { return Status::Corruption(path_, what); }

  std::string path_;
  Catalog* catalog_;
  uint32_t file_ = 0;
  ZipArchive zip_;
  std::string prefix_;  // "<archive>/"
  // Storage records found so far, by the index of their zip entry.
  std::vector<std::optional<StorageRecord>> storages_;
  std::string record_name_;  // scratch for "<archive>/data/<key>", reused to avoid allocations
};

// "module.name" of a GLOBAL, without allocating.
bool IsGlobal(const PyValue* g, std::string_view qualified) {
  return g && g->kind == Kind::kGlobal && qualified.size() == g->s.size() + 1 + g->name.size() &&
         qualified.substr(0, g->s.size()) == g->s && qualified[g->s.size()] == '.' &&
         qualified.substr(g->s.size() + 1) == g->name;
}

bool IsCall(const PyValue* v, std::string_view qualified) {
  return v->kind == Kind::kObject && IsGlobal(v->callable, qualified);
}

std::string QualifiedName(const PyValue* g) { return std::string(g->s) + "." + std::string(g->name); }

const PyValue* Arg(const PyValue* call, size_t i) {
  if (!call->args || call->args->kind != Kind::kTuple || i >= call->args->items.size()) return nullptr;
  return call->args->items[i];
}

bool AsUint(const PyValue* v, uint64_t* out) {
  if (!v || v->kind != Kind::kInt || v->i < 0) return false;
  *out = static_cast<uint64_t>(v->i);
  return true;
}

// A tuple (or torch.Size) of non-negative ints.
bool AsUintTuple(const PyValue* v, std::vector<uint64_t>* out) {
  if (v && IsCall(v, "torch.Size")) v = Arg(v, 0);
  if (!v || (v->kind != Kind::kTuple && v->kind != Kind::kList)) return false;
  out->clear();
  for (const PyValue* item : v->items) {
    uint64_t x;
    if (!AsUint(item, &x)) return false;
    out->push_back(x);
  }
  return true;
}

}  // namespace

Status TorchZipReader::Read(json* metadata) {
  CKPTFS_RETURN_IF_ERROR(catalog_->files->Add(path_, &file_));
  CKPTFS_RETURN_IF_ERROR(zip_.Open(*catalog_->files, file_));
  if (zip_.entries().empty()) return Bad("zip archive has no entries");
  // torch takes the archive folder from the first central-directory entry.
  const std::string& first = zip_.entries().front().name;
  size_t slash = first.find('/');
  if (slash == std::string::npos) return Bad("not a torch.save archive: '" + first + "' is not in a folder");
  prefix_ = first.substr(0, slash + 1);
  if (zip_.Find(prefix_ + "constants.pkl"))
    return Status::NotSupported(path_, "TorchScript archive (torch.jit.save); only torch.save checkpoints are supported");
  const ZipEntry* pkl = zip_.Find(prefix_ + "data.pkl");
  if (!pkl) return Bad("not a torch.save archive: no " + prefix_ + "data.pkl");
  if (const ZipEntry* order = zip_.Find(prefix_ + "byteorder")) {
    std::string value;
    CKPTFS_RETURN_IF_ERROR(zip_.ReadStored(*order, 16, &value));
    if (value == "big") return Status::NotSupported(path_, "big-endian checkpoint (byteorder record says 'big')");
    if (value != "little") return Bad("byteorder record holds '" + value + "'; expected 'little' or 'big'");
  }
  std::string pickle_bytes;
  CKPTFS_RETURN_IF_ERROR(zip_.ReadStored(*pkl, kMaxPickleSize, &pickle_bytes));
  Pickle pickle;
  CKPTFS_RETURN_IF_ERROR(ParsePickle(pickle_bytes, path_ + ": " + prefix_ + "data.pkl", &pickle));

  storages_.resize(zip_.entries().size());
  const size_t first_tensor = catalog_->tensors.size();
  std::vector<PathElement> path;
  bool keep = false;
  CKPTFS_RETURN_IF_ERROR(Walk(pickle.root, &path, 0, metadata, &keep));
  if (!keep) *metadata = json::object();

  // Two tensors whose paths flatten to one key (e.g. {"a.b": x, "a": {"b": y}}) cannot
  // both be served. The tensors vector no longer grows, so views of the keys stay valid.
  std::unordered_set<std::string_view> keys;
  keys.reserve(catalog_->tensors.size() - first_tensor);
  for (size_t i = first_tensor; i < catalog_->tensors.size(); ++i)
    if (!keys.insert(catalog_->tensors[i].key).second)
      return Status::NotSupported(path_, "two tensors flatten to the same key '" + catalog_->tensors[i].key + "'");
  return Status::OK();
}

Status TorchZipReader::Storage(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype,
                               std::string* key, StorageRecord* rec) {
  // ('storage', <storage class>, key, location, numel); numel counts elements for typed
  // storages and bytes for UntypedStorage.
  if (!pid || pid->kind != Kind::kPersistent || !pid->args || pid->args->kind != Kind::kTuple ||
      pid->args->items.size() < 5)
    return Bad("tensor storage is not a ('storage', ...) persistent id");
  const auto& f = pid->args->items;
  uint64_t numel;
  if (f[0]->kind != Kind::kStr || f[0]->s != "storage" || f[1]->kind != Kind::kGlobal ||
      f[2]->kind != Kind::kStr || !AsUint(f[4], &numel))
    return Bad("malformed storage persistent id");
  key->assign(f[2]->s);
  uint64_t itemsize = 1;
  if (f[1]->name == "UntypedStorage") {
    if (!tensor_dtype) return Bad("storage '" + *key + "' is untyped but the tensor names no dtype");
    *dtype = *tensor_dtype;
  } else {
    auto sd = DTypeFromStorageClass(f[1]->name);
    if (!sd) return Status::NotSupported(path_, "storage class " + QualifiedName(f[1]) + " is not supported");
    *dtype = tensor_dtype ? *tensor_dtype : *sd;
    itemsize = Info(*sd).itemsize;
  }
  uint64_t nbytes;
  if (!CheckedMul(numel, itemsize, &nbytes)) return Bad("storage '" + *key + "' size overflows");

  record_name_.assign(prefix_).append("data/").append(*key);
  const ZipEntry* e = zip_.Find(record_name_);
  if (!e) return Bad("the pickle references storage '" + *key + "' but the archive has no record " + record_name_);
  std::optional<StorageRecord>& slot = storages_[static_cast<size_t>(e - zip_.entries().data())];
  if (!slot) {
    const std::string& name = record_name_;
    if (e->method != ZipArchive::kMethodStored)
      return Status::NotSupported(path_, "record " + name + " is compressed (method " + std::to_string(e->method) +
                                             "); tensor data must be stored uncompressed");
    if (e->uncompressed_size != nbytes)
      return Bad("record " + name + " holds " + std::to_string(e->uncompressed_size) + " bytes but the pickle says " +
                 std::to_string(nbytes));
    StorageRecord r;
    r.nbytes = nbytes;
    CKPTFS_RETURN_IF_ERROR(zip_.DataOffset(*e, &r.data_offset));
    slot = r;
  } else if (slot->nbytes != nbytes) {
    return Bad("storage '" + *key + "' is referenced with two different sizes");
  }
  *rec = *slot;
  return Status::OK();
}

Status TorchZipReader::AsTensor(const PyValue* v, int depth, TensorEntry* t, bool* is_tensor) {
  *is_tensor = false;
  if (v->kind != Kind::kObject || depth > kMaxDepth || !v->callable || v->callable->kind != Kind::kGlobal)
    return Status::OK();
  const PyValue* callable = v->callable;
  if (IsGlobal(callable, "torch._utils._rebuild_parameter") ||
      IsGlobal(callable, "torch._utils._rebuild_parameter_with_state")) {
    const PyValue* data = Arg(v, 0);
    return data ? AsTensor(data, depth + 1, t, is_tensor) : Status::OK();
  }
  if (IsGlobal(callable, "torch._tensor._rebuild_from_type_v2")) {
    // (func, new_type, args, state): the tensor is func(*args), then retyped.
    const PyValue* func = Arg(v, 0);
    const PyValue* args = Arg(v, 2);
    if (!func || !args) return Status::OK();
    PyValue call;
    call.kind = Kind::kObject;
    call.callable = const_cast<PyValue*>(func);
    call.args = const_cast<PyValue*>(args);
    return AsTensor(&call, depth + 1, t, is_tensor);
  }
  const bool v2 = IsGlobal(callable, "torch._utils._rebuild_tensor_v2");
  const bool v3 = IsGlobal(callable, "torch._utils._rebuild_tensor_v3");
  if (!v2 && !v3 && !IsGlobal(callable, "torch._utils._rebuild_tensor")) return Status::OK();

  // (storage, storage_offset, size, stride, requires_grad, hooks[, dtype (v3)][, metadata])
  std::optional<DType> tensor_dtype;
  if (v3) {
    const PyValue* d = Arg(v, 6);
    if (!d || d->kind != Kind::kGlobal || d->s != "torch" || !(tensor_dtype = DTypeFromTorchName(d->name)))
      return Status::NotSupported(path_, "tensor with an unsupported dtype " + (d && d->kind == Kind::kGlobal ? QualifiedName(d) : std::string("?")));
  }
  uint64_t offset;
  std::vector<uint64_t> stride;
  if (!AsUint(Arg(v, 1), &offset) || !AsUintTuple(Arg(v, 2), &t->shape))
    return Bad("tensor rebuild call has a malformed offset or size");
  if (!AsUintTuple(Arg(v, 3), &stride) || stride.size() != t->shape.size())
    return Status::NotSupported(path_, "tensor with negative or malformed strides");
  StorageRecord rec;
  CKPTFS_RETURN_IF_ERROR(Storage(Arg(v, 0), tensor_dtype, &t->dtype, &t->storage_id, &rec));
  const uint64_t itemsize = Info(t->dtype).itemsize;

  // Validate that every element lies inside the storage, with checked arithmetic.
  uint64_t numel = 1, last = offset, expected_stride = 1;
  bool contiguous = true;
  for (size_t d = t->shape.size(); d-- > 0;) {
    uint64_t span;
    if (!CheckedMul(numel, t->shape[d], &numel)) return Bad("tensor shape overflows");
    if (t->shape[d] == 0) continue;
    if (!CheckedMul(t->shape[d] - 1, stride[d], &span) || !CheckedAdd(last, span, &last))
      return Bad("tensor strides overflow");
    if (t->shape[d] != 1 && stride[d] != expected_stride) contiguous = false;
    expected_stride *= t->shape[d];
  }
  uint64_t end_bytes;
  if (numel > 0 && (!CheckedAdd(last, 1, &end_bytes) || !CheckedMul(end_bytes, itemsize, &end_bytes) ||
                    end_bytes > rec.nbytes))
    return Bad("tensor reads past the end of storage '" + t->storage_id + "' (" + std::to_string(rec.nbytes) +
               " bytes)");
  if (numel > 0) {
    const uint64_t base = rec.data_offset + offset * itemsize;
    if (contiguous) {
      t->extents.push_back(Extent{file_, base, numel * itemsize});
    } else {
      t->strided = StridedLayout{file_, base, stride};
    }
  }
  t->storage_id = std::to_string(file_) + ":" + t->storage_id;
  *is_tensor = true;
  return Status::OK();
}

Status TorchZipReader::AddTensor(TensorEntry t, const std::vector<PathElement>& path) {
  t.path = path;
  t.key = path.empty() ? "tensor" : FlattenKey(path);
  catalog_->tensors.push_back(std::move(t));
  return Status::OK();
}

Status TorchZipReader::Walk(const PyValue* v, std::vector<PathElement>* path, int depth, json* out, bool* keep) {
  if (depth > kMaxDepth) return Bad("objects nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  *keep = true;
  TensorEntry t;
  bool is_tensor = false;
  CKPTFS_RETURN_IF_ERROR(AsTensor(v, depth, &t, &is_tensor));
  if (is_tensor) {
    *keep = false;
    return AddTensor(std::move(t), *path);
  }

  // Mappings: dict, OrderedDict(...) with items, and BUILD-wrapped dicts.
  const PyValue* mapping = nullptr;
  if (v->kind == Kind::kDict) mapping = v;
  else if (IsCall(v, "collections.OrderedDict") || IsCall(v, "__builtin__.dict") || IsCall(v, "builtins.dict")) mapping = v;
  else if (v->kind == Kind::kObject && v->callable && v->callable->kind == Kind::kNone && v->args &&
           v->args->kind == Kind::kDict)
    mapping = v->args;  // state set on a plain dict (state_dict()._metadata)
  if (mapping) {
    *out = json::object();
    bool dropped = false;
    for (const auto& [k, val] : mapping->entries) {
      PathElement elem;
      if (k->kind == Kind::kStr) elem = std::string(k->s);
      else if (k->kind == Kind::kInt) elem = k->i;
      else {
        // Tuple or float keys: their JSON text is the key.
        json key_json;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(k, path, depth + 1, &key_json));
        elem = key_json.dump(-1, ' ', false, json::error_handler_t::replace);
      }
      path->push_back(elem);
      json child;
      bool child_keep;
      CKPTFS_RETURN_IF_ERROR(Walk(val, path, depth + 1, &child, &child_keep));
      path->pop_back();
      std::string name = std::holds_alternative<std::string>(elem) ? std::get<std::string>(elem)
                                                                    : std::to_string(std::get<int64_t>(elem));
      if (child_keep) (*out)[name] = std::move(child);
      else dropped = true;
    }
    *keep = !(dropped && out->empty());
    return Status::OK();
  }
  if (v->kind == Kind::kList || v->kind == Kind::kTuple || v->kind == Kind::kSet) {
    *out = json::array();
    bool any_kept = v->items.empty();
    for (size_t i = 0; i < v->items.size(); ++i) {
      path->push_back(static_cast<int64_t>(i));
      json child;
      bool child_keep;
      CKPTFS_RETURN_IF_ERROR(Walk(v->items[i], path, depth + 1, &child, &child_keep));
      path->pop_back();
      out->push_back(child_keep ? std::move(child) : json(nullptr));  // keep list positions
      any_kept |= child_keep;
    }
    *keep = any_kept;
    return Status::OK();
  }
  return WalkOpaque(v, path, depth, out);
}

// Values that are not containers: scalars become JSON, unknown objects become an inspectable
// {"$class", "args", "state"} node. Tensors inside an opaque call's arguments are not served.
Status TorchZipReader::WalkOpaque(const PyValue* v, std::vector<PathElement>* path, int depth, json* out) {
  if (depth > kMaxDepth) return Bad("objects nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  switch (v->kind) {
    case Kind::kNone: *out = nullptr; return Status::OK();
    case Kind::kBool: *out = v->b; return Status::OK();
    case Kind::kInt: *out = v->i; return Status::OK();
    case Kind::kBigInt: *out = json{{"$int", v->s}}; return Status::OK();
    case Kind::kFloat:
      if (std::isfinite(v->f)) *out = v->f;
      else *out = std::isnan(v->f) ? "nan" : (v->f > 0 ? "inf" : "-inf");
      return Status::OK();
    case Kind::kStr: *out = v->s; return Status::OK();
    case Kind::kBytes: *out = json{{"$bytes", v->s.size()}}; return Status::OK();
    case Kind::kGlobal: *out = json{{"$global", QualifiedName(v)}}; return Status::OK();
    case Kind::kPersistent: {
      json pid;
      std::vector<PathElement> none;
      CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->args, &none, depth + 1, &pid));
      *out = json{{"$persistent_id", std::move(pid)}};
      return Status::OK();
    }
    case Kind::kTuple: case Kind::kList: case Kind::kSet: case Kind::kDict: {
      // Containers met inside an opaque call: record them without serving tensors.
      *out = v->kind == Kind::kDict ? json::object() : json::array();
      for (const PyValue* item : v->items) {
        json child;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(item, path, depth + 1, &child));
        out->push_back(std::move(child));
      }
      for (const auto& [k, val] : v->entries) {
        json key, child;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(k, path, depth + 1, &key));
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(val, path, depth + 1, &child));
        (*out)[key.is_string() ? key.get<std::string>() : key.dump()] = std::move(child);
      }
      return Status::OK();
    }
    case Kind::kObject: break;
  }
  const std::string cls = v->CallableName();
  if (cls == "torch.Size") {
    std::vector<uint64_t> dims;
    if (AsUintTuple(v, &dims)) { *out = dims; return Status::OK(); }
  }
  if (cls == "torch.device" && Arg(v, 0) && Arg(v, 0)->kind == Kind::kStr) {
    *out = Arg(v, 0)->s;
    return Status::OK();
  }
  TensorEntry t;
  bool is_tensor = false;
  CKPTFS_RETURN_IF_ERROR(AsTensor(v, depth, &t, &is_tensor));
  if (is_tensor) {
    *out = json{{"$tensor_not_served", {{"dtype", Info(t.dtype).torch_name}, {"shape", t.shape}}}};
    return Status::OK();
  }
  *out = json::object();
  if (!cls.empty()) (*out)["$class"] = cls;
  else if (v->callable) {
    json callable;
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->callable, path, depth + 1, &callable));
    (*out)["$call"] = std::move(callable);
  }
  if (v->args) CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->args, path, depth + 1, &(*out)["args"]));
  if (v->kwargs) CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->kwargs, path, depth + 1, &(*out)["kwargs"]));
  if (v->state) {
    // Attributes (argparse.Namespace, dataclasses) are walked like a dict: tensors
    // kept there are served under the object's key.
    bool keep;
    CKPTFS_RETURN_IF_ERROR(Walk(v->state, path, depth + 1, &(*out)["state"], &keep));
    if (!keep) out->erase("state");
  }
  if (!v->items.empty() || !v->entries.empty()) {
    PyValue rest;
    rest.kind = Kind::kDict;
    rest.items = v->items;
    rest.entries = v->entries;
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(&rest, path, depth + 1, &(*out)["items"]));
  }
  return Status::OK();
}

Status ReadTorchZip(const std::string& path, Catalog* catalog, json* metadata) {
  TorchZipReader reader(path, catalog);
  return reader.Read(metadata);
}

}  // namespace ckptfs
