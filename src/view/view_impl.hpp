// View's state (include/ckptfs/view.hpp): the tree, its small files' segments, and the model
// files and manifest.json laid out on first need. Seen by the view's own files only, so a
// change here recompiles the view, not every front end.
#ifndef CKPTFS_VIEW_VIEW_IMPL_HPP_
#define CKPTFS_VIEW_VIEW_IMPL_HPP_

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ckptfs/view.hpp"

namespace ckptfs {

// A piece of a small virtual file (metadata.json, the shard index, a sibling file, a
// checksummed manifest.json). Model files, manifest.json and per-tensor files have none:
// their bytes are made from the served tensors on read (View::ReadModelFile, ReadManifest,
// ReadTensorFile); a segment each per tensor would be ~64 MB of a million-tensor View.
struct Segment {
  enum class Kind : uint8_t { kLiteral, kExtent };
  Kind kind = Kind::kLiteral;
  uint32_t ref = 0;     // kLiteral: literal index; kExtent: source file
  uint64_t start = 0;   // offset of this segment in the virtual file
  uint64_t length = 0;
  uint64_t source_offset = 0;  // kExtent: where the bytes start in the source file
};

struct View::Impl {
  // What a held node's bytes are.
  enum class Content : uint8_t { kSegments, kModelFile, kManifest };
  // Every node but the per-tensor files (ids from first_tensor_file_ on).
  struct Entry {
    std::string name;
    NodeId parent = kRoot;
    bool is_dir = false;
    Content content = Content::kSegments;
    std::vector<NodeId> children;  // directories but tensors/: sorted by name
    uint64_t size = 0;             // kSegments files (the others: their layouts)
    int64_t mtime_ns = 0;
    uint32_t first_segment = 0, segment_count = 0;  // kSegments
    uint32_t model_file = 0;                        // kModelFile: index into model_files_
  };
  // A stretch of a model file's header: the entries of members [first_member, next piece's
  // first) in data order, made again on each read from the served tensors (the header text of a
  // million tensors is ~70 MB).
  struct HeaderPiece {
    uint32_t first_member = 0;
    uint64_t start = 0;  // offset in the file
  };
  // One safetensors model file (model.safetensors or a shard). Its header and the places of
  // its tensors are laid out on first need (LayOutModelFiles), under model_once_.
  struct ModelFile {
    std::string name;    // in its folder
    std::string folder;  // its model's folder ("" the root)
    uint32_t key_prefix = 0;  // bytes of its keys that name that folder ("unet/"), not in its header
    NodeId node = kRoot;
    std::vector<uint32_t> members;     // tensor indices in data order (descending item size; a source file's order)
    // The source file it is, byte for byte, when it serves a whole safetensors file of the
    // source unchanged (WholeSafetensorsFile): its bytes, header included, are read from there.
    std::optional<uint32_t> source_file;
    uint64_t source_data_start = 0;
    std::vector<HeaderPiece> pieces;   // laid out
    uint64_t header_size = 0, size = 0;  // laid out
  };

  ServedTensors served_;
  std::vector<Entry> entries_;
  std::vector<Segment> segments_;
  std::vector<std::string> literals_;
  NodeId tensors_dir_ = kRoot;
  NodeId first_tensor_file_ = 0;
  std::vector<uint32_t> tensor_file_order_;  // tensor indices in file-name order
  int64_t newest_mtime_ = 0;

  // Model files and their indexes. model_file_of_ is empty when there is one model file.
  std::vector<uint32_t> model_file_of_;      // tensor index -> its model file
  mutable std::vector<ModelFile> model_files_;
  std::vector<NodeId> model_indexes_;
  mutable std::vector<uint64_t> model_begin_;  // tensor index -> where its bytes start in its model file
  mutable std::once_flag model_once_;

  // manifest.json without checksums: a head literal, one entry per tensor made again on
  // each read (kept, a million entries would be ~250 MB), a tail literal; laid out on first need.
  NodeId manifest_ = kRoot;
  std::string manifest_head_, manifest_tail_;
  mutable std::vector<uint64_t> manifest_entry_end_;  // tensor index -> end of its entry in the file
  mutable std::vector<bool> shares_storage_;          // tensor index -> its storage is shared (tied)
  mutable uint64_t manifest_size_ = 0;
  mutable std::once_flag manifest_once_;
};

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_VIEW_IMPL_HPP_
