// An opened torch.save zip archive: its parsed data.pkl and the resolution of tensor
// rebuild calls to byte ranges of its data/<key> records. Shared by the readers that
// interpret torch pickles (plain checkpoints, DeepSpeed ZeRO shards, DCP chunks, TorchScript
// archives). The rebuild calls and the flattening of a torch pickle's object are declared
// here too, for every container of torch pickles (legacy streams resolve storages their own
// way). Layout facts: doc/FORMATS.md, "torch.save archives".
#ifndef CKPTFS_FORMAT_TORCH_TORCH_ARCHIVE_HPP_
#define CKPTFS_FORMAT_TORCH_TORCH_ARCHIVE_HPP_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/limits.hpp"
#include "codec/pickle.hpp"
#include "codec/zip.hpp"

namespace ckptfs {

// Parsed data.pkl records by their bytes, shared by the archives of one reader. A DCP save
// holds one small torch.save archive per chunk, and chunks of one shape pickle identical
// bytes: a million chunks then parse a handful of pickles. Only small pickles are kept.
class PickleCache {
 public:
  static constexpr size_t kMaxPickleBytes = 4096;
  static constexpr size_t kMaxEntries = 1024;
  std::shared_ptr<const Pickle> Find(std::string_view bytes) const;
  void Insert(std::string bytes, std::shared_ptr<const Pickle> pickle);

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view bytes) const { return std::hash<std::string_view>{}(bytes); }
  };
  std::unordered_map<std::string, std::shared_ptr<const Pickle>, Hash, std::equal_to<>> by_bytes_;
};

// Where the bytes of one storage lie.
struct StorageBytes {
  uint32_t file = 0;
  uint64_t data_offset = 0;  // in the file
  uint64_t nbytes = 0;
  std::string_view key;  // as the pickle names it (a view into the pickle), for messages
};

// Resolves the storage persistent ids of a torch pickle to file bytes. Each container of
// torch pickles (a torch.save zip, a TorchScript archive, a legacy stream) keeps its
// storages its own way; the tensor rebuild calls around them are the same (RebuildTensor).
class StorageResolver {
 public:
  virtual ~StorageResolver() = default;
  // Sets *dtype (`tensor_dtype` when the rebuild call names one, else the storage class's),
  // *storage_id (equal for two pids only when they name one storage of one container) and
  // *bytes.
  virtual Status Resolve(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype,
                         std::string* storage_id, StorageBytes* bytes) const = 0;
  // How messages name the container.
  virtual const std::string& path() const = 0;
  // The tensor a streamed parse's hook made of the call it took as kTaken value `index`;
  // nullptr when the parse was not streamed.
  virtual const TensorEntry* Taken(uint64_t /*index*/) const { return nullptr; }
};

// The fields of a ('storage', <storage class>, key, location, numel[, view]) persistent id.
struct StoragePid {
  std::string_view key;
  DType dtype = DType::kU8;       // the tensor's dtype when given, else the storage class's
  uint64_t itemsize = 1;          // bytes per element of the storage class (1: UntypedStorage)
  uint64_t numel = 0;             // elements of the storage class
  uint64_t nbytes = 0;            // numel * itemsize
  const PyValue* view = nullptr;  // legacy streams: (view_key, offset, size) into the storage, or None
};
Status ParseStoragePid(const PyValue* pid, std::optional<DType> tensor_dtype, const std::string& where,
                       StoragePid* out);

// Places tensor *t (its dtype and shape set) in storage `rec`: `offset` and `stride` in
// elements. Checks with checked arithmetic that every element lies inside the storage, then
// adds one box: a byte range when the layout is contiguous, else a strided view.
Status PlaceStridedTensor(const StorageBytes& rec, uint64_t offset, BoxDims stride, const std::string& where,
                          TensorEntry* t);

// When `v` is a tensor rebuild call (_rebuild_tensor[_v2|_v3], _rebuild_parameter,
// _rebuild_from_type_v2), sets *is_tensor and fills dtype, shape, boxes and storage_id of
// *t from `storages`, after checking every element lies inside its storage.
Status RebuildTensor(const PyValue* v, const StorageResolver& storages, TensorEntry* t, bool* is_tensor);

// Flattens the object a torch pickle holds (`root`, from a pickle of `value_count` values):
// tensors become catalog tensors under dotted keys ("layer.0.weight", module attributes
// included), every other value becomes JSON in *metadata. Tensors resolve through `storages`.
// Shared by the readers of torch.save zips, legacy streams and TorchScript archives. DTensors
// and ShardedTensors are served as their local shards, or handed to `sink` when given
// (format/torch/torch_distributed.hpp).
class DistributedTensorSink;
Status FlattenTorchObject(const PyValue* root, size_t value_count, const StorageResolver& storages,
                          Catalog* catalog, const ReadLimits& limits, nlohmann::json* metadata,
                          DistributedTensorSink* sink = nullptr);

// The second half of the torch readers' rule (doc/FORMATS.md, "Objects that hold tensors"):
// a file that holds tensor data (`stored` storages, described as `what`) and serves none of
// it (`served` tensors) was not understood, and is refused.
Status NoTensorsFromTensorData(size_t served, size_t stored, const std::string& path, std::string_view what);

// Which records of a torch zip archive to read as its object pickle and storages.
struct ArchiveRecords {
  std::string pickle = "data.pkl";
  std::string storage_dir = "data/";
  // TorchScript archives (torch.jit.save) hold constants.pkl; only their reader sets this.
  bool torchscript = false;
};

class TorchArchive : public StorageResolver {
 public:
  // Opens file `path` (adding it to `files`) as a whole-file archive.
  Status Open(const std::string& path, SourceFiles* files, const ReadLimits& limits = ReadLimits{});
  // Opens the archive in `window` of a file already in `files`, checks it is a torch.save
  // archive and parses its object pickle (`records.pickle`, data.pkl unless said; none when
  // empty) without executing anything; its storages are `records.storage_dir` records.
  // With a `cache`, an object pickle already parsed by another archive is not parsed again.
  // `window_bytes`: the window's bytes when the caller has read them (ZipArchive::Open).
  // `opened`: this window's directory, already read; taken over (moved from) when it is.
  // `hook`: streams the parse of the object pickle (ParsePickleStreamed; no cache then).
  Status Open(const SourceFiles& files, FileWindow window, const ReadLimits& limits = ReadLimits{},
              const ArchiveRecords& records = ArchiveRecords{}, PickleCache* cache = nullptr,
              std::string_view window_bytes = {}, ZipArchive* opened = nullptr, PickleCallHook* hook = nullptr);
  // Whether Open got as far as parsing the object pickle with a hook (successfully or not).
  bool streamed() const { return streamed_; }
  // Parses the object pickle again, without a hook: after a streamed parse, or what was
  // made of it, failed. This parse's outcome is the one to report.
  Status ParseAgain();
  // Frees the zip directory and storage lookups once a streamed parse has resolved every
  // tensor (a million entries are ~70 MB): Resolve then fails, which a streamed reader
  // answers by parsing again (ParseAgain reads the directory again).
  void ReleaseDirectory();
  // Frees the parsed object pickle once what was made of it no longer points into it (root()
  // is null then; ParseAgain parses it again).
  void ReleasePickle() { pickle_.reset(); }

  // The zip directory and "<archive>/" folder prefix, for readers of other records.
  const ZipArchive& zip() const { return zip_; }
  const std::string& prefix() const { return prefix_; }

  // How messages name the archive: the file's path, with the byte range for a window.
  const std::string& path() const override { return path_; }
  uint32_t file() const { return window_.file; }
  const FileWindow& window() const { return window_; }
  const PyValue* root() const { return pickle_ ? pickle_->root : nullptr; }
  // Values in the parsed pickle (walkers bound their work by it).
  size_t value_count() const { return pickle_ ? pickle_->value_count() : 0; }
  // Storage records (`<archive>/data/...`, or the folder the records name) the archive holds:
  // tensor data, which a reader serving no tensor has failed to understand.
  size_t storage_records() const { return storage_records_; }

  // When `v` is a tensor rebuild call (_rebuild_tensor[_v2|_v3], _rebuild_parameter,
  // _rebuild_from_type_v2), sets *is_tensor and fills dtype, shape, extents or strided
  // layout and storage_id of *t, after checking every element lies inside its storage.
  // Storage ids ("<file>:<base>:<key>") name the file, the window and the record, so two
  // archives in one file never share one.
  // Not thread-safe (it caches storage lookups).
  Status AsTensor(const PyValue* v, TensorEntry* t, bool* is_tensor) const { return RebuildTensor(v, *this, t, is_tensor); }

  Status Resolve(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype, std::string* storage_id,
                 StorageBytes* bytes) const override;

  Status Bad(const std::string& what) const { return Status::Corruption(path_, what); }

 private:
  std::string path_;
  const SourceFiles* files_ = nullptr;
  FileWindow window_;
  ZipArchive zip_;
  std::string prefix_;  // "<archive>/"
  std::string storage_dir_;  // "data/", or "constants/" for a TorchScript constants.pkl
  std::shared_ptr<const Pickle> pickle_;  // none until Open parses (or finds) one
  // What parsing the object pickle needs (ParseAgain).
  Status ParseObject(PickleCache* cache, PickleCallHook* hook);
  const ZipEntry* pickle_entry_ = nullptr;
  std::string pickle_name_;
  ReadLimits limits_;
  bool streamed_ = false;
  bool released_ = false;
  size_t storage_records_ = 0;
  uint64_t max_entries_ = 0;
  // Which storage records a lookup has checked (compression, size), by the index of their
  // zip entry: a bit each where a memo of data offsets would take 8 bytes (8 MB at the peak
  // of a million-record parse).
  mutable std::vector<bool> checked_;
  // Data offsets of records referenced again (storages shared by several tensors), by
  // entry index modulo its size, made on the first such reference: a scattered repeat
  // then reads no local header. Empty for most archives (a DCP chunk's are reopened a
  // million times).
  struct RecentOffset {
    size_t entry = SIZE_MAX;
    uint64_t data_offset = 0;
  };
  static constexpr size_t kRecentOffsets = 256;
  mutable std::vector<RecentOffset> recent_offsets_;
  // Where the data of entry `index` (a stored record) begins in the file.
  Status RecordDataOffset(size_t index, uint64_t* offset) const;
  mutable size_t next_record_ = 0;   // the entry index Storage tries first
  mutable std::string record_name_;  // scratch for "<archive>/data/<key>", reused to avoid allocations
  std::string storage_id_prefix_;     // "<file>:<base>:" (and the storage folder when not data/)
};

// Helpers for reading pickled values.

// "module.name" of a GLOBAL, without allocating.
bool IsGlobal(const PyValue* g, std::string_view qualified);
// A call (REDUCE/NEWOBJ) of the global `qualified`.
bool IsCall(const PyValue* v, std::string_view qualified);
std::string QualifiedName(const PyValue* g);
// Argument i of a call, or nullptr.
const PyValue* Arg(const PyValue* call, size_t i);
bool AsUint(const PyValue* v, uint64_t* out);
// A tuple, list or torch.Size of non-negative ints. Into a Shape or BoxDims, a tensor's
// dimensions need no allocation (a million rebuild calls made and freed two vectors each).
bool AsUintTuple(const PyValue* v, std::vector<uint64_t>* out);
bool AsUintTuple(const PyValue* v, Shape* out);
bool AsUintTuple(const PyValue* v, BoxDims* out);
// The node whose `entries` hold a mapping: a dict, an OrderedDict call, or a dict whose
// attributes were set by BUILD; nullptr for anything else.
const PyValue* AsMapping(const PyValue* v);
// mapping[key] for a string key, or nullptr.
const PyValue* Find(const PyValue* mapping, std::string_view key);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_TORCH_TORCH_ARCHIVE_HPP_
