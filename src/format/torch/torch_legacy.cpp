// Reader for the legacy torch.save stream: the default of torch < 1.6, still written with
// torch.save(..., _use_new_zipfile_serialization=False). Layout (doc/FORMATS.md, "Legacy
// torch.save streams"): five pickles in a row (magic number, protocol version, system info,
// the saved object, the sorted list of storage keys), then for each key in that order an
// 8-byte little-endian element count and the storage's raw bytes.
//
// Only the pickles are read. Storage offsets come from walking the 8-byte counts, seeking
// over the data, so listing a 1 GB file reads a few KB of it; the saved object is then
// flattened exactly as a torch.save zip's data.pkl is (FlattenTorchObject).
#include <algorithm>
#include <string>
#include <unordered_map>

#include "format/readers.hpp"
#include "format/torch/torch_archive.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// torch.serialization.MAGIC_NUMBER (0x1950a86a20f9469cfc6c) as the pickle machine renders an
// int wider than 64 bits, and PROTOCOL_VERSION.
constexpr std::string_view kMagicNumber = "0x1950a86a20f9469cfc6c";
constexpr int64_t kProtocolVersion = 1001;
// Pickles are read from a window of the file that doubles until the pickle fits: the
// object pickle of a large checkpoint is a few hundred KB, the others a few bytes.
constexpr uint64_t kFirstWindow = 4096;

class LegacyReader : public StorageResolver {
 public:
  LegacyReader(Catalog* catalog, uint32_t file, const ReadLimits& limits)
      : catalog_(catalog), file_(file), path_(catalog->files->Describe(catalog->files->whole(file))),
        limits_(limits), size_(catalog->files->size(file)) {}

  Status Read(json* metadata);

  Status Resolve(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype, std::string* storage_id,
                 StorageBytes* bytes) const override;
  const std::string& path() const override { return path_; }

 private:
  struct Storage {
    // (element size of the storage class, element count) of each distinct way persistent
    // ids name the storage: torch writes the count in the element size of the first.
    std::vector<std::pair<uint64_t, uint64_t>> names;
    uint64_t nbytes = 0;
    uint64_t data_offset = 0;
    bool located = false;
  };
  Status Bad(const std::string& what) const { return Status::Corruption(path_, what); }
  // Parses the pickle that starts at byte `offset`; *end receives the byte after its STOP.
  Status ReadPickleAt(uint64_t offset, std::string_view what, Pickle* out, uint64_t* end);
  // Bytes [offset, offset + length) of the file. The pickles lie back to back: each byte
  // before the storages is read once, into head_.
  Status Head(uint64_t offset, uint64_t length, std::string_view* out);
  Status CheckHeader(uint64_t* offset);
  // Every storage persistent id the object pickle holds, by key.
  Status CollectStorages(const PyValue* root);
  // Walks the storage records after the key list, recording where each storage's bytes lie.
  Status LocateStorages(const PyValue* keys, uint64_t offset);

  Catalog* catalog_;
  uint32_t file_;
  std::string path_;
  ReadLimits limits_;
  uint64_t size_;
  std::string head_;  // bytes [head_start_, head_start_ + head_.size()) of the file
  uint64_t head_start_ = 0;
  Pickle object_;
  std::unordered_map<std::string_view, Storage> storages_;
};

Status LegacyReader::Head(uint64_t offset, uint64_t length, std::string_view* out) {
  if (offset < head_start_ || offset > head_start_ + head_.size()) {
    head_.clear();
    head_start_ = offset;
  }
  const uint64_t have_end = head_start_ + head_.size();
  if (offset + length > have_end) {  // callers keep offset + length <= size_
    const uint64_t missing = offset + length - have_end;
    head_.resize(head_.size() + missing);
    CKPTFS_RETURN_IF_ERROR(catalog_->files->ReadExact(file_, have_end, missing, head_.data() + (have_end - head_start_)));
  }
  *out = std::string_view(head_).substr(offset - head_start_, length);
  return Status::OK();
}

Status LegacyReader::ReadPickleAt(uint64_t offset, std::string_view what, Pickle* out, uint64_t* end) {
  const uint64_t available = size_ - offset;  // offset <= size_ always holds here
  const std::string where = path_ + ": " + std::string(what) + " (at byte " + std::to_string(offset) + ")";
  uint64_t window = std::min({kFirstWindow, available, limits_.pickle_bytes});
  for (;;) {
    std::string_view bytes;
    CKPTFS_RETURN_IF_ERROR(Head(offset, window, &bytes));
    PickleEnd pickle_end;
    Status s = ParsePickle(bytes, where, out, limits_.pickle_memory, &pickle_end);
    if (s.ok()) {
      *end = offset + pickle_end.consumed;
      return Status::OK();
    }
    if (!pickle_end.needs_more || window == available) return s;
    if (window >= limits_.pickle_bytes)
      return Status::Refused(path_, std::string(what) + " is longer than the limit of " +
                                        std::to_string(limits_.pickle_bytes) + " bytes").WithLimitOption("max_pickle");
    window = std::min({window * 2, available, limits_.pickle_bytes});
  }
}

Status LegacyReader::CheckHeader(uint64_t* offset) {
  Pickle p;
  CKPTFS_RETURN_IF_ERROR(ReadPickleAt(0, "magic number pickle", &p, offset));
  if (p.root->kind() != Kind::kBigInt || p.root->s() != kMagicNumber)
    return Bad("not a legacy torch.save file: its first pickle is not torch's magic number");
  CKPTFS_RETURN_IF_ERROR(ReadPickleAt(*offset, "protocol version pickle", &p, offset));
  if (p.root->kind() != Kind::kInt || p.root->i() != kProtocolVersion)
    return Status::NotSupported(path_, "legacy torch.save protocol version " +
                                           (p.root->kind() == Kind::kInt ? std::to_string(p.root->i()) : std::string("?")) +
                                           "; only 1001 is known");
  // {'protocol_version', 'little_endian', 'type_sizes'}. torch ignores it on load, but a
  // writer on a big-endian machine may have stored its storages in that byte order.
  CKPTFS_RETURN_IF_ERROR(ReadPickleAt(*offset, "system info pickle", &p, offset));
  const PyValue* little = Find(AsMapping(p.root), "little_endian");
  if (little && little->kind() == Kind::kBool && !little->b())
    return Status::NotSupported(path_, "legacy torch.save file written on a big-endian machine; only "
                                       "little-endian files are supported");
  return Status::OK();
}

Status LegacyReader::CollectStorages(const PyValue* root) {
  // The pickle's values form a DAG (memo references), possibly with cycles. A set of visited
  // values would cost ~50 bytes per value; the walk is bounded by the visit budget the
  // flattening itself is held to instead, and needs only its stack.
  const uint64_t budget = 4 * static_cast<uint64_t>(object_.value_count()) + 1'000'000;
  uint64_t visits = 0;
  std::vector<const PyValue*> stack = {root};
  while (!stack.empty()) {
    const PyValue* v = stack.back();
    stack.pop_back();
    if (!v) continue;
    if (++visits > budget)
      return Status::Refused(path_, "the pickled objects reference each other so often that finding their "
                                    "storages would visit more than " + std::to_string(budget) + " nodes");
    if (v->kind() == Kind::kPersistent) {
      const PyValue* pid = v->args();
      // ('module', <class>, source file, source): torch.save(model) records the source of
      // each module class; nothing to serve.
      if (pid && pid->kind() == Kind::kTuple && !pid->items().empty() && pid->items()[0]->kind() == Kind::kStr &&
          pid->items()[0]->s() == "module")
        continue;
      StoragePid parsed;
      // The tensor dtype does not matter here: only the storage class's element size does.
      CKPTFS_RETURN_IF_ERROR(ParseStoragePid(v, DType::kU8, path_, &parsed));
      auto& names = storages_[parsed.key].names;
      const std::pair<uint64_t, uint64_t> name(parsed.itemsize, parsed.numel);
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        if (names.size() >= 16) return Bad("storage '" + std::string(parsed.key) + "' is named with too many sizes");
        names.push_back(name);
      }
      continue;
    }
    // Scalars, strings and globals hold nothing.
    if (v->kind() != Kind::kTuple && v->kind() != Kind::kList && v->kind() != Kind::kSet && v->kind() != Kind::kDict &&
        v->kind() != Kind::kObject)
      continue;
    for (const PyValue* item : v->items()) stack.push_back(item);
    for (const auto& [k, val] : v->entries()) {
      stack.push_back(k);
      stack.push_back(val);
    }
    stack.push_back(v->callable());
    stack.push_back(v->args());
    stack.push_back(v->kwargs());
    stack.push_back(v->state());
  }
  return Status::OK();
}

Status LegacyReader::LocateStorages(const PyValue* keys, uint64_t offset) {
  if (!keys || keys->kind() != Kind::kList) return Bad("the storage key list pickle does not hold a list");
  if (keys->items().size() != storages_.size())
    return Bad("the storage key list names " + std::to_string(keys->items().size()) + " storages but the pickle uses " +
               std::to_string(storages_.size()));
  for (const PyValue* k : keys->items()) {
    if (k->kind() != Kind::kStr) return Bad("the storage key list holds something other than a string");
    auto it = storages_.find(k->s());
    if (it == storages_.end())
      return Bad("the storage key list names storage '" + std::string(k->s()) + "', which the pickle never uses");
    Storage& st = it->second;
    if (st.located) return Bad("the storage key list names storage '" + std::string(k->s()) + "' twice");
    // Each storage: its element count (int64, little-endian), then count * itemsize bytes.
    unsigned char header[8];
    uint64_t data_end;
    if (!CheckedAdd(offset, 8, &data_end) || data_end > size_)
      return Bad("file ends at byte " + std::to_string(size_) + " before the header of storage '" +
                 std::string(k->s()) + "' (truncated?)");
    CKPTFS_RETURN_IF_ERROR(catalog_->files->ReadExact(file_, offset, sizeof header, header));
    uint64_t count = 0;
    for (int i = 7; i >= 0; --i) count = (count << 8) | header[i];
    auto name = std::find_if(st.names.begin(), st.names.end(), [&](const auto& n) { return n.second == count; });
    if (name == st.names.end())
      return Bad("storage '" + std::string(k->s()) + "' at byte " + std::to_string(offset) + " holds " +
                 std::to_string(count) + " elements but the pickle says " + std::to_string(st.names.front().second));
    const uint64_t itemsize = name->first;
    st.data_offset = offset + 8;
    if (!CheckedMul(count, itemsize, &st.nbytes) || !CheckedAdd(st.data_offset, st.nbytes, &offset) || offset > size_)
      return Bad("storage '" + std::string(k->s()) + "' (" + std::to_string(count) + " elements of " +
                 std::to_string(itemsize) + " bytes at byte " + std::to_string(st.data_offset) +
                 ") runs past the end of the file (" + std::to_string(size_) + " bytes; truncated?)");
    st.located = true;
  }
  return Status::OK();
}

Status LegacyReader::Resolve(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype,
                             std::string* storage_id, StorageBytes* bytes) const {
  StoragePid parsed;
  CKPTFS_RETURN_IF_ERROR(ParseStoragePid(pid, tensor_dtype, path_, &parsed));
  auto it = storages_.find(parsed.key);
  if (it == storages_.end() || !it->second.located)
    return Bad("storage '" + std::string(parsed.key) + "' is not in the storage key list");
  const Storage& st = it->second;
  const uint64_t stored_nbytes = st.nbytes;
  // torch reinterprets a storage another persistent id names with another dtype only when
  // the byte sizes agree.
  if (parsed.nbytes != stored_nbytes) return Bad("storage '" + std::string(parsed.key) + "' is referenced with two different sizes");
  *dtype = parsed.dtype;
  bytes->file = file_;
  bytes->data_offset = st.data_offset;
  bytes->nbytes = stored_nbytes;
  bytes->key = parsed.key;
  if (parsed.view) {
    // Streams of torch < 0.4 may name a view of the storage: (view key, offset, size), in
    // elements of the storage class.
    uint64_t view_offset, view_size, begin, length, end;
    if (parsed.view->kind() != Kind::kTuple || parsed.view->items().size() != 3 ||
        !AsUint(parsed.view->items()[1], &view_offset) || !AsUint(parsed.view->items()[2], &view_size))
      return Bad("malformed storage view of storage '" + std::string(parsed.key) + "'");
    if (!CheckedMul(view_offset, parsed.itemsize, &begin) || !CheckedMul(view_size, parsed.itemsize, &length) ||
        !CheckedAdd(begin, length, &end) || end > stored_nbytes)
      return Bad("storage view of storage '" + std::string(parsed.key) + "' lies outside it");
    bytes->data_offset += begin;
    bytes->nbytes = length;
  }
  // Views of one storage share its id: they are tied.
  *storage_id = "legacy:" + std::to_string(file_) + ":" + std::string(parsed.key);
  return Status::OK();
}

Status LegacyReader::Read(json* metadata) {
  uint64_t offset = 0;
  CKPTFS_RETURN_IF_ERROR(CheckHeader(&offset));
  CKPTFS_RETURN_IF_ERROR(ReadPickleAt(offset, "object pickle", &object_, &offset));
  CKPTFS_RETURN_IF_ERROR(CollectStorages(object_.root));
  Pickle keys;
  CKPTFS_RETURN_IF_ERROR(ReadPickleAt(offset, "storage key list pickle", &keys, &offset));
  head_ = std::string();  // the pickles are parsed (each keeps its own copy)
  CKPTFS_RETURN_IF_ERROR(LocateStorages(keys.root, offset));
  const size_t before = catalog_->tensors.size();
  CKPTFS_RETURN_IF_ERROR(FlattenTorchObject(object_.root, object_.value_count(), *this, catalog_, limits_, metadata));
  return NoTensorsFromTensorData(catalog_->tensors.size() - before, storages_.size(), path_, "storages");
}

// torch <= 0.3 wrote a tar archive with members sys_info, pickle, storages and tensors.
bool IsTar(std::string_view head) { return head.size() >= 262 && head.substr(257, 5) == "ustar"; }

}  // namespace

bool IsTorchLegacy(std::string_view head) {
  return (!head.empty() && static_cast<uint8_t>(head[0]) == 0x80) || IsTar(head);
}

Status ReadTorchLegacy(const std::string& path, std::string_view head, Catalog* catalog, json* metadata,
                       const ReadLimits& limits) {
  if (IsTar(head))
    return Status::NotSupported(path, "tar archive: the tar-based torch.save format of torch <= 0.3 is not "
                                      "supported; load it with torch and save it again");
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  LegacyReader reader(catalog, file, limits);
  return reader.Read(metadata);
}

namespace {

Status DetectTorchLegacy(SourceProbe& probe, bool* is_format) {
  std::string_view head;
  if (probe.is_file()) CKPTFS_RETURN_IF_ERROR(probe.Head(&head));
  *is_format = probe.is_file() && IsTorchLegacy(head);
  return Status::OK();
}

Status ReadTorchLegacySource(SourceProbe& probe, const SourceOptions& options, Catalog* catalog) {
  std::string_view head;
  CKPTFS_RETURN_IF_ERROR(probe.Head(&head));
  return ReadTorchLegacy(probe.source(), head, catalog, &catalog->metadata, options.limits);
}

}  // namespace

extern const ReaderEntry kTorchLegacyReader = {"torch-legacy", "legacy torch.save stream (torch < 1.6)", {"torch-legacy"},
                                               DetectTorchLegacy, ReadTorchLegacySource};

}  // namespace ckptfs
