// `ckptfs ls` and `ckptfs info`: what a checkpoint holds, from its catalog alone
// (no tensor bytes are read, so both run in time proportional to the tensor count).
#include <sys/xattr.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string_view>

#include "ckptfs/catalog.hpp"
#include "ckptfs/names.hpp"
#include "ckptfs/view.hpp"
#include "cli/commands.hpp"
#include "io/json_text.hpp"

namespace ckptfs::cli {
namespace {

using json = nlohmann::json;

constexpr char kLsUsage[] =
    "usage: ckptfs ls [--json] [OPTIONS] SOURCE\n"
    "\n"
    "Lists the tensors of SOURCE in checkpoint order: key, dtype, shape and size in bytes,\n"
    "as the virtual safetensors files serve them.\n"
    "  --json            print a JSON array of {key, path, dtype, torch_dtype, shape, nbytes, file}\n";
constexpr CommandLine kLs = {kLsUsage, true, kReadCommandGroups, 1, "ls takes one SOURCE"};

constexpr char kInfoUsageHead[] =
    "usage: ckptfs info [--json] [OPTIONS] SOURCE\n"
    "\n"
    "Prints the format (one of those below), source files, tensor count, total tensor bytes,\n"
    "bytes per dtype and a summary of the non-tensor metadata of SOURCE; for a source that is\n"
    "fetched (a URL), the requests and bytes building the catalog fetched.\n"
    "\n"
    "formats:\n";
constexpr char kInfoUsageTail[] =
    "\n"
    "  --json            print the same as one JSON object\n";

// The usage names the formats of the reader registry.
const CommandLine& InfoCommand() {
  static const std::string usage = kInfoUsageHead + FormatsHelp() + kInfoUsageTail;
  static const CommandLine info = {usage.c_str(), true, kReadCommandGroups, 1, "info takes one SOURCE"};
  return info;
}

void WriteAll(const std::string& s) { std::fwrite(s.data(), 1, s.size(), stdout); }

// What the root of a ckptfs mount at `path` says of passthrough (its user.ckptfs.passthrough
// xattr), or null when `path` is no such root.
json MountPassthrough(const std::string& path) {
  constexpr const char* kName = "user.ckptfs.passthrough";
  const ssize_t size = ::getxattr(path.c_str(), kName, nullptr, 0);
  if (size <= 0) return nullptr;
  std::string value(static_cast<size_t>(size), '\0');
  const ssize_t n = ::getxattr(path.c_str(), kName, value.data(), value.size());
  if (n <= 0) return nullptr;
  value.resize(static_cast<size_t>(n));
  json parsed = json::parse(value, nullptr, /*allow_exceptions=*/false);
  return parsed.is_object() ? parsed : json(nullptr);
}

// Whether `v` is a small record: at most 12 entries, each a scalar, a short array, or (up
// to `depth` levels) a small record itself.
bool IsSmallRecord(const json& v, int depth) {
  if (!v.is_object() || v.size() > 12) return false;
  for (const auto& item : v)
    if (!(item.is_primitive() || (item.is_array() && item.size() <= 8) || (depth > 0 && IsSmallRecord(item, depth - 1))))
      return false;
  return true;
}

// A short form of a metadata value: scalars and small records (e.g. "deepspeed": stage,
// world size, version; "dcp": the step served, ranks, the writer's storage_meta) as they
// are, bigger containers by size.
json Summarize(const json& v) {
  if (v.is_object()) {
    if (IsSmallRecord(v, 1)) return v;
    return "{" + std::to_string(v.size()) + " keys}";
  }
  if (v.is_array()) return "[" + std::to_string(v.size()) + " items]";
  if (v.is_string() && v.get_ref<const std::string&>().size() > 60) return v.get<std::string>().substr(0, 57) + "...";
  return v;
}

// The "folder" entry a folder reader leaves in the catalog's metadata, when it has the form
// it writes ({"weights_rule": string, "files": {name: {"role": string, "why": string}}}).
const json* FolderFiles(const json& metadata) {
  if (!metadata.is_object()) return nullptr;
  auto it = metadata.find("folder");
  if (it == metadata.end() || !it->is_object()) return nullptr;
  auto rule = it->find("weights_rule");
  auto files = it->find("files");
  if (rule == it->end() || !rule->is_string() || files == it->end() || !files->is_object()) return nullptr;
  for (const auto& what : *files)
    if (!what.is_object() || !what.contains("role") || !what["role"].is_string() || !what.contains("why") ||
        !what["why"].is_string())
      return nullptr;
  return &*it;
}

}  // namespace

int RunLs(const Args& args) {
  ReadOptions options;
  std::vector<std::string> positional;
  if (int rc = StartCommand(args, kLs, &options, &positional); rc >= 0) return rc;
  ServedTensors served;
  if (Status s = OpenPresented(positional[0], options, &served); !s.ok()) return Fail(s);

  // Output goes out in pieces of about a megabyte: one string of a million tensors' lines
  // would be ~100 MB of a listing's peak memory.
  constexpr size_t kFlushBytes = size_t{1} << 20;
  std::string text;
  auto flush_if_full = [&text] {
    if (text.size() < kFlushBytes) return;
    WriteAll(text);
    text.clear();
  };
  if (options.json) {
    // One TensorSummary object per line.
    text = "[";
    for (size_t i = 0; i < served.size(); ++i) {
      text += i ? ",\n {" : "\n {";
      AppendTensorSummary(&text, served[i]);
      text += "}";
      flush_if_full();
    }
    text += "\n]\n";
    WriteAll(text);
    return 0;
  }
  // Aligned columns under a header line; built as plain text (JSON objects per row would
  // dominate the time on checkpoints of 100k tensors). Two passes: the column widths, then
  // the rows (each row's shape text is made again rather than kept).
  auto served_shape_text = [](const ServedTensor& t, std::string_view* dtype, std::string* out) {
    std::vector<uint64_t> shape;
    ServedDTypeAndShape(t, dtype, &shape);
    *out = ShapeText(shape);
  };
  size_t key_w = 3, dtype_w = 5, shape_w = 5;
  std::string_view dtype;
  std::string shape;
  for (size_t i = 0; i < served.size(); ++i) {
    const ServedTensor t = served[i];
    served_shape_text(t, &dtype, &shape);
    key_w = std::max(key_w, t.key().size());
    dtype_w = std::max(dtype_w, dtype.size());
    shape_w = std::max(shape_w, shape.size());
  }
  auto cell = [&text](std::string_view s, size_t w) {
    text.append(s);
    text.append(w - s.size() + 2, ' ');
  };
  cell("key", key_w), cell("dtype", dtype_w), cell("shape", shape_w);
  text += "bytes\n";
  for (size_t i = 0; i < served.size(); ++i) {
    const ServedTensor t = served[i];
    served_shape_text(t, &dtype, &shape);
    cell(t.key(), key_w), cell(dtype, dtype_w), cell(shape, shape_w);
    text += std::to_string(t.nbytes());
    text += '\n';
    flush_if_full();
  }
  WriteAll(text);
  return 0;
}

int RunInfo(const Args& args) {
  ReadOptions options;
  std::vector<std::string> positional;
  if (int rc = StartCommand(args, InfoCommand(), &options, &positional); rc >= 0) return rc;
  ServedTensors served;
  if (Status s = OpenPresented(positional[0], options, &served); !s.ok()) return Fail(s);
  const Catalog* catalog = &served.source();

  uint64_t total = 0;
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // torch dtype -> (count, bytes)
  for (size_t i = 0; i < served.size(); ++i) {
    const ServedTensor t = served[i];
    total += t.nbytes();
    auto& slot = by_dtype[std::string(Info(t.dtype).torch_name)];
    slot.first += 1;
    slot.second += t.nbytes();
  }
  json info;
  info["source"] = catalog->source;
  info["format"] = catalog->format;
  info["source_files"] = json::array();
  for (uint32_t f = 0; f < catalog->files->count(); ++f)
    info["source_files"].push_back({{"path", catalog->files->path(f)}, {"size", catalog->files->size(f)}});
  // The key map that makes what is served, and why that one (doc/MAPS.md).
  const json& fields = served.manifest_fields();
  if (fields.contains("map")) {
    const json& m = fields["map"];
    info["map"] = {{"name", m["name"]}, {"reason", m["reason"]}, {"parameters", m["parameters"]},
                   {"map_file", m["map_file"]}, {"model_config_source", m["model_config_source"]},
                   {"key_prefix", m["key_prefix"]}, {"model_config_from_tensors", m["model_config_from_tensors"]}};
  }
  // A tree's models, each in its folder (a source that is one model at its root has none).
  const bool tree = served.components().size() > 1 || !served.components()[0].folder.empty();
  if (tree) {
    json models = json::array();
    for (const ModelComponent& m : served.components())
      models.push_back({{"folder", m.folder}, {"format", m.format}, {"weights_name", m.weights_name},
                        {"source_shards", !m.source_shards.empty()}});
    info["models"] = std::move(models);
  }
  if (!catalog->not_served.empty()) {
    info["not_served"] = json::array();
    for (const auto& [path, why] : catalog->not_served) info["not_served"].push_back({{"path", path}, {"why", why}});
  }
  info["tensor_count"] = served.size();
  info["total_bytes"] = total;
  info["dtypes"] = json::object();
  for (const auto& [name, cb] : by_dtype) info["dtypes"][name] = {{"tensors", cb.first}, {"bytes", cb.second}};
  // A folder reader's account of the folder's files (metadata.json's "folder": what each file
  // is to the mount and why) is printed whole, file by file, instead of summarized.
  const json* folder = FolderFiles(catalog->metadata);
  if (folder) info["folder"] = *folder;
  info["metadata"] = json::object();
  if (served.metadata().is_object())
    for (auto& [k, v] : served.metadata().items())
      if (!(folder && k == "folder")) info["metadata"][k] = Summarize(v);
  // What building the catalog fetched, where its Env fetches.
  FetchCounters fetched;
  if (catalog->files->env().fetch_counters(&fetched))
    info["fetched"] = {{"requests", fetched.requests}, {"bytes", fetched.bytes}, {"retries", fetched.retries},
                       {"disk_cache_bytes", fetched.disk_cache_bytes}};

  // SOURCE is the root of a ckptfs mount: how its files are served (doc/MOUNT.md, "Passthrough").
  if (const json passthrough = MountPassthrough(positional[0]); !passthrough.is_null())
    info["mount"] = {{"passthrough", passthrough}};

  if (options.json) {
    WriteAll(info.dump(1, ' ', false, json::error_handler_t::replace) + "\n");
    return 0;
  }
  std::string text;
  text += "source:       " + catalog->source + "\n";
  text += "format:       " + catalog->format + "\n";
  if (info.contains("map")) {
    text += "map:          " + info["map"]["name"].get<std::string>() + " (" + info["map"]["reason"].get<std::string>() + ")\n";
    // The config's facts that its source left unsaid and the stored tensors proved.
    for (const auto& [field, fact] : info["map"]["model_config_from_tensors"].items())
      text += "from tensors: " + field + " = " + fact["value"].dump() + " (" + fact["why"].get<std::string>() + ")\n";
  }
  text += "tensors:      " + std::to_string(served.size()) + "\n";
  text += "tensor bytes: " + std::to_string(total) + "\n";
  text += "files:\n";
  for (uint32_t f = 0; f < catalog->files->count(); ++f)
    text += "  " + catalog->files->path(f) + "  (" + std::to_string(catalog->files->size(f)) + " bytes)\n";
  // A tree's models, each in its folder, and what it did not serve.
  if (tree) {
    text += "models:\n";
    for (const ModelComponent& m : served.components())
      text += "  " + (m.folder.empty() ? std::string(".") : m.folder) + "/  " + m.format + ", served as " +
              m.weights_name + (m.source_shards.empty() ? "" : " in the source's shards") + "\n";
  }
  for (const auto& [path, why] : catalog->not_served) text += "not served:   " + path + "  " + why + "\n";
  if (folder) {
    text += "folder files (weights: " + (*folder)["weights_rule"].get<std::string>() + "):\n";
    size_t name_w = 0;
    for (auto& [name, what] : (*folder)["files"].items()) name_w = std::max(name_w, name.size());
    for (auto& [name, what] : (*folder)["files"].items())
      text += "  " + name + std::string(name_w - name.size() + 2, ' ') + what["role"].get<std::string>() + ": " +
              what["why"].get<std::string>() + "\n";
  }
  text += "dtypes:\n";
  for (const auto& [name, cb] : by_dtype)
    text += "  " + name + ": " + std::to_string(cb.first) + " tensors, " + std::to_string(cb.second) + " bytes\n";
  if (!info["metadata"].empty()) {
    text += "metadata:\n";
    for (auto& [k, v] : info["metadata"].items())
      text += "  " + k + ": " + (v.is_string() ? v.get<std::string>() : v.dump(-1, ' ', false, json::error_handler_t::replace)) + "\n";
  }
  if (info.contains("fetched"))
    text += "fetched:      " + std::to_string(fetched.requests) + " requests, " + std::to_string(fetched.bytes) +
            " bytes (" + std::to_string(fetched.retries) + " retries, " + std::to_string(fetched.disk_cache_bytes) +
            " bytes from the disk cache)\n";
  if (info.contains("mount")) {
    const json& p = info["mount"]["passthrough"];
    text += "passthrough:  " +
            (p.value("active", false)
                 ? std::to_string(p.value("files", 0)) + " files served by the kernel from their source files (" +
                       std::to_string(p.value("opened_files", 0)) + " opened so far)"
                 : "none (" + p.value("why", std::string("not asked for")) + ")") +
            "\n";
  }
  WriteAll(text);
  return 0;
}

}  // namespace ckptfs::cli
