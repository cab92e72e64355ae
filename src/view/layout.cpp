// Builds the virtual tree (the mount layout of README.md, "Mounting"):
//   model.safetensors, tensors/<escaped key>.safetensors, manifest.json, metadata.json,
//   and the sibling files of a model folder, passed through unchanged.
#include <algorithm>
#include <numeric>
#include <map>
#include <set>
#include <string_view>
#include <utility>

#include <xxhash.h>

#include "ckptfs/names.hpp"
#include "ckptfs/view.hpp"
#include "io/json_text.hpp"
#include "view/safetensors_header.hpp"

namespace ckptfs {

using json = nlohmann::json;

static void AppendManifestEntry(std::string* text, const TensorEntry& t, const std::string& model_file,
                                const View::ModelPlace& place, const char* xxh3_hex, bool shares_storage,
                                bool first);

class ViewBuilder {
 public:
  ViewBuilder(std::shared_ptr<const Catalog> catalog, const ViewOptions& options, View* view)
      : catalog_(*catalog), options_(options), view_(view) {
    view_->catalog_ = std::move(catalog);
  }

  Status Build();

 private:
  View::NodeId AddNode(View::NodeId parent, std::string name, bool is_dir);
  void AddLiteral(std::string bytes, uint64_t* pos);
  void AddTensorData(size_t index, uint64_t* pos);
  void FinishFile(View::NodeId id, uint64_t size, int64_t mtime_ns);
  int64_t TensorMTime(size_t index) const;
  using ModelPlace = View::ModelPlace;
  void BuildSafetensorsFile(View::NodeId root, const std::string& name, const std::vector<size_t>& members,
                            std::vector<ModelPlace>* places);
  void BuildModelFiles(View::NodeId root, std::vector<ModelPlace>* places);
  Status BuildTensorFiles(View::NodeId root);
  Status BuildManifest(View::NodeId root);

  const Catalog& catalog_;
  const ViewOptions& options_;
  View* view_;
  int64_t newest_mtime_ = 0;
  View::NodeId tensors_dir_ = View::kRoot;
  std::set<std::string> hidden_siblings_;
  std::vector<std::string>& model_files_ = view_->model_files_;
};

View::NodeId ViewBuilder::AddNode(View::NodeId parent, std::string name, bool is_dir) {
  View::NodeId id = static_cast<View::NodeId>(view_->nodes_.size());
  View::Node node;
  node.name = std::move(name);
  node.parent = parent;
  node.is_dir = is_dir;
  node.mtime_ns = newest_mtime_;
  node.first_segment = static_cast<uint32_t>(view_->segments_.size());
  view_->nodes_.push_back(std::move(node));
  if (id != View::kRoot) view_->nodes_[parent].children.push_back(id);
  return id;
}

void ViewBuilder::AddLiteral(std::string bytes, uint64_t* pos) {
  Segment seg;
  seg.kind = Segment::Kind::kLiteral;
  seg.ref = static_cast<uint32_t>(view_->literals_.size());
  seg.start = *pos;
  seg.length = bytes.size();
  *pos += bytes.size();
  view_->literals_.push_back(std::move(bytes));
  view_->segments_.push_back(seg);
}

void ViewBuilder::AddTensorData(size_t index, uint64_t* pos) {
  const TensorEntry& t = catalog_.tensors[index];
  const ReadRoute route = RouteOf(t);
  if (route == ReadRoute::kExtents) {
    for (const Extent& e : ExtentsOf(t)) {
      Segment seg;
      seg.kind = Segment::Kind::kExtent;
      seg.ref = e.file;
      seg.start = *pos;
      seg.length = e.length;
      seg.source_offset = e.offset;
      *pos += e.length;
      view_->segments_.push_back(seg);
    }
    return;
  }
  if (t.served_nbytes() == 0) return;
  Segment seg;
  seg.kind = route == ReadRoute::kConvert ? Segment::Kind::kConvert : Segment::Kind::kGather;
  seg.ref = static_cast<uint32_t>(index);
  seg.start = *pos;
  seg.length = t.served_nbytes();
  *pos += seg.length;
  view_->segments_.push_back(seg);
}

void ViewBuilder::FinishFile(View::NodeId id, uint64_t size, int64_t mtime_ns) {
  View::Node& n = view_->nodes_[id];
  n.size = size;
  n.mtime_ns = mtime_ns;
  n.segment_count = static_cast<uint32_t>(view_->segments_.size() - n.first_segment);
}

int64_t ViewBuilder::TensorMTime(size_t index) const {
  const TensorEntry& t = catalog_.tensors[index];
  int64_t m = 0;
  for (const Box& box : t.boxes) m = std::max(m, catalog_.files->identity(box.file).mtime_ns);
  return m == 0 ? newest_mtime_ : m;
}

// One safetensors file holding `members` (tensor indices); records where each landed.
void ViewBuilder::BuildSafetensorsFile(View::NodeId root, const std::string& name, const std::vector<size_t>& members,
                                       std::vector<ModelPlace>* places) {
  // Lay data out by descending item size (the reference writer's order), keeping catalog
  // order among equals: every tensor is then aligned to its element size.
  const auto& tensors = catalog_.tensors;
  // Item sizes are few (1 to 16 bytes): one stable pass per size, largest first, instead of
  // a comparison sort of a million indices.
  auto served_itemsize = [&](size_t i) { return Info(ServedAs(tensors[i].served_dtype()).dtype).itemsize; };
  std::vector<size_t> order;
  order.reserve(members.size());
  for (uint64_t size = 16; size >= 1; size /= 2)
    for (size_t i : members)
      if (served_itemsize(i) == size) order.push_back(i);
  if (order.size() != members.size()) {  // an item size that is no power of two up to 16
    order = members;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return served_itemsize(a) > served_itemsize(b); });
  }
  // The header is written straight from the catalog into literal segments of about 1 MB
  // each: a list of header entries and one string grown by doubling held ~250 MB of a
  // million-tensor View's build.
  View::NodeId id = AddNode(root, name, false);
  const uint32_t first_literal = static_cast<uint32_t>(view_->literals_.size());
  uint64_t pos = 0;
  constexpr size_t kPiece = size_t{1} << 20;
  std::string piece;
  piece.reserve(kPiece + 4096);  // grown by doubling, each piece held up to twice its size
  AppendSafetensorsHeaderStart(&piece);
  HeaderEntry e;
  uint64_t offset = 0;
  for (size_t i : order) {
    e.key = tensors[i].key;
    ServedDTypeAndShape(tensors[i], &e.dtype, &e.shape);
    e.begin = offset;
    offset += tensors[i].served_nbytes();
    e.end = offset;
    AppendSafetensorsHeaderEntry(e, &piece);
    if (piece.size() >= kPiece) {
      AddLiteral(std::move(piece), &pos);
      piece = std::string();
      piece.reserve(kPiece + 4096);
    }
  }
  // The end, as AppendSafetensorsHeaderEnd writes it, with the length in the first piece.
  piece += '}';
  const uint64_t json_size = pos + piece.size() - 8;
  piece.append((8 - json_size % 8) % 8, ' ');
  AddLiteral(std::move(piece), &pos);
  const uint64_t padded_size = pos - 8;
  for (int b = 0; b < 8; ++b) view_->literals_[first_literal][b] = static_cast<char>((padded_size >> (8 * b)) & 0xFF);

  const uint32_t file_index = static_cast<uint32_t>(model_files_.size());
  model_files_.push_back(name);
  for (size_t i : order) {
    const uint64_t begin = pos;
    AddTensorData(i, &pos);
    (*places)[i] = ModelPlace{file_index, begin, pos};
  }
  FinishFile(id, pos, newest_mtime_);
}

// model.safetensors, or with a shard size the Hugging Face layout: shards split in catalog
// order as huggingface_hub's split_state_dict_into_shards does (a tensor over the limit
// gets a shard of its own; tensors sharing storage follow the first one's shard and do not
// count toward sizes), plus model.safetensors.index.json.
void ViewBuilder::BuildModelFiles(View::NodeId root, std::vector<ModelPlace>* places) {
  const auto& tensors = catalog_.tensors;
  places->assign(tensors.size(), ModelPlace{});
  std::vector<size_t> all(tensors.size());
  std::iota(all.begin(), all.end(), 0);
  if (options_.shard_size == 0) return BuildSafetensorsFile(root, "model.safetensors", all, places);

  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_size = 0, total_size = 0;
  std::map<std::string, size_t> first_of_storage;  // storage id -> first tensor
  std::vector<size_t> followers;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorEntry& t = tensors[i];
    if (!t.storage_id.empty()) {
      if (first_of_storage.count(t.storage_id)) {
        followers.push_back(i);
        continue;
      }
      first_of_storage[t.storage_id] = i;
    }
    const uint64_t size = t.served_nbytes();
    total_size += size;
    if (size > options_.shard_size) {
      shards.push_back({i});
      continue;
    }
    if (current_size + size > options_.shard_size) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += size;
  }
  if (!current.empty()) shards.push_back(std::move(current));
  for (size_t i : followers) {
    const size_t first = first_of_storage[tensors[i].storage_id];
    for (auto& shard : shards)
      if (std::find(shard.begin(), shard.end(), first) != shard.end()) {
        shard.push_back(i);
        break;
      }
  }
  for (auto& shard : shards) std::sort(shard.begin(), shard.end());  // catalog order within a shard
  if (shards.size() <= 1) return BuildSafetensorsFile(root, "model.safetensors", all, places);

  char name[64];
  std::vector<std::string> names;
  for (size_t k = 0; k < shards.size(); ++k) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    names.emplace_back(name);
    BuildSafetensorsFile(root, name, shards[k], places);
  }
  json index;
  index["metadata"] = {{"total_size", total_size}};
  json weight_map = json::object();
  for (size_t i = 0; i < tensors.size(); ++i) weight_map[tensors[i].key] = model_files_[(*places)[i].file];
  index["weight_map"] = std::move(weight_map);
  View::NodeId id = AddNode(root, "model.safetensors.index.json", false);
  uint64_t pos = 0;
  AddLiteral(index.dump(2, ' ', false, json::error_handler_t::replace) + "\n", &pos);
  FinishFile(id, pos, newest_mtime_);
}

Status ViewBuilder::BuildTensorFiles(View::NodeId root) {
  tensors_dir_ = AddNode(root, "tensors", true);
  view_->tensor_files_.resize(catalog_.tensors.size());
  view_->nodes_[tensors_dir_].children.reserve(catalog_.tensors.size());
  std::string scratch;  // one buffer for every header, measured and dropped
  for (size_t i = 0; i < catalog_.tensors.size(); ++i) {
    const TensorEntry& t = catalog_.tensors[i];
    // Two keys mapping to one file name are found once the folder is sorted (Build): a set
    // of a million names cost ~100 MB and a second of a mount.
    // No segments: a per-tensor file is its header, made on read, then the tensor's data
    // (View::ReadTensorFile). Two segments each were 64 MB of a million-tensor View.
    View::NodeId id = AddNode(tensors_dir_, TensorFileName(t.key), false);
    view_->nodes_[id].tensor = static_cast<int64_t>(i);
    scratch.clear();
    AppendTensorFileHeader(t, &scratch);
    FinishFile(id, scratch.size() + t.served_nbytes(), TensorMTime(i));
    view_->tensor_files_[i] = id;
  }
  return Status::OK();
}

Status ViewBuilder::BuildManifest(View::NodeId root) {
  json m;
  m["ckptfs_manifest_version"] = 1;
  json files = json::array();
  for (uint32_t f = 0; f < catalog_.files->count(); ++f)
    files.push_back({{"path", catalog_.files->path(f)},
                     {"size", catalog_.files->size(f)},
                     {"mtime_ns", catalog_.files->identity(f).mtime_ns}});
  m["source"] = {{"path", catalog_.source}, {"format", catalog_.format}, {"files", std::move(files)}};
  // The file a loader opens: the single model file, or the shard index. A linear scan: the
  // root's children are sorted (and View::Child's binary search valid) only once Build ends.
  bool single_file = false;
  for (View::NodeId c : view_->nodes_[root].children) single_file |= view_->nodes_[c].name == "model.safetensors";
  m["model_file"] = single_file ? "model.safetensors" : "model.safetensors.index.json";
  if (options_.dtype) m["dtype"] = Info(*options_.dtype).safetensors_name;
  if (!options_.root.empty()) m["root"] = options_.root;
  if (options_.shard_size) m["shard_size"] = options_.shard_size;
  // Storage shared by several tensors (tied weights): name the group on each member.
  // Found by sorting (hash of id, tensor) pairs and comparing the ids only within a run of
  // equal hashes: a map of a million ids took ~100 MB and a second, and sorting the ids as
  // strings (a cache miss per comparison) most of a remount's View build.
  std::vector<bool>& shares_storage = view_->shares_storage_;
  shares_storage.assign(catalog_.tensors.size(), false);
  {
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    for (size_t i = 0; i < catalog_.tensors.size(); ++i) {
      const std::string& id = catalog_.tensors[i].storage_id;
      if (!id.empty()) ids.emplace_back(XXH3_64bits(id.data(), id.size()), static_cast<uint32_t>(i));
    }
    std::sort(ids.begin(), ids.end());
    for (size_t k = 0; k < ids.size();) {
      size_t end = k + 1;
      while (end < ids.size() && ids[end].first == ids[k].first) ++end;
      for (size_t a = k; a < end; ++a)  // a run is one id, or rarely a few colliding ones
        for (size_t b = a + 1; b < end; ++b)
          if (catalog_.tensors[ids[a].second].storage_id == catalog_.tensors[ids[b].second].storage_id)
            shares_storage[ids[a].second] = shares_storage[ids[b].second] = true;
      k = end;
    }
  }
  if (!hidden_siblings_.empty()) m["hidden_sibling_files"] = hidden_siblings_;
  // The per-tensor entries are written as text: a json tree of 100,000 entries took most
  // of a mount's start-up time and doubled its peak memory.
  std::string head = m.dump(1, ' ', false, json::error_handler_t::replace);
  head.pop_back();  // the closing brace; "tensors" goes last
  head += ",\n \"tensors\": [";
  const std::string tail = catalog_.tensors.empty() ? "]\n}\n" : "\n ]\n}\n";
  const auto& places = view_->model_places_;
  if (options_.checksums) {
    // Hashing reads every tensor: the entries are made once, here, and kept.
    std::string text = std::move(head);
    for (size_t i = 0; i < catalog_.tensors.size(); ++i) {
      uint64_t hash = 0;
      CKPTFS_RETURN_IF_ERROR(view_->Xxh3(view_->tensor_files_[i], &hash));
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
      AppendManifestEntry(&text, catalog_.tensors[i], model_files_[places[i].file], places[i], hex,
                          view_->shares_storage_[i], i == 0);
    }
    text += tail;
    View::NodeId id = AddNode(root, "manifest.json", false);
    uint64_t pos = 0;
    AddLiteral(std::move(text), &pos);
    FinishFile(id, pos, newest_mtime_);
    return Status::OK();
  }
  // Each tensor's entry is a segment made on read (View::ManifestEntry): only its length
  // is kept. As one text, a million entries held ~250 MB for a file few ever read.
  View::NodeId id = AddNode(root, "manifest.json", false);
  uint64_t pos = 0;
  AddLiteral(std::move(head), &pos);
  std::string scratch;  // one buffer for every entry's text, measured and dropped
  for (size_t i = 0; i < catalog_.tensors.size(); ++i) {
    Segment entry;
    entry.kind = Segment::Kind::kManifestEntry;
    entry.ref = static_cast<uint32_t>(i);
    entry.start = pos;
    scratch.clear();
    view_->AppendManifestEntry(i, &scratch);
    entry.length = scratch.size();
    pos += entry.length;
    view_->segments_.push_back(entry);
  }
  AddLiteral(tail, &pos);
  FinishFile(id, pos, newest_mtime_);
  return Status::OK();
}

// One tensor's entry in manifest.json, preceded by its separator; `xxh3_hex` may be null.
static void AppendManifestEntry(std::string* text, const TensorEntry& t, const std::string& model_file,
                                const View::ModelPlace& place, const char* xxh3_hex, bool shares_storage,
                                bool first) {
  *text += first ? "\n  {" : ",\n  {";
  bool shortened = false;
  AppendTensorSummary(text, t, &shortened);
  *text += ", \"model_file\": ";
  AppendJsonString(text, model_file);
  *text += ", \"model_offsets\": [";
  AppendDecimal(text, place.begin);
  *text += ", ";
  AppendDecimal(text, place.end);
  *text += ']';
  if (xxh3_hex) {
    *text += ", \"xxh3\": \"";
    *text += xxh3_hex;
    *text += '"';
  }
  if (shares_storage) {
    *text += ", \"shared_storage\": ";
    AppendJsonString(text, t.storage_id);
  }
  if (shortened) *text += ", \"file_name_shortened\": true";
  *text += '}';
}

void View::AppendManifestEntry(size_t index, std::string* text) const {
  const ModelPlace& place = model_places_[index];
  ckptfs::AppendManifestEntry(text, catalog_->tensors[index], model_files_[place.file], place, nullptr,
                              shares_storage_[index], index == 0);
}

Status ViewBuilder::Build() {
  for (uint32_t f = 0; f < catalog_.files->count(); ++f)
    newest_mtime_ = std::max(newest_mtime_, catalog_.files->identity(f).mtime_ns);
  // A node and about two segments per tensor (its model file's data, its manifest entry),
  // plus the model header's pieces (~100 bytes per tensor, 1 MB a piece): reserved, the
  // vectors are not copied as they grow (a million-tensor mount's peak memory held two
  // copies of each).
  const size_t tensor_count = catalog_.tensors.size();
  view_->nodes_.reserve(tensor_count + catalog_.sibling_files.size() + 16);
  view_->segments_.reserve(2 * tensor_count + tensor_count / 1024 + catalog_.sibling_files.size() + 64);
  View::NodeId root = AddNode(View::kRoot, "", true);

  BuildModelFiles(root, &view_->model_places_);
  CKPTFS_RETURN_IF_ERROR(BuildTensorFiles(root));
  View::NodeId meta = AddNode(root, "metadata.json", false);
  uint64_t pos = 0;
  AddLiteral(catalog_.metadata.dump(1, ' ', false, json::error_handler_t::replace) + "\n", &pos);
  FinishFile(meta, pos, newest_mtime_);

  std::set<std::string> ours = {"tensors", "metadata.json", "manifest.json"};
  for (View::NodeId c : view_->nodes_[root].children) ours.insert(view_->nodes_[c].name);
  for (uint32_t f : catalog_.sibling_files) {
    const std::string& path = catalog_.files->path(f);
    std::string name = path.substr(path.rfind('/') + 1);
    if (ours.count(name)) {
      hidden_siblings_.insert(name);  // the generated file of that name wins
      continue;
    }
    View::NodeId id = AddNode(root, name, false);
    uint64_t spos = 0;
    Segment seg;
    seg.kind = Segment::Kind::kExtent;
    seg.ref = f;
    seg.length = catalog_.files->size(f);
    if (seg.length > 0) view_->segments_.push_back(seg);
    spos = seg.length;
    FinishFile(id, spos, catalog_.files->identity(f).mtime_ns);
  }
  CKPTFS_RETURN_IF_ERROR(BuildManifest(root));

  // Sorted by (name, id) pairs held side by side: comparing through nodes_ costs a cache
  // miss per comparison, and a folder of a million tensor files sorted that way took seconds.
  // A merge sort: on such a folder (names that differ only in their numbers, "layers.1",
  // "layers.10") std::sort spent its time in its heap-sort fallback.
  std::vector<std::pair<std::string_view, View::NodeId>> keyed;
  for (View::Node& n : view_->nodes_) {
    if (!n.is_dir) continue;
    keyed.clear();
    keyed.reserve(n.children.size());
    for (View::NodeId c : n.children) keyed.emplace_back(view_->nodes_[c].name, c);
    std::stable_sort(keyed.begin(), keyed.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < keyed.size(); ++i) n.children[i] = keyed[i].second;
  }
  const std::vector<View::NodeId>& tensor_names = view_->nodes_[tensors_dir_].children;
  for (size_t i = 1; i < tensor_names.size(); ++i) {
    const std::string& name = view_->nodes_[tensor_names[i]].name;
    if (name == view_->nodes_[tensor_names[i - 1]].name)
      return Status::NotSupported(catalog_.source, "two tensor keys map to the file name '" + name + "'");
  }
  return Status::OK();
}

json TensorSummary(const TensorEntry& t) {
  std::string_view dtype;
  std::vector<uint64_t> shape;
  ServedDTypeAndShape(t, &dtype, &shape);
  json path = json::array();
  for (const PathElement& p : t.path) {
    if (const auto* s = std::get_if<std::string>(&p)) path.push_back(*s);
    else path.push_back(std::get<int64_t>(p));
  }
  return {{"key", t.key},
          {"path", std::move(path)},
          {"dtype", dtype},
          {"torch_dtype", Info(t.dtype).torch_name},
          {"shape", std::move(shape)},
          {"nbytes", t.served_nbytes()},
          {"file", "tensors/" + TensorFileName(t.key)}};
}

void AppendTensorSummary(std::string* out, const TensorEntry& t, bool* file_name_shortened) {
  std::string_view dtype;
  std::vector<uint64_t> shape;
  ServedDTypeAndShape(t, &dtype, &shape);
  *out += "\"key\": ";
  AppendJsonString(out, t.key);
  *out += ", \"path\": [";
  bool first = true;
  t.path.ForEach(
      [&](std::string_view s) {
        if (!first) *out += ", ";
        first = false;
        AppendJsonString(out, s);
      },
      [&](int64_t i) {
        if (!first) *out += ", ";
        first = false;
        *out += std::to_string(i);
      });
  *out += "], \"dtype\": \"";
  *out += dtype;
  *out += "\", \"torch_dtype\": \"";
  *out += Info(t.dtype).torch_name;
  *out += "\", \"shape\": ";
  AppendJsonArray(out, shape);
  *out += ", \"nbytes\": ";
  AppendDecimal(out, t.served_nbytes());
  *out += ", \"file\": ";
  // One buffer per thread for the file name: a million entries made a million strings.
  thread_local std::string file;
  file.assign("tensors/");
  AppendTensorFileName(&file, t.key, file_name_shortened);
  AppendJsonString(out, file);
}

Status View::Build(std::shared_ptr<const Catalog> catalog, const ViewOptions& options,
                   std::unique_ptr<View>* out) {
  std::shared_ptr<const Catalog> presented;
  CKPTFS_RETURN_IF_ERROR(ApplyViewOptions(std::move(catalog), options, &presented));
  std::unique_ptr<View> view(new View());
  ViewBuilder builder(std::move(presented), options, view.get());
  CKPTFS_RETURN_IF_ERROR(builder.Build());
  *out = std::move(view);
  return Status::OK();
}

}  // namespace ckptfs
