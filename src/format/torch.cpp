// Reader for plain torch.save checkpoints (torch >= 1.6): the pickled object is walked,
// tensors become catalog tensors, containers are flattened to dotted keys, and every other
// value becomes JSON metadata.
// The flattening (FlattenTorchObject) is shared with the readers of legacy streams and
// TorchScript archives, which resolve storages their own way.
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include <xxhash.h>

#include "format/limit_hint.hpp"
#include "format/readers.hpp"
#include "format/torch_archive.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// Real checkpoints nest a handful of levels; deeper means a cycle or an attack.
constexpr int kMaxDepth = 256;

// Flattens one torch pickle's object; its tensors resolve through `storages`.
class TorchZipReader {
 public:
  TorchZipReader(const StorageResolver& storages, Catalog* catalog, const ReadLimits& limits)
      : storages_(storages), path_(storages.path()), catalog_(catalog), limits_(limits) {}

  Status Read(const PyValue* root, size_t value_count, json* metadata);

 private:
  Status Walk(const PyValue* v, std::vector<PathElement>* path, int depth, json* out, bool* keep);
  Status WalkOpaque(const PyValue* v, std::vector<PathElement>* path, int depth, json* out);
  Status AddTensor(TensorEntry t, const std::vector<PathElement>& path);
  Status Bad(const std::string& what) const { return Status::Corruption(path_, what); }
  // Memo references make the object graph a DAG: a pickle of a few KB can reference one
  // list from two places at each of 200 levels, 2^200 paths. Every node visit is charged.
  Status Visit() {
    if (visits_left_ == 0)
      return Status::Refused(path_, "the pickled objects reference each other so often that flattening them "
                                    "would visit more than " + std::to_string(visit_budget_) + " nodes");
    --visits_left_;
    return Status::OK();
  }

  const StorageResolver& storages_;
  std::string path_;  // how messages name the archive
  Catalog* catalog_;
  ReadLimits limits_;
  uint64_t visit_budget_ = 0, visits_left_ = 0;
};

}  // namespace

Status TorchZipReader::Read(const PyValue* root, size_t value_count, json* metadata) {
  // A tree visits each value once; tied weights and shared configs add a little.
  visit_budget_ = visits_left_ = 4 * static_cast<uint64_t>(value_count) + 1'000'000;
  const size_t first_tensor = catalog_->tensors.size();
  std::vector<PathElement> path;
  bool keep = false;
  CKPTFS_RETURN_IF_ERROR(Walk(root, &path, 0, metadata, &keep));
  if (!keep) *metadata = json::object();
  // Two tensors whose paths flatten to one key (e.g. {"a.b": x, "a": {"b": y}}) cannot
  // both be served. Found by sorting (hash of key, tensor) pairs and comparing keys only
  // within a run of equal hashes: a set of a million keys was ~50 MB at the parse's peak.
  std::vector<std::pair<uint64_t, size_t>> keys;
  keys.reserve(catalog_->tensors.size() - first_tensor);
  for (size_t i = first_tensor; i < catalog_->tensors.size(); ++i)
    keys.emplace_back(XXH3_64bits(catalog_->tensors[i].key.data(), catalog_->tensors[i].key.size()), i);
  std::sort(keys.begin(), keys.end());
  for (size_t k = 0; k < keys.size();) {
    size_t end = k + 1;
    while (end < keys.size() && keys[end].first == keys[k].first) ++end;
    for (size_t a = k; a < end; ++a)
      for (size_t b = a + 1; b < end; ++b)
        if (catalog_->tensors[keys[a].second].key == catalog_->tensors[keys[b].second].key)
          return Status::NotSupported(
              path_, "two tensors flatten to the same key '" + catalog_->tensors[keys[std::max(a, b)].second].key + "'");
    k = end;
  }
  return Status::OK();
}

Status TorchZipReader::AddTensor(TensorEntry t, const std::vector<PathElement>& path) {
  if (catalog_->tensors.size() >= limits_.tensors)
    return Status::Refused(path_, "more than " + std::to_string(limits_.tensors) + " tensors" + LimitHint("max_tensors"));
  t.path = path;
  t.key = path.empty() ? "tensor" : FlattenKey(path);
  catalog_->tensors.push_back(std::move(t));
  return Status::OK();
}

Status TorchZipReader::Walk(const PyValue* v, std::vector<PathElement>* path, int depth, json* out, bool* keep) {
  CKPTFS_RETURN_IF_ERROR(Visit());
  if (depth > kMaxDepth) return Bad("objects nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  *keep = true;
  TensorEntry t;
  bool is_tensor = false;
  CKPTFS_RETURN_IF_ERROR(RebuildTensor(v, storages_, &t, &is_tensor));
  if (is_tensor) {
    *keep = false;
    return AddTensor(std::move(t), *path);
  }

  // Mappings: dict, OrderedDict(...) with items, and BUILD-wrapped dicts.
  if (const PyValue* mapping = AsMapping(v)) {
    *out = json::object();
    bool dropped = false;
    for (const auto& [k, val] : mapping->entries()) {
      PathElement elem;
      if (k->kind() == Kind::kStr) elem = std::string(k->s());
      else if (k->kind() == Kind::kInt) elem = k->i();
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
  if (v->kind() == Kind::kList || v->kind() == Kind::kTuple || v->kind() == Kind::kSet) {
    *out = json::array();
    bool any_kept = v->items().empty();
    for (size_t i = 0; i < v->items().size(); ++i) {
      path->push_back(static_cast<int64_t>(i));
      json child;
      bool child_keep;
      CKPTFS_RETURN_IF_ERROR(Walk(v->items()[i], path, depth + 1, &child, &child_keep));
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
  CKPTFS_RETURN_IF_ERROR(Visit());
  if (depth > kMaxDepth) return Bad("objects nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  switch (v->kind()) {
    case Kind::kNone: *out = nullptr; return Status::OK();
    case Kind::kBool: *out = v->b(); return Status::OK();
    case Kind::kInt: *out = v->i(); return Status::OK();
    case Kind::kBigInt: *out = json{{"$int", v->s()}}; return Status::OK();
    case Kind::kFloat:
      if (std::isfinite(v->f())) *out = v->f();
      else *out = std::isnan(v->f()) ? "nan" : (v->f() > 0 ? "inf" : "-inf");
      return Status::OK();
    case Kind::kStr: *out = v->s(); return Status::OK();
    case Kind::kBytes: *out = json{{"$bytes", v->s().size()}}; return Status::OK();
    case Kind::kGlobal: *out = json{{"$global", QualifiedName(v)}}; return Status::OK();
    case Kind::kPersistent: {
      json pid;
      std::vector<PathElement> none;
      CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->args(), &none, depth + 1, &pid));
      *out = json{{"$persistent_id", std::move(pid)}};
      return Status::OK();
    }
    case Kind::kTuple: case Kind::kList: case Kind::kSet: case Kind::kDict: {
      // Containers met inside an opaque call: record them without serving tensors.
      *out = v->kind() == Kind::kDict ? json::object() : json::array();
      for (const PyValue* item : v->items()) {
        json child;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(item, path, depth + 1, &child));
        out->push_back(std::move(child));
      }
      for (const auto& [k, val] : v->entries()) {
        json key, child;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(k, path, depth + 1, &key));
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(val, path, depth + 1, &child));
        // A key's JSON text may hold strings that are not UTF-8: dump() would throw.
        (*out)[key.is_string() ? key.get<std::string>() : key.dump(-1, ' ', false, json::error_handler_t::replace)] =
            std::move(child);
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
  if (cls == "torch.device" && Arg(v, 0) && Arg(v, 0)->kind() == Kind::kStr) {
    *out = Arg(v, 0)->s();
    return Status::OK();
  }
  TensorEntry t;
  bool is_tensor = false;
  CKPTFS_RETURN_IF_ERROR(RebuildTensor(v, storages_, &t, &is_tensor));
  if (is_tensor) {
    *out = json{{"$tensor_not_served", {{"dtype", Info(t.dtype).torch_name}, {"shape", t.shape}}}};
    return Status::OK();
  }
  *out = json::object();
  if (!cls.empty()) (*out)["$class"] = cls;
  else if (v->callable()) {
    json callable;
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->callable(), path, depth + 1, &callable));
    (*out)["$call"] = std::move(callable);
  }
  if (v->args()) CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->args(), path, depth + 1, &(*out)["args"]));
  if (v->kwargs()) CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->kwargs(), path, depth + 1, &(*out)["kwargs"]));
  if (v->state()) {
    // Attributes (argparse.Namespace, dataclasses) are walked like a dict: tensors
    // kept there are served under the object's key.
    bool keep;
    CKPTFS_RETURN_IF_ERROR(Walk(v->state(), path, depth + 1, &(*out)["state"], &keep));
    if (!keep) out->erase("state");
  }
  // Set items (SETITEMS on the object: a dict subclass) go under "items" as a mapping,
  // appended items (APPENDS: a list subclass) under "appended" as a list. They must not share
  // one synthetic dict: pushing list items into a JSON object throws, which escaped the
  // reader as an uncaught exception (found by fuzz_torch, tests/fuzz/regressions/torch/).
  if (!v->entries().empty()) {
    const PyValue rest = PyValue::DictOf(v->entries());
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(&rest, path, depth + 1, &(*out)["items"]));
  }
  if (!v->items().empty()) {
    const PyValue rest = PyValue::ListOf(v->items());
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(&rest, path, depth + 1, &(*out)["appended"]));
  }
  return Status::OK();
}

Status FlattenTorchObject(const PyValue* root, size_t value_count, const StorageResolver& storages,
                          Catalog* catalog, const ReadLimits& limits, json* metadata) {
  TorchZipReader reader(storages, catalog, limits);
  return reader.Read(root, value_count, metadata);
}

namespace {

Status ReadTorchZipIn(const FileWindow& window, Catalog* catalog, json* metadata, const ReadLimits& limits,
                      ZipArchive* opened) {
  TorchArchive archive;
  CKPTFS_RETURN_IF_ERROR(archive.Open(*catalog->files, window, limits, ArchiveRecords{}, nullptr, {}, opened));
  // About one tensor per stored record: reserved, the catalog is not copied as it grows
  // (a million tensors' vector held its old and new copies, ~260 MB, at the parse's peak).
  catalog->tensors.reserve(catalog->tensors.size() +
                           std::min<size_t>(archive.zip().entries().size(), limits.tensors));
  return FlattenTorchObject(archive.root(), archive.value_count(), archive, catalog, limits, metadata);
}

}  // namespace

Status ReadTorchZip(const FileWindow& window, Catalog* catalog, json* metadata, const ReadLimits& limits) {
  return ReadTorchZipIn(window, catalog, metadata, limits, nullptr);
}

Status ReadTorchZip(const std::string& path, Catalog* catalog, json* metadata, const ReadLimits& limits,
                    ZipArchive* opened) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  return ReadTorchZipIn(catalog->files->whole(file), catalog, metadata, limits, opened);
}

}  // namespace ckptfs
