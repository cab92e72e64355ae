#include "format/torch/torch_archive.hpp"

#include "codec/byte_reader.hpp"
#include "format/readers.hpp"

namespace ckptfs {
namespace {

using Kind = PyValue::Kind;

// Tensor rebuild calls nest a few levels (parameter -> subclass -> tensor).
constexpr int kMaxTensorDepth = 16;

}  // namespace

// "module.name" of a GLOBAL, without allocating.
bool IsGlobal(const PyValue* g, std::string_view qualified) {
  return g && g->kind() == Kind::kGlobal && qualified.size() == g->s().size() + 1 + g->name().size() &&
         qualified.substr(0, g->s().size()) == g->s() && qualified[g->s().size()] == '.' &&
         qualified.substr(g->s().size() + 1) == g->name();
}

bool IsCall(const PyValue* v, std::string_view qualified) {
  return v->kind() == Kind::kObject && IsGlobal(v->callable(), qualified);
}

std::string QualifiedName(const PyValue* g) { return std::string(g->s()) + "." + std::string(g->name()); }

const PyValue* Arg(const PyValue* call, size_t i) {
  if (!call->args() || call->args()->kind() != Kind::kTuple || i >= call->args()->items().size()) return nullptr;
  return call->args()->items()[i];
}

bool AsUint(const PyValue* v, uint64_t* out) {
  if (!v || v->kind() != Kind::kInt || v->i() < 0) return false;
  *out = static_cast<uint64_t>(v->i());
  return true;
}

namespace {

template <typename Dims>
bool AsUints(const PyValue* v, Dims* out) {
  if (v && IsCall(v, "torch.Size")) v = Arg(v, 0);
  if (!v || (v->kind() != Kind::kTuple && v->kind() != Kind::kList)) return false;
  out->clear();
  out->reserve(v->items().size());
  for (const PyValue* item : v->items()) {
    uint64_t x;
    if (!AsUint(item, &x)) return false;
    out->push_back(x);
  }
  return true;
}

}  // namespace

bool AsUintTuple(const PyValue* v, std::vector<uint64_t>* out) { return AsUints(v, out); }
bool AsUintTuple(const PyValue* v, Shape* out) { return AsUints(v, out); }
bool AsUintTuple(const PyValue* v, BoxDims* out) { return AsUints(v, out); }

const PyValue* AsMapping(const PyValue* v) {
  if (!v) return nullptr;
  if (v->kind() == Kind::kDict) return v;
  if (IsCall(v, "collections.OrderedDict") || IsCall(v, "collections.defaultdict") || IsCall(v, "__builtin__.dict") ||
      IsCall(v, "builtins.dict"))
    return v;
  // State set on a plain dict by BUILD (state_dict()._metadata): the dict is the argument.
  if (v->kind() == Kind::kObject && v->callable() && v->callable()->kind() == Kind::kNone && v->args() &&
      v->args()->kind() == Kind::kDict)
    return v->args();
  return nullptr;
}

const PyValue* Find(const PyValue* mapping, std::string_view key) {
  if (!mapping) return nullptr;
  for (const auto& [k, v] : mapping->entries())
    if (k->kind() == Kind::kStr && k->s() == key) return v;
  return nullptr;
}

Status TorchArchive::Open(const std::string& path, SourceFiles* files, const ReadLimits& limits) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(files->Add(path, &file));
  return Open(*files, files->whole(file), limits);
}

std::shared_ptr<const Pickle> PickleCache::Find(std::string_view bytes) const {
  auto it = by_bytes_.find(bytes);
  return it == by_bytes_.end() ? nullptr : it->second;
}

void PickleCache::Insert(std::string bytes, std::shared_ptr<const Pickle> pickle) {
  if (bytes.size() > kMaxPickleBytes || by_bytes_.size() >= kMaxEntries) return;
  by_bytes_.emplace(std::move(bytes), std::move(pickle));
}

Status TorchArchive::Open(const SourceFiles& files, FileWindow window, const ReadLimits& limits,
                          const ArchiveRecords& records, PickleCache* cache, std::string_view window_bytes,
                          ZipArchive* opened, PickleCallHook* hook) {
  path_ = files.Describe(window);
  files_ = &files;
  window_ = window;
  // An archive may be reopened on another window (a DCP reader's million chunks).
  pickle_.reset();
  pickle_entry_ = nullptr;
  streamed_ = released_ = false;
  limits_ = limits;
  next_record_ = 0;
  // A torch archive holds one record per storage plus a few: the tensor limit bounds it.
  const uint64_t max_entries = limits.tensors + 1024;
  max_entries_ = max_entries;
  const bool same_window = opened && opened->window().file == window.file &&
                           opened->window().base == window.base && opened->window().length == window.length;
  // A directory over this reader's entry limit is read again so that the limit's own
  // message reports it.
  if (same_window && !opened->entries().empty() && opened->entries().size() <= max_entries)
    zip_ = std::move(*opened);
  else
    CKPTFS_RETURN_IF_ERROR(zip_.Open(files, window, max_entries, window_bytes));
  if (zip_.entries().empty()) return Bad("zip archive has no entries");
  // torch takes the archive folder from the first central-directory entry.
  const std::string_view first = zip_.entries().front().name;
  size_t slash = first.find('/');
  if (slash == std::string::npos) return Bad("not a torch.save archive: '" + std::string(first) + "' is not in a folder");
  prefix_ = std::string(first.substr(0, slash + 1));
  if (!records.torchscript && zip_.Find(prefix_ + "constants.pkl"))
    return Status::NotSupported(path_, "TorchScript archive (torch.jit.save) read as a torch.save checkpoint");
  storage_dir_ = records.storage_dir;
  storage_records_ = 0;
  const std::string storage_prefix = prefix_ + storage_dir_;
  for (const ZipEntry& e : zip_.entries())
    if (e.name.size() > storage_prefix.size() && std::string_view(e.name).starts_with(storage_prefix)) ++storage_records_;
  const ZipEntry* pkl = nullptr;
  if (!records.pickle.empty()) {
    pkl = zip_.Find(prefix_ + records.pickle);
    if (!pkl) return Bad("not a torch.save archive: no " + prefix_ + records.pickle);
  }
  if (const ZipEntry* order = zip_.Find(prefix_ + "byteorder")) {
    std::string value;
    CKPTFS_RETURN_IF_ERROR(zip_.ReadStored(*order, 16, &value));
    if (value == "big") return Status::NotSupported(path_, "big-endian checkpoint (byteorder record says 'big')");
    if (value != "little") return Bad("byteorder record holds '" + value + "'; expected 'little' or 'big'");
  }
  checked_.assign(zip_.entries().size(), false);
  recent_offsets_.clear();
  // Storage ids name the file, the window and the record, so two archives in one file (or
  // a TorchScript archive's data/ and constants/ records) never share one.
  storage_id_prefix_ = std::to_string(window_.file) + ":" + std::to_string(window_.base) + ":";
  if (storage_dir_ != "data/") storage_id_prefix_ += storage_dir_;
  if (!pkl) return Status::OK();
  pickle_entry_ = pkl;
  pickle_name_ = prefix_ + records.pickle;
  return ParseObject(cache, hook);
}

void TorchArchive::ReleaseDirectory() {
  zip_ = ZipArchive();
  checked_ = std::vector<bool>();
  recent_offsets_ = std::vector<RecentOffset>();
  pickle_entry_ = nullptr;
  released_ = true;
}

Status TorchArchive::ParseAgain() {
  pickle_.reset();
  if (released_) {
    CKPTFS_RETURN_IF_ERROR(zip_.Open(*files_, window_, max_entries_));
    checked_.assign(zip_.entries().size(), false);
    recent_offsets_.clear();
    next_record_ = 0;
    pickle_entry_ = zip_.Find(pickle_name_);
    if (!pickle_entry_) return Bad("not a torch.save archive: no " + pickle_name_);
    released_ = false;
  }
  if (!pickle_entry_) return Status::OK();
  return ParseObject(nullptr, nullptr);
}

Status TorchArchive::ParseObject(PickleCache* cache, PickleCallHook* hook) {
  const ZipEntry* pkl = pickle_entry_;
  std::string pickle_bytes;
  if (pkl->uncompressed_size > limits_.pickle_bytes)
    return Status::Refused(path_, pickle_name_ + " is " + std::to_string(pkl->uncompressed_size) +
                                      " bytes, over the limit of " + std::to_string(limits_.pickle_bytes))
                                          .WithLimitOption("max_pickle");
  if (hook) {
    // Read a window at a time, as the parse goes.
    if (pkl->method != ZipArchive::kMethodStored)
      return zip_.ReadStored(*pkl, limits_.pickle_bytes, &pickle_bytes);  // its error
    uint64_t data_offset = 0;
    CKPTFS_RETURN_IF_ERROR(zip_.DataOffset(*pkl, &data_offset));
    PickleSource source;
    source.size = pkl->uncompressed_size;
    source.read = [this, data_offset](uint64_t offset, size_t length, char* out) {
      return files_->ReadExact(window_.file, data_offset + offset, length, out);
    };
    streamed_ = true;
    auto parsed = std::make_shared<Pickle>();
    CKPTFS_RETURN_IF_ERROR(
        ParsePickleStreamed(source, path_ + ": " + pickle_name_, hook, parsed.get(), limits_.pickle_memory));
    pickle_ = std::move(parsed);
    return Status::OK();
  }
  CKPTFS_RETURN_IF_ERROR(zip_.ReadStored(*pkl, limits_.pickle_bytes, &pickle_bytes));
  pickle_ = cache ? cache->Find(pickle_bytes) : nullptr;
  if (!pickle_) {
    auto parsed = std::make_shared<Pickle>();
    // The pickle keeps the bytes its strings point into: hand them over rather than copy
    // (a million-tensor data.pkl is a few hundred MB). The cache keeps its own small key.
    std::string cache_key;
    if (cache && pickle_bytes.size() <= PickleCache::kMaxPickleBytes) cache_key = pickle_bytes;
    CKPTFS_RETURN_IF_ERROR(ParseOwnedPickle(std::move(pickle_bytes), path_ + ": " + pickle_name_, parsed.get(),
                                            limits_.pickle_memory));
    pickle_ = parsed;
    if (cache && !cache_key.empty()) cache->Insert(std::move(cache_key), std::move(parsed));
  }
  return Status::OK();
}


Status ParseStoragePid(const PyValue* pid, std::optional<DType> tensor_dtype, const std::string& where,
                       StoragePid* out) {
  // ('storage', <storage class>, key, location, numel[, view]); numel counts elements for
  // typed storages and bytes for UntypedStorage.
  if (!pid || pid->kind() != Kind::kPersistent || !pid->args() || pid->args()->kind() != Kind::kTuple ||
      pid->args()->items().size() < 5)
    return Status::Corruption(where, "tensor storage is not a ('storage', ...) persistent id");
  const auto& f = pid->args()->items();
  uint64_t numel;
  if (f[0]->kind() != Kind::kStr || f[0]->s() != "storage" || f[1]->kind() != Kind::kGlobal ||
      f[2]->kind() != Kind::kStr || !AsUint(f[4], &numel))
    return Status::Corruption(where, "malformed storage persistent id");
  out->key = f[2]->s();
  out->numel = numel;
  out->view = f.size() > 5 && f[5]->kind() != Kind::kNone ? f[5] : nullptr;
  out->itemsize = 1;
  if (f[1]->name() == "UntypedStorage") {
    if (!tensor_dtype)
      return Status::Corruption(where, "storage '" + std::string(out->key) + "' is untyped but the tensor names no dtype");
    out->dtype = *tensor_dtype;
  } else {
    auto sd = DTypeFromStorageClass(f[1]->name());
    if (!sd) return Status::NotSupported(where, "storage class " + QualifiedName(f[1]) + " is not supported");
    out->dtype = tensor_dtype ? *tensor_dtype : *sd;
    out->itemsize = Info(*sd).itemsize;
  }
  if (!CheckedMul(numel, out->itemsize, &out->nbytes))
    return Status::Corruption(where, "storage '" + std::string(out->key) + "' size overflows");
  return Status::OK();
}

Status TorchArchive::Resolve(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype,
                             std::string* storage_id, StorageBytes* bytes) const {
  if (released_) return Bad("internal: a storage looked up after the zip directory was released");
  StoragePid parsed;
  CKPTFS_RETURN_IF_ERROR(ParseStoragePid(pid, tensor_dtype, path_, &parsed));
  if (parsed.view) return Status::NotSupported(path_, "storage view persistent id in a zip archive");
  *dtype = parsed.dtype;
  const uint64_t nbytes = parsed.nbytes;
  const std::string_view key = parsed.key;

  record_name_.assign(prefix_).append(storage_dir_).append(key);
  // torch.save writes the records in the order the pickle references their storages: try
  // the entry after the last one found before hashing the name (a million lookups in a
  // million-entry table are a million cache misses).
  const auto& entries = zip_.entries();
  const ZipEntry* e = next_record_ < entries.size() && entries[next_record_].name == record_name_
                          ? &entries[next_record_]
                          : zip_.Find(record_name_);
  if (e) next_record_ = static_cast<size_t>(e - entries.data()) + 1;
  if (!e)
    return Bad("the pickle references storage '" + std::string(key) + "' but the archive has no record " + record_name_);
  const size_t index = static_cast<size_t>(e - entries.data());
  uint64_t data_offset = 0;
  if (!checked_[index]) {
    const std::string& name = record_name_;
    if (e->method != ZipArchive::kMethodStored)
      return Status::NotSupported(path_, "record " + name + " is compressed (method " + std::to_string(e->method) +
                                             "); tensor data must be stored uncompressed");
    if (e->uncompressed_size != nbytes)
      return Bad("record " + name + " holds " + std::to_string(e->uncompressed_size) + " bytes but the pickle says " +
                 std::to_string(nbytes));
    CKPTFS_RETURN_IF_ERROR(zip_.DataOffset(*e, &data_offset));
    checked_[index] = true;
  } else if (e->uncompressed_size != nbytes) {
    // The first reference matched the record's size: this one differs from it.
    return Bad("storage '" + std::string(key) + "' is referenced with two different sizes");
  } else {
    CKPTFS_RETURN_IF_ERROR(RecordDataOffset(index, &data_offset));
  }
  bytes->file = window_.file;
  bytes->data_offset = data_offset;
  bytes->nbytes = nbytes;
  bytes->key = parsed.key;
  storage_id->assign(storage_id_prefix_).append(key);
  return Status::OK();
}

Status TorchArchive::RecordDataOffset(size_t index, uint64_t* offset) const {
  if (recent_offsets_.empty()) recent_offsets_.resize(kRecentOffsets);
  RecentOffset& slot = recent_offsets_[index % kRecentOffsets];
  if (slot.entry != index) {
    CKPTFS_RETURN_IF_ERROR(zip_.DataOffset(zip_.entries()[index], &slot.data_offset));
    slot.entry = index;
  }
  *offset = slot.data_offset;
  return Status::OK();
}

Status PlaceStridedTensor(const StorageBytes& rec, uint64_t offset, BoxDims stride, const std::string& where,
                          TensorEntry* t) {
  auto Bad = [&](const std::string& what) { return Status::Corruption(where, what); };
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
    return Bad("tensor reads past the end of storage '" + std::string(rec.key) + "' (" + std::to_string(rec.nbytes) +
               " bytes)");
  if (numel > 0) {
    const uint64_t base = rec.data_offset + offset * itemsize;
    if (contiguous) {
      t->boxes.push_back(Box::Range(rec.file, base, 0, numel));
    } else {
      t->boxes.push_back(Box::Strided(rec.file, base, t->shape, std::move(stride)));
    }
  }
  return Status::OK();
}

namespace {

Status RebuildTensorAt(const PyValue* v, const StorageResolver& storages, int depth, TensorEntry* t,
                       bool* is_tensor);

}  // namespace

Status RebuildTensor(const PyValue* v, const StorageResolver& storages, TensorEntry* t, bool* is_tensor) {
  return RebuildTensorAt(v, storages, 0, t, is_tensor);
}

namespace {

Status RebuildTensorAt(const PyValue* v, const StorageResolver& storages, int depth, TensorEntry* t,
                       bool* is_tensor) {
  const std::string& where = storages.path();
  auto Bad = [&](const std::string& what) { return Status::Corruption(where, what); };
  *is_tensor = false;
  if (v->kind() == Kind::kTaken) {
    // A rebuild call a streamed parse already made a tensor of.
    const TensorEntry* taken = storages.Taken(v->taken());
    if (!taken) return Status::OK();
    t->dtype = taken->dtype;
    t->shape = taken->shape;
    t->boxes = taken->boxes;
    t->storage_id = taken->storage_id;
    *is_tensor = true;
    return Status::OK();
  }
  if (v->kind() != Kind::kObject || depth > kMaxTensorDepth || !v->callable() || v->callable()->kind() != Kind::kGlobal)
    return Status::OK();
  const PyValue* callable = v->callable();
  if (IsGlobal(callable, "torch._utils._rebuild_parameter") ||
      IsGlobal(callable, "torch._utils._rebuild_parameter_with_state")) {
    const PyValue* data = Arg(v, 0);
    return data ? RebuildTensorAt(data, storages, depth + 1, t, is_tensor) : Status::OK();
  }
  if (IsGlobal(callable, "torch._tensor._rebuild_from_type_v2")) {
    // (func, new_type, args, state): the tensor is func(*args), then retyped.
    const PyValue* func = Arg(v, 0);
    const PyValue* args = Arg(v, 2);
    if (!func || !args) return Status::OK();
    PyObjectBody body{const_cast<PyValue*>(func), const_cast<PyValue*>(args)};
    const PyValue call = PyValue::CallOf(&body);
    return RebuildTensorAt(&call, storages, depth + 1, t, is_tensor);
  }
  const bool v2 = IsGlobal(callable, "torch._utils._rebuild_tensor_v2");
  const bool v3 = IsGlobal(callable, "torch._utils._rebuild_tensor_v3");
  if (!v2 && !v3 && !IsGlobal(callable, "torch._utils._rebuild_tensor")) return Status::OK();

  // (storage, storage_offset, size, stride, requires_grad, hooks[, dtype (v3)][, metadata])
  std::optional<DType> tensor_dtype;
  if (v3) {
    const PyValue* d = Arg(v, 6);
    if (!d || d->kind() != Kind::kGlobal || d->s() != "torch" || !(tensor_dtype = DTypeFromTorchName(d->name())))
      return Status::NotSupported(where, "tensor with an unsupported dtype " + (d && d->kind() == Kind::kGlobal ? QualifiedName(d) : std::string("?")));
  }
  uint64_t offset;
  BoxDims stride;
  if (!AsUint(Arg(v, 1), &offset) || !AsUintTuple(Arg(v, 2), &t->shape))
    return Bad("tensor rebuild call has a malformed offset or size");
  if (!AsUintTuple(Arg(v, 3), &stride) || stride.size() != t->shape.size())
    return Status::NotSupported(where, "tensor with negative or malformed strides");
  StorageBytes rec;
  CKPTFS_RETURN_IF_ERROR(storages.Resolve(Arg(v, 0), tensor_dtype, &t->dtype, &t->storage_id, &rec));
  CKPTFS_RETURN_IF_ERROR(PlaceStridedTensor(rec, offset, std::move(stride), where, t));
  *is_tensor = true;
  return Status::OK();
}

}  // namespace

Status TorchZipKind(const std::string& path, SourceFiles* files, std::string* kind, ZipArchive* zip) {
  *kind = "torch-zip";
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(files->Add(path, &file));
  // A damaged zip is the torch.save reader's to report.
  if (!zip->Open(*files, files->whole(file)).ok() || zip->entries().empty()) {
    *zip = ZipArchive();
    return Status::OK();
  }
  const std::string_view first = zip->entries().front().name;
  const size_t slash = first.find('/');
  if (slash == std::string::npos) return Status::OK();
  const std::string prefix(first.substr(0, slash + 1));
  if (zip->Find(prefix + "constants.pkl")) *kind = "torchscript";
  else if (zip->Find(prefix + "archive_format") && !zip->Find(prefix + "data.pkl")) *kind = "torch-export";
  return Status::OK();
}

Status IsTorchZipOfKind(SourceProbe& probe, std::string_view kind, bool* is_kind) {
  *is_kind = false;
  bool zip = false;
  if (probe.is_file()) CKPTFS_RETURN_IF_ERROR(probe.HeadStartsWith(std::string_view("PK\x03\x04", 4), &zip));
  if (!zip) return Status::OK();
  std::string_view found;
  CKPTFS_RETURN_IF_ERROR(probe.TorchZipKind(&found));
  *is_kind = found == kind;
  return Status::OK();
}

}  // namespace ckptfs
