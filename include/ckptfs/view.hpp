// View: the virtual tree ckptfs presents for a Catalog, and reads of its files.
//
// The catalog describes the source; what is served is the view's: the transforms of the view
// options (src/view/transform.hpp) map the catalog's tensors to the served tensors, each
// holding elements of one source tensor (a sub-box of its boxes), and the View lays those out.
//
// Built once from a Catalog, immutable afterwards. Sizes are exact before any read: small
// files are ordered lists of segments (literal bytes, byte ranges of source files); the
// files with a part per tensor (model files, manifest.json, tensors/<name>) keep offset
// tables and make each tensor's part again on read, so any (offset, length) read maps to
// tensors and source ranges by binary search. The model files' headers and manifest.json
// are laid out on first need (a mount that is only listed never pays for them).
// A View trusts its catalog's layouts: they must have passed ValidateLayout (OpenCatalog
// checks every tensor).
// Thread-safety: all const methods may be called concurrently (the layouts made on first
// need are made once, under std::call_once).
#ifndef CKPTFS_VIEW_HPP_
#define CKPTFS_VIEW_HPP_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// How a view presents a catalog (the view options of include/ckptfs/options.hpp). `dtype`
// and `root` pick what is served (transforms); `shard_size` and `checksums` how it is laid out.
struct ViewOptions {
  std::optional<DType> dtype;  // convert every floating tensor to this type on read
  std::string root;            // serve only the tensors under this key prefix, prefix removed
  uint64_t shard_size = 0;     // > 0: Hugging Face shards of at most this many bytes
  bool checksums = false;      // manifest.json lists each tensor file's XXH3-64
  // Key map (doc/MAPS.md): "" or "none" for none, "auto", a shipped map's name, or an
  // absolute path of a map file; and the map.NAME=VALUE settings over the checkpoint's config.
  std::string map;
  std::vector<std::pair<std::string, std::string>> map_settings;
};

class ServedTensors;
struct DeferredTensors;  // src/view/deferred_tensors.hpp

// A source file a view serves unchanged at `path` of its tree (a model folder's config.json,
// a pipeline's scheduler/scheduler_config.json).
struct PassedFile {
  std::string path;
  uint32_t file = 0;  // in the catalog's files
};

// One tensor as a view serves it: a handle into its ServedTensors, valid while they live.
class ServedTensor {
 public:
  ServedTensor(const ServedTensors& set, size_t index, DType dtype) : dtype(dtype), set_(&set), index_(index) {}

  // The element type it is served in: stored_dtype(), or the type a view converts it to.
  DType dtype;

  // Its served key and shape, and its elements' type as the source stores them.
  std::string_view key() const;
  const Shape& shape() const;
  DType stored_dtype() const;
  // Where its (first) source tensor sat in the original object, and the storage it shares
  // with other tensors (tied weights; "" for none).
  const KeyPath& path() const;
  const std::string& storage_id() const;
  uint64_t numel() const;
  bool converted() const { return dtype != stored_dtype(); }
  // Bytes as served.
  uint64_t nbytes() const { return numel() * Info(dtype).itemsize; }
  // The served elements as the source stores them: key and shape the served ones, dtype the
  // stored one, and every box a sub-box of a box of its source tensors (transform.hpp). A
  // key map's tensors have theirs made on first use (src/view/deferred_tensors.hpp); an
  // error there fails whatever read needed it.
  Status Stored(const TensorEntry** out) const;

 private:
  const ServedTensors* set_;
  size_t index_;
};

// How a served tensor's bytes are produced; the View, the layout builder, the device plan
// and the C API all ask this one function.
enum class ReadRoute : uint8_t {
  kExtents,  // its bytes are byte ranges of source files, concatenated (ExtentsOf(stored))
  kGather,   // elements gathered from its boxes into row-major order
  kConvert,  // stored bytes (by either route above) converted to its served dtype
};
ReadRoute RouteOf(const ServedTensor& tensor);

// What a view serves of a catalog: its tensors, in order, and the metadata beside them.
// Made from the catalog by the view's transforms (ApplyViewOptions); until a transform
// replaces the set (a selection, new keys or boxes), it holds no copy of the catalog's
// tensors (a million-tensor catalog is served as is without a second list).
class ServedTensors {
 public:
  ServedTensors() = default;
  // Every tensor and the metadata of `source`, as stored.
  explicit ServedTensors(std::shared_ptr<const Catalog> source);

  // The catalog served: its files, format and source path, its tensors as the source has them.
  const Catalog& source() const { return *source_; }
  size_t size() const;
  bool empty() const { return size() == 0; }
  ServedTensor operator[](size_t i) const { return ServedTensor(*this, i, dtypes_.empty() ? stored_dtype(i) : dtypes_[i]); }
  // Parts of operator[](i), also for the ServedTensor handles.
  std::string_view key(size_t i) const;
  const Shape& shape(size_t i) const;
  DType stored_dtype(size_t i) const;
  const KeyPath& path(size_t i) const;
  const std::string& storage_id(size_t i) const;
  Status Stored(size_t i, const TensorEntry** out) const;
  // The index in source().tensors of the tensor whose elements tensor i serves.
  size_t source_index(size_t i) const { return source_index_.empty() ? i : source_index_[i]; }
  // Further source tensors whose elements tensor i serves (a key map's concatenation of
  // several), beside source_index(i); usually none.
  std::span<const uint32_t> other_sources(size_t i) const;
  // Files a transform adds (a key map's config.json) or rewrites (a config that says the
  // served dtype), path in the tree -> content; they hide passed files at the same paths.
  const std::vector<std::pair<std::string, std::string>>& added_files() const { return added_files_; }
  // The models served, each in its folder with its weights file name (never empty: a source
  // that is no folder is one model at the root, served as model.safetensors); tensor i
  // belongs to ComponentOf(i).
  const std::vector<ModelComponent>& components() const { return components_; }
  size_t ComponentOf(size_t i) const;
  // The source files served unchanged (the catalog's sibling files) at their paths, and the
  // folders of the tree that hold no model (a pipeline's scheduler/).
  const std::vector<PassedFile>& passed_files() const { return passed_files_; }
  const std::vector<std::string>& folders() const { return folders_; }
  // The metadata served (metadata.json).
  const nlohmann::json& metadata() const { return *metadata_; }
  // What the transforms record in manifest.json (e.g. "dtype", "root"); an object.
  const nlohmann::json& manifest_fields() const { return manifest_fields_; }

  // Whether the tensors' entries are made on first use (a key map's).
  bool deferred() const { return deferred_ != nullptr; }
  // Whether the entries are the catalog's own (no transform replaced the set).
  bool SharesSourceEntries() const { return source_ && !deferred_ && stored_.get() == &source_->tensors; }

 private:
  // Transforms change the set through ServedTensorsEditor (src/view/served_edit.hpp); front
  // ends only read it.
  friend class ServedTensorsEditor;
  struct DeferredState;  // served.cpp
  std::shared_ptr<const Catalog> source_;
  std::shared_ptr<const DeferredState> deferred_;  // set: the tensors are these, not stored_'s
  // The served tensors as stored: the catalog's own list until a transform replaces it.
  std::shared_ptr<const std::vector<TensorEntry>> stored_;
  std::vector<uint32_t> source_index_;  // empty: tensor i serves source tensor i
  std::vector<DType> dtypes_;           // empty: each served as stored
  std::vector<std::vector<uint32_t>> other_sources_;  // empty: none for any tensor
  std::vector<std::pair<std::string, std::string>> added_files_;
  std::vector<ModelComponent> components_;
  std::vector<PassedFile> passed_files_;
  std::vector<std::string> folders_;
  std::shared_ptr<const nlohmann::json> metadata_;
  nlohmann::json manifest_fields_ = nlohmann::json::object();
};

inline std::string_view ServedTensor::key() const { return set_->key(index_); }
inline const Shape& ServedTensor::shape() const { return set_->shape(index_); }
inline DType ServedTensor::stored_dtype() const { return set_->stored_dtype(index_); }
inline const KeyPath& ServedTensor::path() const { return set_->path(index_); }
inline const std::string& ServedTensor::storage_id() const { return set_->storage_id(index_); }
inline Status ServedTensor::Stored(const TensorEntry** out) const { return set_->Stored(index_, out); }
inline uint64_t ServedTensor::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape()) n *= d;  // served shapes are blocks of validated source shapes
  return n;
}

// What a view with `options` serves of `catalog`: the view's transforms applied in turn
// (only the `root` subtree, prefix removed from keys and metadata narrowed to it; floating
// tensors converted to `dtype`), each checked to keep every served box a sub-box of a source
// tensor's (transform.hpp).
Status ApplyViewOptions(std::shared_ptr<const Catalog> catalog, const ViewOptions& options, ServedTensors* out);

class FileChecks;  // view/gather.hpp

class View {
 public:
  using NodeId = uint32_t;
  static constexpr NodeId kRoot = 0;

  // A node as the tree shows it, made on request: the per-tensor files of tensors/ are not
  // held as nodes (a node and a name string each would be ~130 MB of a million-tensor View) but
  // made from their served entries.
  struct Node {
    std::string name;
    NodeId parent = kRoot;
    bool is_dir = false;
    uint64_t size = 0;             // files
    int64_t mtime_ns = 0;
    int64_t tensor = -1;           // files: the tensor a per-tensor file holds, or -1
  };

  static Status Build(std::shared_ptr<const Catalog> catalog, const ViewOptions& options,
                      std::unique_ptr<View>* out);
  ~View();

  // The catalog it serves (files, format, source path).
  const Catalog& source() const;
  // The tensors it serves, in order (tensor i is in TensorFile(i)), and their metadata.
  const ServedTensors& served() const;
  size_t node_count() const;
  Node node(NodeId id) const;
  // Cheaper parts of node(id), for listings.
  bool IsDir(NodeId id) const;
  // node(id).size without the name and mtime (the read path asks it on every request).
  uint64_t SizeOf(NodeId id) const;
  std::string NameOf(NodeId id) const;
  // The same, into a caller's buffer (replacing its content): a listing of a million files
  // makes no string each.
  void NameOf(NodeId id, std::string* name) const;
  NodeId ParentOf(NodeId id) const;
  // The children of directory `dir`, sorted by name: ChildAt(dir, k) for k < ChildCount(dir).
  size_t ChildCount(NodeId dir) const;
  NodeId ChildAt(NodeId dir, size_t k) const;
  std::optional<NodeId> Child(NodeId dir, std::string_view name) const;
  // "a/b/c" relative to the root ("" is the root).
  std::optional<NodeId> Lookup(std::string_view path) const;
  std::string PathOf(NodeId id) const;
  // The source file that file `id` passes through unchanged (a config.json), if it is one.
  std::optional<uint32_t> PassedSourceFile(NodeId id) const;
  // The source file whose bytes file `id` is, whole and unchanged (a passed file, or a
  // safetensors file served as it is), if it is one; a front end may serve it from there.
  std::optional<uint32_t> SameAsSourceFile(NodeId id) const;
  // Whether file `id` is a model's weights file, one of its shards or their index.
  bool IsModelFile(NodeId id) const;
  // The virtual file that holds tensor `index` on its own ("tensors/<name>").
  NodeId TensorFile(size_t index) const;
  std::string TensorFilePath(size_t index) const { return PathOf(TensorFile(index)); }

  // Reads up to `length` bytes at `offset` of file `id` into `out`; *nread is short only
  // at the end of the file.
  Status Read(NodeId id, uint64_t offset, size_t length, char* out, size_t* nread) const;

  // XXH3-64 of the whole content of file `id` (reads it all).
  Status Xxh3(NodeId id, uint64_t* hash) const;

  // Bytes [offset, offset+length) of tensor `tensor_index`'s data as served (converted,
  // gathered), without any safetensors header. The range must lie within its nbytes().
  Status ReadTensorData(size_t tensor_index, uint64_t offset, size_t length, char* out) const;

 private:
  friend class ViewBuilder;
  // The tree, its small files' segments, and the model files and manifest.json laid out on
  // first need (src/view/view_impl.hpp).
  struct Impl;
  View();
  void LayOutModelFiles() const;
  void EnsureModelFiles() const;
  void LayOutManifest() const;
  void EnsureManifest() const;
  uint64_t TensorFileSize(size_t index) const;
  int64_t TensorMTime(size_t index) const;
  // Read of a per-tensor file (tensors/<name>): its header, made again, then the tensor's
  // data as served.
  Status ReadTensorFile(NodeId id, uint64_t offset, size_t length, char* out, size_t* nread) const;
  Status ReadSegments(NodeId id, uint64_t offset, uint64_t end, char* out) const;
  Status ReadModelFile(NodeId id, uint64_t offset, uint64_t end, char* out) const;
  Status ReadManifest(NodeId id, uint64_t offset, uint64_t end, char* out) const;
  // Piece `p` of model file `file`'s header, as bytes.
  void MakeHeaderPiece(size_t file, size_t p, std::string* out) const;
  // Bytes [offset, offset+length) of tensor `t` as stored (row-major, before conversion):
  // byte ranges of its files when StoredAsExtents, else gathered. `checks` (may be null):
  // the caller's record of source files already checked unchanged during this read, so a
  // read over many small tensors checks each file once, not once per tensor.
  Status ReadStored(const TensorEntry& t, uint64_t offset, size_t length, char* out,
                    FileChecks* checks = nullptr) const;
  // The same, assembled element by element from its boxes (view/gather.hpp).
  Status ReadGather(const TensorEntry& t, uint64_t offset, size_t length, char* out) const;
  Status ReadConverted(const ServedTensor& t, uint64_t offset, size_t length, char* out) const;
  // Appends tensor `index`'s entry in manifest.json, with the separator that precedes it;
  // `xxh3_hex` (may be null): its file's checksum. Needs the model files laid out.
  void AppendManifestEntry(size_t index, const char* xxh3_hex, std::string* text) const;

  std::unique_ptr<Impl> impl_;
};

// How tensor `t` is written in safetensors: dtype string and shape (complex types
// safetensors cannot name get their real view, see ServedAs).
void ServedDTypeAndShape(const ServedTensor& t, std::string_view* dtype, std::vector<uint64_t>* shape);

// What `ls --json` and manifest.json say of one tensor: key, path, dtype (as served),
// torch_dtype (as stored), shape (as served), nbytes (as served) and its per-tensor file.
nlohmann::json TensorSummary(const ServedTensor& tensor);
// The same fields written as JSON text, without the enclosing braces, for outputs with one
// entry per tensor (ls --json, manifest.json) where building a json tree would dominate.
// `*file_name_shortened` (if given): whether the file name was cut (names.hpp).
void AppendTensorSummary(std::string* out, const ServedTensor& tensor, bool* file_name_shortened = nullptr);

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_HPP_
