// Reader for torch.distributed.checkpoint (DCP) folders: `.metadata` says which tensors
// exist and which byte slices of the `__<rank>_<n>.distcp` files hold their chunks; each
// slice is a small torch.save archive read in place (a FileWindow), or, in DCP's
// safetensors serialization, a tensor of the safetensors blob that ends the file, and each
// chunk's storage becomes a box of the full tensor. Non-tensor entries are torch.save'd objects,
// decoded into metadata.json without running them.
// Layout facts: doc/FORMATS.md, "DCP layout" and "DCP reader".
#include <algorithm>
#include <cerrno>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "codec/safetensors_header.hpp"
#include "format/chunk_boxes.hpp"
#include "format/dcp/dcp_metadata.hpp"
#include "format/megatron/megatron_config.hpp"
#include "format/megatron/megatron_fragments.hpp"
#include "format/megatron/megatron_framework_config.hpp"
#include "format/megatron/megatron_tensor_facts.hpp"
#include "format/readers.hpp"
#include "format/sibling_files.hpp"
#include "format/torch/torch_archive.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

constexpr const char* kMetadataName = ".metadata";
constexpr const char* kMegatronTracker = "latest_checkpointed_iteration.txt";

bool HasMetadata(Env& env, const std::string& dir) {
  PathType type;
  return env.Stat(JoinPath(dir, kMetadataName), &type).ok() && type == PathType::kFile;
}

// The step number a folder name carries: its last run of digits ("step-200" -> 200,
// "iter_0000200" -> 200); nullopt when it has none.
std::optional<uint64_t> StepNumber(std::string_view name) {
  size_t end = name.find_last_of("0123456789");
  if (end == std::string_view::npos) return std::nullopt;
  size_t begin = end;
  while (begin > 0 && name[begin - 1] >= '0' && name[begin - 1] <= '9') --begin;
  std::string_view digits = name.substr(begin, end + 1 - begin);
  while (digits.size() > 1 && digits.front() == '0') digits.remove_prefix(1);
  if (digits.size() > 18) return std::nullopt;
  return std::stoull(std::string(digits));
}

std::string Trim(std::string s) {
  const char* ws = " \t\r\n";
  s.erase(s.find_last_not_of(ws) + 1);
  s.erase(0, s.find_first_not_of(ws));
  return s;
}

bool HasStepFolder(Env& env, const std::string& dir) {
  std::vector<FolderEntry> entries;
  if (!env.ListFolder(dir, &entries).ok()) return false;
  for (const FolderEntry& e : entries)
    if (e.type == PathType::kFolder && HasMetadata(env, JoinPath(dir, e.name))) return true;
  return false;
}

// The folder whose .metadata is served: `dir` itself, or its latest step folder.
// `step` is the step folder's path under `dir` ("" when `dir` is the checkpoint).
Status ResolveStepFolder(Env& env, const std::string& dir, std::string* step) {
  step->clear();
  if (HasMetadata(env, dir)) return Status::OK();
  std::vector<FolderEntry> entries;
  CKPTFS_RETURN_IF_ERROR(env.ListFolder(dir, &entries));
  std::vector<std::string> candidates;
  for (const FolderEntry& e : entries)
    if (e.type == PathType::kFolder && HasMetadata(env, JoinPath(dir, e.name))) candidates.push_back(e.name);
  if (candidates.empty() && HasStepFolder(env, JoinPath(dir, kNemoRlWeights))) {
    // A NeMo-RL step: its Megatron weights are a Bridge save folder in policy/weights/.
    std::string inner;
    CKPTFS_RETURN_IF_ERROR(ResolveStepFolder(env, JoinPath(dir, kNemoRlWeights), &inner));
    *step = JoinPath(kNemoRlWeights, inner);
    return Status::OK();
  }
  if (candidates.empty()) return Status::NotFound(dir, "no .metadata file in the folder or its step folders");

  const std::string tracker = JoinPath(dir, kMegatronTracker);
  PathType type;
  CKPTFS_RETURN_IF_ERROR(env.Stat(tracker, &type));
  if (type == PathType::kFile) {
    // Megatron names the latest iteration (or "release") in this file.
    std::string text;
    CKPTFS_RETURN_IF_ERROR(env.ReadSmallFile(tracker, 4096, &text, "the iteration file"));
    text = Trim(text);
    const std::optional<uint64_t> wanted =
        !text.empty() && text.find_first_not_of("0123456789") == std::string::npos ? StepNumber(text) : std::nullopt;
    for (const std::string& c : candidates)
      if (c == text || (wanted && StepNumber(c) == wanted)) {
        *step = c;
        return Status::OK();
      }
    return Status::NotFound(tracker, "names iteration '" + text + "' but no step folder with a .metadata matches it");
  }
  std::optional<uint64_t> best;
  for (const std::string& c : candidates) {
    std::optional<uint64_t> n = StepNumber(c);
    if (n && (!best || *n >= *best)) {
      best = n;
      *step = c;
    }
  }
  if (best) return Status::OK();
  if (candidates.size() == 1) {
    *step = candidates.front();
    return Status::OK();
  }
  return Status::InvalidArgument(dir, "several step folders hold a .metadata and none is numbered; "
                                      "give the one to serve");
}

// The same error with the entry it concerns named after it.
Status Concerning(const Status& s, const std::string& fqn) {
  const std::string what = "while reading '" + fqn + "'";
  switch (s.code()) {
    case Status::Code::kNotFound: return Status::NotFound(s.message(), what).WithLimitOptionOf(s);
    case Status::Code::kCorruption: return Status::Corruption(s.message(), what).WithLimitOptionOf(s);
    case Status::Code::kNotSupported: return Status::NotSupported(s.message(), what).WithLimitOptionOf(s);
    case Status::Code::kInvalidArgument: return Status::InvalidArgument(s.message(), what).WithLimitOptionOf(s);
    case Status::Code::kIOError: return Status::FromErrno(s.message(), what, s.sys_errno()).WithLimitOptionOf(s);
    case Status::Code::kSourceChanged: return Status::SourceChanged(s.message(), what).WithLimitOptionOf(s);
    case Status::Code::kRefused: return Status::Refused(s.message(), what).WithLimitOptionOf(s);
    case Status::Code::kOk: break;
  }
  return s;
}

class DcpReader {
 public:
  DcpReader(std::string folder, const SourceOptions& options, Catalog* catalog)
      : folder_(std::move(folder)), limits_(options.limits), catalog_(catalog) {}

  Status Read(json* info);

 private:
  // The safetensors blob that DCP's safetensors serialization appends to a data file, parsed
  // once however many chunks it holds.
  struct SafetensorsBlob {
    std::string where;  // how messages name it
    SafetensorsHeader header;
    std::unordered_map<std::string, size_t> by_key;  // into header.tensors
    nlohmann::json sharding;                         // DCP_SHARDING_INFO, parsed
  };

  // One chunk of a tensor item, as .metadata describes it.
  struct Chunk {
    std::span<const uint64_t> offsets, sizes;
    const DcpSlice& slice;
  };

  Status Window(const DcpItem& item, const DcpSlice& slice, FileWindow* window);
  // The bytes of a small `window`, from a buffer of its file read ahead of it; empty for a
  // window too large to buffer (the archive then reads what it needs itself).
  Status ReadAhead(const FileWindow& window, std::string_view* bytes);
  Status TorchSaveChunk(const DcpItem& item, const Chunk& chunk, const FileWindow& window, TensorEntry* piece);
  Status SafetensorsChunk(const DcpItem& item, const Chunk& chunk, const FileWindow& blob, TensorEntry* piece);
  Status Blob(const FileWindow& window, const SafetensorsBlob** blob);
  Status AddTensor(const DcpItem& item);
  Status PlaceFragment(const DcpItem& item, const MegatronReformulation& plan, const Chunk& chunk,
                       const TensorEntry& piece, BoxList* out);
  Status AddObject(const DcpItem& item);
  Status PlaceObject(const DcpItem& item, json value);
  Status AddSiblings();

  std::string folder_;
  std::string metadata_path_;
  ReadLimits limits_;
  Catalog* catalog_;
  const DcpMetadata* meta_ = nullptr;
  // Data files by relative path: opened once, whatever the number of chunks.
  std::unordered_map<std::string, uint32_t> data_files_;
  // The same by their number in DcpMetadata::files (a million chunks name 256 files).
  std::vector<std::optional<uint32_t>> file_by_number_;
  std::map<std::pair<uint32_t, uint64_t>, SafetensorsBlob> blobs_;  // by (file, blob start)
  // Per data file: where its safetensors blob starts, or nullopt for the torch_save form.
  std::unordered_map<uint32_t, std::optional<uint64_t>> blob_start_;
  // Chunks read in each serialization, for `ckptfs info`.
  uint64_t torch_save_chunks_ = 0, safetensors_chunks_ = 0;
  // Megatron's reformulated tensors served with their real shapes, for `ckptfs info`: as
  // byte ranges (row-major fragments) or gathered from boxes; and their fragments.
  uint64_t megatron_ranges_ = 0, megatron_gathered_ = 0, megatron_fragments_ = 0;
  // Chunks of one shape pickle identical data.pkl records: each is parsed once.
  PickleCache pickles_;
  // Reopened for every chunk: its buffers are reused, not reallocated a million times.
  TorchArchive chunk_archive_;
  // Per data file, bytes read ahead of its next chunk: torch writes a rank's chunks one after
  // another, so one read serves dozens of small chunk archives (a read per chunk would be a
  // million reads for a million chunks). 64 KiB per file: 16 MiB for 256 ranks.
  static constexpr uint64_t kReadAhead = 64 << 10;
  struct ReadBuffer {
    uint64_t start = 0;
    std::string bytes;
  };
  std::unordered_map<uint32_t, ReadBuffer> read_ahead_;
  json objects_ = json::object();
};

Status DcpReader::Read(json* info) {
  metadata_path_ = JoinPath(folder_, kMetadataName);
  catalog_->layout_file = metadata_path_;
  Env& env = catalog_->files->env();
  std::string bytes;
  CKPTFS_RETURN_IF_ERROR(env.ReadSmallFile(metadata_path_, limits_.pickle_bytes, &bytes, "the .metadata pickle",
                                           "max_pickle"));
  DcpMetadata meta;
  CKPTFS_RETURN_IF_ERROR(ParseDcpMetadata(std::move(bytes), metadata_path_, &meta, limits_));
  meta_ = &meta;
  file_by_number_.assign(meta.files.size(), std::nullopt);

  uint64_t tensors = 0, objects = 0;
  for (const DcpItem& item : meta.items) {
    if (item.is_tensor) {
      CKPTFS_RETURN_IF_ERROR(AddTensor(item));
      ++tensors;
    } else {
      CKPTFS_RETURN_IF_ERROR(AddObject(item));
      ++objects;
    }
  }
  // Two entries whose keys collide (a tensor inside an object named like another) cannot
  // both be served.
  read_ahead_.clear();
  std::unordered_set<std::string_view> keys;
  keys.reserve(catalog_->tensors.size());
  for (const TensorEntry& t : catalog_->tensors)
    if (!keys.insert(t.key).second)
      return Status::NotSupported(metadata_path_, "two tensors have the same key '" + t.key + "'");

  std::set<std::string> ranks;
  for (const auto& [name, index] : data_files_) {
    // __<rank>_<n>.distcp
    if (name.size() > 2 && name.compare(0, 2, "__") == 0) {
      size_t end = name.find('_', 2);
      if (end != std::string::npos) ranks.insert(name.substr(2, end - 2));
    }
  }
  (*info)["version"] = meta.version;
  (*info)["data_files"] = data_files_.size();
  (*info)["ranks"] = ranks.size();
  (*info)["tensors"] = tensors;
  (*info)["objects"] = objects;
  if (torch_save_chunks_ + safetensors_chunks_ > 0)
    (*info)["serialization"] = safetensors_chunks_ == 0 ? "torch_save"
                               : torch_save_chunks_ == 0 ? "safetensors"
                                                         : "torch_save+safetensors";
  if (!meta.storage_meta.is_null()) (*info)["storage_meta"] = meta.storage_meta;
  if (megatron_ranges_ + megatron_gathered_ > 0)
    (*info)["megatron_fragments"] = {{"shapes_from", "mcore_data nd_reformulated_orig_global_shape"},
                                     {"tensors", megatron_ranges_ + megatron_gathered_},
                                     {"fragments", megatron_fragments_},
                                     {"served_as_byte_ranges", megatron_ranges_},
                                     {"gathered", megatron_gathered_}};
  catalog_->metadata = std::move(objects_);
  return AddSiblings();
}

// The window of `slice`, its file opened once, checked to lie inside that file.
Status DcpReader::Window(const DcpItem& item, const DcpSlice& slice, FileWindow* window) {
  std::optional<uint32_t>& file = file_by_number_.at(slice.file);
  if (!file) {
    const std::string& relative_path = meta_->files.at(slice.file);
    const std::string path = JoinPath(folder_, relative_path);
    PathType type;
    CKPTFS_RETURN_IF_ERROR(catalog_->files->env().Stat(path, &type));
    if (type != PathType::kFile)
      return Status::NotFound(path, "data file of '" + item.fqn + "' (named by " + metadata_path_ + ") is missing");
    uint32_t index;
    CKPTFS_RETURN_IF_ERROR(catalog_->files->Add(path, &index));
    data_files_.emplace(relative_path, index);
    file = index;
  }
  const uint64_t size = catalog_->files->size(*file);
  uint64_t end;
  if (!CheckedAdd(slice.offset, slice.length, &end) || end > size)
    return Status::Corruption(catalog_->files->path(*file),
                              "'" + item.fqn + "': slice [" + std::to_string(slice.offset) + ", " +
                                  std::to_string(slice.offset) + "+" + std::to_string(slice.length) +
                                  ") lies outside the file (" + std::to_string(size) + " bytes)");
  *window = FileWindow{*file, slice.offset, slice.length};
  return Status::OK();
}

Status DcpReader::ReadAhead(const FileWindow& window, std::string_view* bytes) {
  *bytes = {};
  if (window.length == 0 || window.length > kReadAhead / 4) return Status::OK();
  ReadBuffer& buffer = read_ahead_[window.file];
  // Window() checked the window lies inside its file.
  if (window.base < buffer.start || window.base + window.length > buffer.start + buffer.bytes.size()) {
    const uint64_t file_size = catalog_->files->size(window.file);
    buffer.start = window.base;
    buffer.bytes.resize(std::min<uint64_t>(kReadAhead, file_size - window.base));
    CKPTFS_RETURN_IF_ERROR(catalog_->files->ReadExact(window.file, buffer.start, buffer.bytes.size(), buffer.bytes.data()));
  }
  *bytes = std::string_view(buffer.bytes).substr(window.base - buffer.start, window.length);
  return Status::OK();
}

// A chunk stored as a torch.save archive in `window`: its one tensor, read in place.
Status DcpReader::TorchSaveChunk(const DcpItem& item, const Chunk& chunk, const FileWindow& window,
                                 TensorEntry* piece) {
  TorchArchive& archive = chunk_archive_;
  std::string_view bytes;
  Status s = ReadAhead(window, &bytes);
  if (!s.ok()) return Concerning(s, item.fqn);
  s = archive.Open(*catalog_->files, window, limits_, ArchiveRecords{}, &pickles_, bytes);
  if (!s.ok()) return Concerning(s, item.fqn);
  bool is_tensor = false;
  s = archive.AsTensor(archive.root(), piece, &is_tensor);
  if (!s.ok()) return Concerning(s, item.fqn);
  if (!is_tensor) return archive.Bad("'" + item.fqn + "': the chunk's archive does not hold a tensor");
  if (piece->dtype != item.dtype)
    return archive.Bad("'" + item.fqn + "': the chunk is " + std::string(Info(piece->dtype).torch_name) +
                       " but .metadata says " + std::string(Info(item.dtype).torch_name));
  if (!std::ranges::equal(piece->shape, chunk.sizes))
    return archive.Bad("'" + item.fqn + "': the chunk's shape differs from its sizes in .metadata");
  return Status::OK();
}

Status DcpReader::Blob(const FileWindow& window, const SafetensorsBlob** out) {
  auto key = std::make_pair(window.file, window.base);
  auto it = blobs_.find(key);
  if (it == blobs_.end()) {
    SafetensorsBlob blob;
    blob.where = catalog_->files->Describe(window);
    CKPTFS_RETURN_IF_ERROR(ParseSafetensorsHeader(*catalog_->files, window, limits_, &blob.header));
    blob.by_key.reserve(blob.header.tensors.size());
    for (size_t i = 0; i < blob.header.tensors.size(); ++i) blob.by_key.emplace(blob.header.tensors[i].key, i);
    // DCP_SHARDING_INFO: a JSON string {fqn: {"saved_offsets": [...]}} saying where in the
    // full tensor each of the blob's tensors goes.
    if (auto info = blob.header.metadata.find("DCP_SHARDING_INFO"); info != blob.header.metadata.end()) {
      blob.sharding = json::parse(info->get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (blob.sharding.is_discarded() || !blob.sharding.is_object())
        return Status::Corruption(blob.where, "safetensors: __metadata__ DCP_SHARDING_INFO is not a JSON object");
    }
    it = blobs_.emplace(key, std::move(blob)).first;
  }
  *out = &it->second;
  return Status::OK();
}

// A chunk stored by DCP's safetensors serialization: the tensor named by the fqn in the
// blob starting at the chunk's slice offset, which must agree with .metadata on dtype,
// shape, byte count and (DCP_SHARDING_INFO) its offsets in the full tensor.
Status DcpReader::SafetensorsChunk(const DcpItem& item, const Chunk& chunk, const FileWindow& window,
                                   TensorEntry* piece) {
  const SafetensorsBlob* blob;
  CKPTFS_RETURN_IF_ERROR(Blob(window, &blob));
  auto bad = [&](const std::string& what) { return Status::Corruption(blob->where, "'" + item.fqn + "': " + what); };
  auto it = blob->by_key.find(item.fqn);
  if (it == blob->by_key.end()) return bad("not in the safetensors blob that .metadata points its chunk to");
  const SafetensorsTensor& tensor = blob->header.tensors[it->second];
  if (tensor.dtype != item.dtype)
    return bad("the chunk is " + std::string(Info(tensor.dtype).torch_name) + " but .metadata says " +
               std::string(Info(item.dtype).torch_name));
  if (!std::ranges::equal(tensor.shape, chunk.sizes)) return bad("the chunk's shape differs from its sizes in .metadata");
  if (tensor.nbytes != chunk.slice.length)
    return bad("the chunk holds " + std::to_string(tensor.nbytes) + " bytes but .metadata gives its length as " +
               std::to_string(chunk.slice.length));
  const json* saved = nullptr;
  if (blob->sharding.is_object())
    if (auto entry = blob->sharding.find(item.fqn); entry != blob->sharding.end() && entry->is_object())
      if (auto offsets = entry->find("saved_offsets"); offsets != entry->end()) saved = &*offsets;
  if (!saved) return bad("the blob's DCP_SHARDING_INFO gives no saved_offsets for it");
  bool same = saved->is_array() && saved->size() == chunk.offsets.size();
  for (size_t d = 0; same && d < chunk.offsets.size(); ++d)
    same = (*saved)[d].is_number_unsigned() && (*saved)[d].get<uint64_t>() == chunk.offsets[d];
  if (!same) return bad("saved_offsets " + saved->dump() + " in DCP_SHARDING_INFO differ from the chunk's offsets in .metadata");
  piece->dtype = tensor.dtype;
  piece->shape = tensor.shape;
  if (tensor.nbytes > 0) piece->boxes.push_back(Box::Range(window.file, tensor.data_offset, 0, piece->numel()));
  return Status::OK();
}

Status DcpReader::AddTensor(const DcpItem& item) {
  TensorEntry entry;
  entry.key = item.fqn;
  entry.path = item.path;
  entry.dtype = item.dtype;
  entry.shape = item.shape;
  // Replicated chunks (one per rank holding a copy) share their offsets: serve the first
  // of each, in .metadata order.
  std::vector<size_t> distinct(item.chunk_count());
  for (size_t k = 0; k < distinct.size(); ++k) distinct[k] = k;
  if (distinct.size() > 1) {
    auto by_offsets = [&](size_t a, size_t b) {
      const auto oa = item.offsets(a), ob = item.offsets(b);
      if (std::lexicographical_compare(oa.begin(), oa.end(), ob.begin(), ob.end())) return true;
      return std::ranges::equal(oa, ob) && a < b;
    };
    std::sort(distinct.begin(), distinct.end(), by_offsets);
    auto repeat = std::unique(distinct.begin(), distinct.end(),
                              [&](size_t a, size_t b) { return std::ranges::equal(item.offsets(a), item.offsets(b)); });
    distinct.erase(repeat, distinct.end());
    std::sort(distinct.begin(), distinct.end());
  }
  // Megatron's fragments: the real shape from mcore_data, each fragment placed in it.
  MegatronReformulation megatron;
  if (item.megatron_reformulated) {
    std::string why;
    if (!PlanMegatronReformulation(item.megatron_shape, item.shape, &megatron, &why))
      return Status::NotSupported(metadata_path_, "'" + item.fqn + "': Megatron flattened fragments of real shape " +
                                                      ShapeText(item.megatron_shape) + " cannot be served: " + why);
    entry.shape = item.megatron_shape;
  }
  // The whole tensor in one archive (every world-size-1 save): its boxes are the tensor's
  // as they are, whether a byte range or a strided view.
  const bool single = !item.megatron_reformulated && distinct.size() == 1 &&
                      std::ranges::equal(item.sizes(distinct.front()), item.shape);
  entry.boxes.reserve(distinct.size());
  for (size_t k : distinct) {
    const Chunk c{item.offsets(k), item.sizes(k), item.chunk_slices[k]};
    const Chunk* chunk = &c;
    FileWindow window;
    CKPTFS_RETURN_IF_ERROR(Window(item, chunk->slice, &window));
    TensorEntry piece;
    // The safetensors serialization records every tensor chunk of a file at the start of the
    // file's one safetensors blob (torch takes the offset before it writes the blob); a
    // torch.save slice starts with a zip local header instead. torch writes a whole save in
    // one form, so the form is told once per file, on its first tensor chunk.
    const uint64_t file_size = catalog_->files->size(window.file);
    auto [form, first] = blob_start_.try_emplace(window.file);
    if (first && LooksLikeSafetensors(*catalog_->files, FileWindow{window.file, window.base, file_size - window.base}))
      form->second = window.base;
    if (form->second) {
      if (*form->second != window.base)
        return Status::Corruption(catalog_->files->path(window.file),
                                  "'" + item.fqn + "': its chunk is at byte " + std::to_string(window.base) +
                                      " but this file's chunks are in the safetensors blob at byte " +
                                      std::to_string(*form->second));
      const FileWindow blob{window.file, window.base, file_size - window.base};
      CKPTFS_RETURN_IF_ERROR(SafetensorsChunk(item, *chunk, blob, &piece));
      ++safetensors_chunks_;
    } else {
      CKPTFS_RETURN_IF_ERROR(TorchSaveChunk(item, *chunk, window, &piece));
      ++torch_save_chunks_;
    }
    if (single) {
      entry.boxes = std::move(piece.boxes);
      entry.storage_id = std::move(piece.storage_id);
      break;
    }
    if (item.megatron_reformulated) {
      CKPTFS_RETURN_IF_ERROR(PlaceFragment(item, megatron, *chunk, piece, &entry.boxes));
      continue;
    }
    // A block of the tensor: the chunk's boxes move to the chunk's offsets.
    if (!PlaceChunkBoxes(std::move(piece.boxes), chunk->offsets, chunk->sizes, &entry.boxes))
      return Status::Corruption(metadata_path_, "'" + item.fqn + "': chunk size overflows");
  }
  if (item.megatron_reformulated) ++(megatron.row_major ? megatron_ranges_ : megatron_gathered_);
  if (catalog_->tensors.size() >= limits_.tensors)
    return Status::Refused(metadata_path_, "more than " + std::to_string(limits_.tensors) + " tensors")
        .WithLimitOption("max_tensors");
  catalog_->tensors.push_back(std::move(entry));
  return Status::OK();
}

// One of Megatron's fragments: the chunk's elements must be stored contiguously (a 1-D
// flattened range is saved as one), then they are placed in the real tensor.
Status DcpReader::PlaceFragment(const DcpItem& item, const MegatronReformulation& plan, const Chunk& chunk,
                                const TensorEntry& piece, BoxList* out) {
  ++megatron_fragments_;
  if (piece.numel() == 0) return Status::OK();
  std::optional<uint64_t> base;
  if (piece.boxes.size() == 1) {
    const Box& box = piece.boxes.front();
    bool contiguous = std::ranges::all_of(box.offset, [](uint64_t o) { return o == 0; });
    uint64_t stride = 1;
    for (size_t d = box.rank(); contiguous && d-- > 0;) {
      if (box.extent[d] != 1 && box.strides[d] != stride) contiguous = false;
      stride *= box.extent[d];
    }
    if (contiguous) base = box.base_offset;
  }
  if (!base)
    return Status::NotSupported(metadata_path_, "'" + item.fqn + "': a Megatron flattened fragment is not stored "
                                                "as one contiguous run, so it cannot be placed in the real shape");
  std::string why;
  if (!PlaceMegatronFragment(plan, chunk.offsets, chunk.sizes, piece.boxes.front().file, *base,
                             Info(item.dtype).itemsize, out, &why))
    return Status::Corruption(metadata_path_, "'" + item.fqn + "': " + why);
  return Status::OK();
}

Status DcpReader::AddObject(const DcpItem& item) {
  FileWindow window;
  CKPTFS_RETURN_IF_ERROR(Window(item, item.object, &window));
  // Decoded into a catalog of its own: tensors found inside the object are served under
  // the object's key.
  Catalog object;
  object.files = catalog_->files;
  json value;
  Status s = ReadTorchZip(window, &object, &value, limits_);
  if (!s.ok()) return Concerning(s, item.fqn);
  for (TensorEntry& t : object.tensors) {
    std::vector<PathElement> path = item.path;
    path.insert(path.end(), t.path.begin(), t.path.end());
    t.key = t.path.empty() ? item.fqn : item.fqn + "." + FlattenKey(t.path);
    t.path = std::move(path);
    if (catalog_->tensors.size() >= limits_.tensors)
      return Status::Refused(metadata_path_, "more than " + std::to_string(limits_.tensors) + " tensors")
          .WithLimitOption("max_tensors");
    catalog_->tensors.push_back(std::move(t));
  }
  return PlaceObject(item, std::move(value));
}

// Puts an object's JSON at its planner_data path in metadata.json: every key, str or int,
// becomes an object key (ints in decimal), so list positions read as "0", "1", ...
Status DcpReader::PlaceObject(const DcpItem& item, json value) {
  json* node = &objects_;
  for (size_t i = 0; i < item.path.size(); ++i) {
    const PathElement& e = item.path[i];
    const std::string name = std::holds_alternative<std::string>(e) ? std::get<std::string>(e)
                                                                    : std::to_string(std::get<int64_t>(e));
    if (!node->is_object())
      return Status::Corruption(metadata_path_, "'" + item.fqn + "': its planner_data path runs through a value");
    node = &(*node)[name];
    if (i + 1 < item.path.size() && node->is_null()) *node = json::object();
  }
  if (!node->is_null()) return Status::Corruption(metadata_path_, "'" + item.fqn + "': two objects share its path");
  *node = std::move(value);
  return Status::OK();
}

// Files beside .metadata that no chunk reads (Megatron's common.pt and metadata.json, a
// README) are served as they are; .distcp files that nothing references are not.
Status DcpReader::AddSiblings() {
  return AddFolderSiblingFiles(
      folder_,
      [this](const std::string& name) {
        return data_files_.count(name) > 0 || (name.size() > 7 && name.compare(name.size() - 7, 7, ".distcp") == 0);
      },
      catalog_);
}

}  // namespace

bool IsDcpFolder(Env& env, const std::string& dir) {
  return HasMetadata(env, dir) || HasStepFolder(env, dir) || HasStepFolder(env, JoinPath(dir, kNemoRlWeights));
}

Status ReadDcpCheckpoint(const std::string& dir, const SourceOptions& options, Catalog* catalog) {
  catalog->format = "dcp";
  Env& env = catalog->files->env();
  std::string step;
  CKPTFS_RETURN_IF_ERROR(ResolveStepFolder(env, dir, &step));
  const std::string folder = step.empty() ? dir : JoinPath(dir, step);
  json info = json::object();
  if (!step.empty()) {
    info["step_folder"] = step;
    if (std::optional<uint64_t> n = StepNumber(step)) info["step"] = *n;
  }
  DcpReader reader(folder, options, catalog);
  CKPTFS_RETURN_IF_ERROR(reader.Read(&info));
  std::string framework;
  // The framework's own config file first: Bridge prefers run_config.yaml to common.pt's args.
  ModelDescription model;
  CKPTFS_RETURN_IF_ERROR(AddFrameworkModelConfig(env, dir, folder, &model, &framework));
  if (!model.source.empty() || !model.error.empty()) catalog->model = std::move(model);
  if (!framework.empty()) info["framework"] = step.rfind(kNemoRlWeights, 0) == 0 ? "NeMo-RL" : framework;
  // The checkpoint's own objects keep their keys; the reader's summary goes beside them.
  catalog->metadata[catalog->metadata.contains("dcp") ? "$dcp" : "dcp"] = std::move(info);
  AddMegatronModelConfig(folder, options.limits, catalog);
  // What the config leaves unsaid (an older Megatron-LM's args), the tensors may prove.
  AddMegatronTensorFacts(catalog);
  if (catalog->model) AddModelDescriptionToMetadata(*catalog->model, &catalog->metadata);
  return Status::OK();
}

extern const ReaderEntry kDcpReader = {
    "dcp", "torch.distributed.checkpoint folder, or a run folder of step folders", {"dcp"}, DetectFolderOf<IsDcpFolder>,
    ReadFolderOf<ReadDcpCheckpoint>};

}  // namespace ckptfs
