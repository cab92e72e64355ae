// View: the virtual tree ckptfs presents for a Catalog, and reads of its files.
//
// Built once from a Catalog, immutable afterwards. Each file is an ordered list of
// segments (literal bytes synthesized at build time, byte ranges of source files, or a
// tensor gathered from its boxes into row-major order or converted), so sizes are exact
// before any read and any (offset, length) read maps to source ranges by binary search.
// A View trusts its catalog's layouts: they must have passed ValidateLayout (OpenCatalog
// checks every tensor).
// Thread-safety: all const methods may be called concurrently.
#ifndef CKPTFS_VIEW_HPP_
#define CKPTFS_VIEW_HPP_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// How a view presents a catalog (the view options of include/ckptfs/options.hpp).
struct ViewOptions {
  std::optional<DType> dtype;  // convert every floating tensor to this type on read
  std::string root;            // serve only the tensors under this key prefix, prefix removed
  uint64_t shard_size = 0;     // > 0: Hugging Face shards of at most this many bytes
  bool checksums = false;      // manifest.json lists each tensor file's XXH3-64
};

// The catalog as `options` present it: only the `root` subtree (prefix removed from keys,
// metadata narrowed to it), floating tensors marked for conversion to `dtype`.
Status ApplyViewOptions(std::shared_ptr<const Catalog> catalog, const ViewOptions& options,
                        std::shared_ptr<const Catalog>* out);

// A piece of a virtual file.
struct Segment {
  // kManifestEntry: one tensor's entry in manifest.json, made again on each read rather
  // than kept: kept, a million tensors' entries held ~250 MB of a mount. (Per-tensor files
  // have no segments: View::ReadTensorFile.)
  enum class Kind : uint8_t { kLiteral, kExtent, kGather, kConvert, kManifestEntry };
  Kind kind = Kind::kLiteral;
  // kLiteral: literal index; kExtent: source file; the others: tensor index
  uint32_t ref = 0;
  uint64_t start = 0;   // offset of this segment in the virtual file
  uint64_t length = 0;
  uint64_t source_offset = 0;  // kExtent: where the bytes start in the source file
};

class View {
 public:
  using NodeId = uint32_t;
  static constexpr NodeId kRoot = 0;

  struct Node {
    std::string name;
    NodeId parent = kRoot;
    bool is_dir = false;
    std::vector<NodeId> children;  // directories: sorted by name
    uint64_t size = 0;             // files
    int64_t mtime_ns = 0;
    uint32_t first_segment = 0, segment_count = 0;
    int64_t tensor = -1;           // files: the tensor a per-tensor file holds, or -1
  };

  static Status Build(std::shared_ptr<const Catalog> catalog, const ViewOptions& options,
                      std::unique_ptr<View>* out);

  const Catalog& catalog() const { return *catalog_; }
  size_t node_count() const { return nodes_.size(); }
  const Node& node(NodeId id) const { return nodes_[id]; }
  std::optional<NodeId> Child(NodeId dir, std::string_view name) const;
  // "a/b/c" relative to the root ("" is the root).
  std::optional<NodeId> Lookup(std::string_view path) const;
  std::string PathOf(NodeId id) const;
  // The virtual file that holds tensor `index` on its own ("tensors/<name>").
  NodeId TensorFile(size_t index) const { return tensor_files_[index]; }
  std::string TensorFilePath(size_t index) const { return PathOf(tensor_files_[index]); }

  // Reads up to `length` bytes at `offset` of file `id` into `out`; *nread is short only
  // at the end of the file.
  Status Read(NodeId id, uint64_t offset, size_t length, char* out, size_t* nread) const;

  // XXH3-64 of the whole content of file `id` (reads it all).
  Status Xxh3(NodeId id, uint64_t* hash) const;

  // Bytes [offset, offset+length) of tensor `tensor_index`'s data as served (converted,
  // gathered), without any safetensors header. The range must lie within served_nbytes().
  Status ReadTensorData(size_t tensor_index, uint64_t offset, size_t length, char* out) const;

  // Where a tensor's bytes sit in the model file(s): the file's index in model order, and
  // the byte range [begin, end) in it.
  struct ModelPlace {
    uint32_t file = 0;
    uint64_t begin = 0, end = 0;
  };

 private:
  friend class ViewBuilder;
  View() = default;
  // Read of a per-tensor file (tensors/<name>): its header, made again, then the tensor's
  // data as served.
  Status ReadTensorFile(NodeId id, uint64_t offset, size_t length, char* out, size_t* nread) const;
  // Bytes [offset, offset+length) of tensor `t` as stored (row-major, before conversion):
  // byte ranges of its files when StoredAsExtents, else gathered.
  Status ReadStored(const TensorEntry& t, uint64_t offset, size_t length, char* out) const;
  // The same, assembled element by element from its boxes (view/gather.hpp).
  Status ReadGather(const TensorEntry& t, uint64_t offset, size_t length, char* out) const;
  Status ReadConverted(const TensorEntry& t, uint64_t offset, size_t length, char* out) const;
  // Appends tensor `index`'s entry in manifest.json, with the separator that precedes it.
  void AppendManifestEntry(size_t index, std::string* text) const;


  std::shared_ptr<const Catalog> catalog_;
  std::vector<Node> nodes_;
  std::vector<Segment> segments_;
  std::vector<std::string> literals_;
  std::vector<NodeId> tensor_files_;  // tensor index -> its per-tensor file
  std::vector<std::string> model_files_;  // the model file names, in order
  std::vector<ModelPlace> model_places_;  // tensor index -> where it sits in a model file
  std::vector<bool> shares_storage_;      // tensor index -> its storage is shared (tied)
};

// How tensor `t` is written in safetensors: dtype string and shape (complex types
// safetensors cannot name get their real view, see ServedAs).
void ServedDTypeAndShape(const TensorEntry& t, std::string_view* dtype, std::vector<uint64_t>* shape);

// What `ls --json` and manifest.json say of one tensor: key, path, dtype (as served),
// torch_dtype, shape (as served), nbytes and its per-tensor file.
nlohmann::json TensorSummary(const TensorEntry& tensor);
// The same fields written as JSON text, without the enclosing braces, for outputs with one
// entry per tensor (ls --json, manifest.json) where building a json tree would dominate.
// `*file_name_shortened` (if given): whether the file name was cut (names.hpp).
void AppendTensorSummary(std::string* out, const TensorEntry& tensor, bool* file_name_shortened = nullptr);

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_HPP_
