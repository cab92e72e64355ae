// Catalog: what a format reader learned about a checkpoint, without its tensor bytes.
//
// A Catalog is an ordered list of tensors, each with its dtype, shape and the byte
// ranges of the source files that hold it, plus a JSON tree of the checkpoint's
// non-tensor values. It is built once by a format reader and never changes.
#ifndef CKPTFS_CATALOG_HPP_
#define CKPTFS_CATALOG_HPP_

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/dtype.hpp"
#include "ckptfs/model_description.hpp"
#include "ckptfs/small_vector.hpp"
#include "ckptfs/source_files.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// A tensor's shape: inline up to rank 4 (every tensor has one; a heap allocation each would
// add ~50 bytes per tensor to a catalog).
using Shape = SmallVector<uint64_t, 4>;
// A box's offsets, extents or strides: inline up to rank 2 (contiguous tensors have one
// rank-1 box).
using BoxDims = SmallVector<uint64_t, 2>;

// One step of a tensor's original location: a dict key or a list index / int dict key.
using PathElement = std::variant<std::string, int64_t>;

// A tensor's original location, its elements packed into one string (a vector of variants
// would be ~100 bytes and two allocations per tensor; packed, a typical path fits one
// allocation or none). Elements are decoded on access.
class KeyPath {
 public:
  class const_iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = PathElement;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = PathElement;
    const_iterator() = default;
    PathElement operator*() const;
    const_iterator& operator++();
    const_iterator operator++(int) {
      const_iterator old = *this;
      ++*this;
      return old;
    }
    bool operator==(const const_iterator& o) const { return at_ == o.at_; }
    bool operator!=(const const_iterator& o) const { return at_ != o.at_; }

   private:
    friend class KeyPath;
    explicit const_iterator(const char* at) : at_(at) {}
    const char* at_ = nullptr;
  };
  using value_type = PathElement;

  KeyPath() = default;
  KeyPath(std::initializer_list<PathElement> elements);
  KeyPath(const std::vector<PathElement>& elements);  // NOLINT: readers build vectors
  operator std::vector<PathElement>() const { return std::vector<PathElement>(begin(), end()); }  // NOLINT

  size_t size() const;
  bool empty() const { return packed_.empty(); }
  // Element i, decoded (walks the elements before it).
  PathElement operator[](size_t i) const;
  const_iterator begin() const { return const_iterator(packed_.data()); }
  const_iterator end() const { return const_iterator(packed_.data() + packed_.size()); }
  void push_back(const PathElement& element);
  void emplace_back(std::string s) { push_back(PathElement(std::move(s))); }
  void emplace_back(int64_t i) { push_back(PathElement(i)); }
  // Calls on_string(std::string_view) or on_int(int64_t) for each element in order,
  // without decoding into PathElements.
  template <typename OnString, typename OnInt>
  void ForEach(OnString on_string, OnInt on_int) const;

  bool operator==(const KeyPath& o) const { return packed_ == o.packed_; }

  // The packed form, for stores that keep paths as bytes (the catalog cache), and back:
  // FromPacked checks that `packed` is a well-formed sequence of elements (false if not).
  std::string_view packed() const { return packed_; }
  static bool FromPacked(std::string_view packed, KeyPath* out);

 private:
  // Each element: a varint h, then for a string (h even) h/2 bytes, for an int (h == 1) a
  // zigzag varint.
  static uint64_t ReadVarint(const char** at);
  std::string packed_;
};

template <typename OnString, typename OnInt>
void KeyPath::ForEach(OnString on_string, OnInt on_int) const {
  const char* at = packed_.data();
  const char* end = at + packed_.size();
  while (at < end) {
    const uint64_t h = ReadVarint(&at);
    if (h & 1) {
      const uint64_t z = ReadVarint(&at);
      on_int(static_cast<int64_t>((z >> 1) ^ (~(z & 1) + 1)));
    } else {
      on_string(std::string_view(at, h >> 1));
      at += h >> 1;
    }
  }
}

// `length` bytes of source file `file` starting at `offset`.
struct Extent {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A block of a tensor held by one source file. Along each dimension d of the shape the
// boxes tile, the box holds elements [offset[d], offset[d] + extent[d]); its element with
// box-relative index i lies at byte base_offset + itemsize * sum(i[d] * strides[d]) of
// `file` (strides in elements).
//
// A tensor's boxes tile either its shape (every box has the tensor's rank) or its elements
// in row-major order (every box has rank 1): a contiguous byte range is the rank-1 box
// Box::Range, a strided view is one box over the whole shape, a sharded tensor is one box
// per shard in whichever files hold them.
struct Box {
  uint32_t file = 0;
  uint64_t base_offset = 0;
  BoxDims offset;
  BoxDims extent;
  BoxDims strides;

  size_t rank() const { return extent.size(); }
  uint64_t numel() const;
  // Elements [first_element, first_element + count) of the tensor in row-major order,
  // stored contiguously at byte `base_offset` of `file`.
  static Box Range(uint32_t file, uint64_t base_offset, uint64_t first_element, uint64_t count);
  // The whole of `shape`, its elements `strides` apart from byte `base_offset` of `file`:
  // one strided view of a storage.
  static Box Strided(uint32_t file, uint64_t base_offset, BoxDims shape, BoxDims strides);
};

// A tensor's boxes, contiguous like a std::vector's. Nearly every tensor has one (a
// contiguous range of one file), kept inline; a heap vector holds them only when there are
// more. (As a std::vector<Box> the one box would be a heap block of its own, and per-tensor
// allocations are where decoding a cached million-tensor catalog spends its time.)
class BoxList {
 public:
  using value_type = Box;
  using iterator = Box*;
  using const_iterator = const Box*;

  BoxList() = default;
  BoxList(std::initializer_list<Box> boxes) : BoxList(std::vector<Box>(boxes)) {}
  BoxList(const std::vector<Box>& boxes) : BoxList(std::vector<Box>(boxes)) {}  // NOLINT: readers build vectors
  BoxList(std::vector<Box>&& boxes);                                             // NOLINT
  BoxList(const BoxList&) = default;
  BoxList(BoxList&&) noexcept = default;
  BoxList& operator=(const BoxList&) = default;
  BoxList& operator=(BoxList&&) noexcept = default;

  size_t size() const { return many_.empty() ? inline_count_ : many_.size(); }
  bool empty() const { return size() == 0; }
  Box* data() { return many_.empty() ? &one_ : many_.data(); }
  const Box* data() const { return many_.empty() ? &one_ : many_.data(); }
  Box* begin() { return data(); }
  Box* end() { return data() + size(); }
  const Box* begin() const { return data(); }
  const Box* end() const { return data() + size(); }
  Box& operator[](size_t i) { return data()[i]; }
  const Box& operator[](size_t i) const { return data()[i]; }
  Box& front() { return data()[0]; }
  const Box& front() const { return data()[0]; }
  Box& back() { return data()[size() - 1]; }
  const Box& back() const { return data()[size() - 1]; }

  void push_back(Box box);
  void resize(size_t count);
  void reserve(size_t count);
  void clear();

 private:
  // The boxes are one_ (inline_count_ of them, 0 or 1) while many_ is empty, else many_.
  Box one_;
  std::vector<Box> many_;
  uint8_t inline_count_ = 0;
};

struct TensorEntry {
  std::string key;                // flattened, e.g. "optimizer.state.0.exp_avg"
  KeyPath path;  // where it sat in the original object
  DType dtype = DType::kF32;
  Shape shape;
  // Where the elements are stored; empty when the tensor has none. OpenCatalog checks that
  // they tile the tensor exactly (ValidateLayout) before anything reads them.
  BoxList boxes;
  // Tensors that view the same storage share a non-empty storage id (tied weights).
  std::string storage_id;

  uint64_t numel() const;
  // Bytes as stored in the source.
  uint64_t nbytes() const { return numel() * Info(dtype).itemsize; }
};

// True when the tensor's bytes, in row-major order, are byte ranges of source files (each
// box one run of them); otherwise its elements must be gathered from its boxes.
bool StoredAsExtents(const TensorEntry& tensor);
// The byte ranges whose concatenation is the tensor's stored bytes, in order, adjacent
// ranges of one file merged. Only for tensors with StoredAsExtents.
std::vector<Extent> ExtentsOf(const TensorEntry& tensor);

// Checks that `tensor`'s boxes tile its shape (or its flattened elements) exactly, with no
// gap, no overlap and nothing outside the shape, and that every element of every box lies
// inside its file, all with overflow-checked arithmetic. The error names `source` and the
// tensor's key.
Status ValidateLayout(const TensorEntry& tensor, const SourceFiles& files, const std::string& source);

// A shape (or any list of dimensions) as messages and listings write it: "[4, 64, 64]".
std::string ShapeText(std::span<const uint64_t> dims);

// A model a folder source holds, served in a folder of its own at the same path (a diffusers
// pipeline's unet/, the top level of a model folder): its tensors are those whose keys start
// with `folder` + "/", or for the top level (""), those of no other component.
struct ModelComponent {
  std::string folder;  // relative to the served tree's root; "" for the root
  std::string format;  // the reader's format name ("safetensors-folder", ...)
  // The served weights file (doc/MOUNT.md, "Weight file names"): the name its loader looks
  // for. Shards and their index take its stem ("model-00001-of-00002.safetensors",
  // "model.safetensors.index.json").
  std::string weights_name = "model.safetensors";
  // When the source is sharded and served in its own shards: each source weight file and
  // the name of the shard it is served as (a view with a shard size shards anew).
  std::vector<std::pair<uint32_t, std::string>> source_shards;
};

// A safetensors file of the source that a catalog holds whole: its header lists exactly the
// tensors [first_tensor, first_tensor + tensor_count) of the catalog, in data order, under
// their keys less their first `key_prefix` bytes (the folder of the component that holds it),
// and their bytes fill the file from `data_start` to its end. A view that serves those tensors
// as they are serves the file itself, its own header included (doc/MOUNT.md, "Files served
// as they are").
struct WholeSafetensorsFile {
  uint32_t file = 0;
  uint64_t data_start = 0;
  uint64_t first_tensor = 0;
  uint64_t tensor_count = 0;
  uint32_t key_prefix = 0;
};

struct Catalog {
  std::string format;  // "torch-zip", "safetensors", ...
  std::string source;  // the path the user gave
  // Every source file the catalog reads, opened through one Env.
  std::shared_ptr<SourceFiles> files = std::make_shared<SourceFiles>();
  std::vector<TensorEntry> tensors;
  nlohmann::json metadata = nlohmann::json::object();  // non-tensor values
  // Files beside a checkpoint in its folder (config.json, tokenizer...), served as is.
  std::vector<uint32_t> sibling_files;
  // Where each sibling file is served, relative to the tree's root, when a folder source
  // places them in subfolders: parallel to sibling_files, or empty (each at the root under
  // its own name).
  std::vector<std::string> sibling_paths;
  // Subfolders of a folder source served as folders, relative to its root (those that hold
  // only other folders or nothing included).
  std::vector<std::string> folders;
  // The models of a folder source (a model folder has one, at ""); empty for a source that
  // is no folder, served as one model.safetensors.
  std::vector<ModelComponent> components;
  // What a folder source holds that is not served, path -> why (metadata["not_served"] too):
  // a tree recognized only in part says so.
  std::vector<std::pair<std::string, std::string>> not_served;
  // The safetensors files whose tensors are these catalog's, header and all.
  std::vector<WholeSafetensorsFile> whole_safetensors_files;
  // The file that says where tensors lie, when it is not `source` itself (a DCP folder's
  // .metadata): layout errors (ValidateLayout) name it.
  std::string layout_file;
  // What the checkpoint says of its model, where a reader found it (a Megatron save): what
  // key maps read (model_description.hpp).
  std::optional<ModelDescription> model;
};

// Joins a path into a flattened key: string elements as they are, ints in decimal,
// separated by '.'.
std::string FlattenKey(const std::vector<PathElement>& path);
std::string FlattenKey(const KeyPath& path);

// A tensor of tensors[first..] whose key an earlier one of that range has (the later of the
// first such pair found), or nothing when the keys are distinct. Sorts (hash, index) pairs
// and compares keys only within runs of equal hashes: a set of a million keys held 50-100 MB.
std::optional<size_t> FindRepeatedKey(const std::vector<TensorEntry>& tensors, size_t first = 0);
// The same over the `count` keys key_at(0), ..., key_at(count - 1).
std::optional<size_t> FindRepeatedKey(size_t count, const std::function<std::string_view(size_t)>& key_at);

}  // namespace ckptfs

#endif  // CKPTFS_CATALOG_HPP_
