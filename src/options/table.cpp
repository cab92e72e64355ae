// The option table: every option ckptfs takes, declared once, with the parsers of its values.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "ckptfs/options.hpp"

namespace ckptfs {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// ParseSize with the error naming `where` (the option as written) rather than the bare text.
Status ParseSizeAt(std::string_view where, std::string_view text, uint64_t* bytes) {
  const std::string t = Lower(text);
  size_t digits = 0;
  while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
  static const std::pair<const char*, uint64_t> kUnits[] = {
      {"", 1}, {"b", 1}, {"kb", 1000}, {"mb", 1000000}, {"gb", 1000000000}, {"tb", 1000000000000},
      {"kib", 1ull << 10}, {"mib", 1ull << 20}, {"gib", 1ull << 30}, {"tib", 1ull << 40}};
  if (digits == 0 || digits > 15) return Status::InvalidArgument(where, "not a size (e.g. 5GB, 2GiB, 500MB)");
  const uint64_t n = std::stoull(t.substr(0, digits));
  for (const auto& [unit, scale] : kUnits) {
    if (t.substr(digits) == unit) {
      if (n == 0) return Status::InvalidArgument(where, "a size must be positive");
      if (__builtin_mul_overflow(n, scale, bytes)) return Status::InvalidArgument(where, "size too large");
      return Status::OK();
    }
  }
  return Status::InvalidArgument(where, "unknown size unit (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

// A decimal integer in [min, max], all of `text`.
bool ParseInteger(std::string_view text, uint64_t min, uint64_t max, uint64_t* out) {
  uint64_t n = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || ptr != text.data() + text.size() || n < min || n > max) return false;
  *out = n;
  return true;
}

// Ring sizes and thread counts: a bound far above any useful value keeps a typo from asking
// for millions of buffers or threads.
constexpr uint64_t kMaxCount = uint64_t{1} << 20;

Status ParseCount(std::string_view where, std::string_view value, int* out) {
  uint64_t n = 0;
  if (!ParseInteger(value, 1, kMaxCount, &n))
    return Status::InvalidArgument(where, "not a count from 1 to " + std::to_string(kMaxCount));
  *out = static_cast<int>(n);
  return Status::OK();
}

// atol, rtol: a finite number >= 0.
Status ParseTolerance(std::string_view where, std::string_view value, double* out) {
  const std::string text(value);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(v >= 0) || !std::isfinite(v))
    return Status::InvalidArgument(where, "needs a finite number >= 0");
  *out = v;
  return Status::OK();
}

// diff's threads and rows: 0 (threads: one per core, at most 8) to 4096.
Status ParseDiffCount(std::string_view where, std::string_view value, uint64_t* out) {
  if (!ParseInteger(value, 0, 4096, out)) return Status::InvalidArgument(where, "needs a whole number up to 4096");
  return Status::OK();
}

Status ParseDType(std::string_view where, std::string_view value, OptionValues* out) {
  const std::string v = Lower(value);
  if (v == "bf16" || v == "bfloat16") out->view.dtype = DType::kBF16;
  else if (v == "fp16" || v == "f16" || v == "float16" || v == "half") out->view.dtype = DType::kF16;
  else if (v == "fp32" || v == "f32" || v == "float32" || v == "float") out->view.dtype = DType::kF32;
  else return Status::InvalidArgument(where, "the target dtype must be bf16, fp16 or fp32");
  return Status::OK();
}

Status ParseRoot(std::string_view where, std::string_view value, OptionValues* out) {
  if (value.empty()) return Status::InvalidArgument(where, "needs a key prefix, e.g. root=model");
  out->view.root.assign(value);
  return Status::OK();
}

// catalog_cache=auto is resolved here, by the front end that parses it: the catalog cache
// itself reads no environment. $XDG_CACHE_HOME/ckptfs/catalogs, else
// ~/.cache/ckptfs/catalogs; with neither set (as absolute paths) caching stays off.
Status ParseCatalogCache(std::string_view where, std::string_view value, OptionValues* out) {
  if (value.empty()) return Status::InvalidArgument(where, "needs a folder, or auto for ~/.cache/ckptfs/catalogs");
  if (value != "auto") {
    out->source.catalog_cache.assign(value);
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg == '/') {
    out->source.catalog_cache = std::string(xdg) + "/ckptfs/catalogs";
  } else if (const char* home = std::getenv("HOME"); home && *home == '/') {
    out->source.catalog_cache = std::string(home) + "/.cache/ckptfs/catalogs";
  } else {
    out->source.catalog_cache.clear();
  }
  return Status::OK();
}

// shard_size, max_pickle, max_pickle_memory, max_header: a size into the field of
// OptionValues that the member path `Path` names (e.g. view, shard_size).
template <auto... Path>
Status ParseSizeInto(std::string_view where, std::string_view value, OptionValues* out) {
  return ParseSizeAt(where, value, &(*out .* ... .* Path));
}

Status ParseMaxTensors(std::string_view where, std::string_view value, OptionValues* out) {
  if (!ParseInteger(value, 1, UINT64_MAX, &out->source.limits.tensors))
    return Status::InvalidArgument(where, "not a positive count");
  return Status::OK();
}

// An absolute path (`what`: folder or file) into `*path`: a mount's daemon runs from /, so a
// relative path would name something else than the user meant.
Status AssignAbsolutePath(std::string_view where, std::string_view value, const char* what, std::string* path) {
  if (value.empty() || value.front() != '/')
    return Status::InvalidArgument(where, std::string("needs an absolute ") + what + " path (a mount runs from /)");
  path->assign(value);
  return Status::OK();
}

// map: none, auto, a shipped map's name, or a map file (an absolute path: a mount's daemon
// runs from /). Which names exist is the view's to say (it refuses an unknown one).
Status ParseMap(std::string_view where, std::string_view value, OptionValues* out) {
  if (value.empty()) return Status::InvalidArgument(where, "needs none, auto, a map name (llama, qwen2, ...) or a map file");
  if (value.find('/') != std::string_view::npos || value.ends_with(".json")) {
    std::string path;
    CKPTFS_RETURN_IF_ERROR(AssignAbsolutePath(where, value, "file", &path));
  }
  out->view.map.assign(value == "none" ? std::string_view() : value);
  return Status::OK();
}

// map.NAME=VALUE: NAME from `where` (the family's parsers get "map.NAME=VALUE").
Status ParseMapSetting(std::string_view where, std::string_view value, OptionValues* out) {
  std::string_view name = where.substr(0, where.find('='));
  name.remove_prefix(std::string_view("map.").size());
  if (name.empty() || name.size() > 64 ||
      !std::all_of(name.begin(), name.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }) ||
      std::isdigit(static_cast<unsigned char>(name.front())))
    return Status::InvalidArgument(where, "map.NAME=VALUE needs a NAME of letters, digits and '_'");
  if (value.empty() || value.size() > 256) return Status::InvalidArgument(where, "needs a value (an integer, true, false or text)");
  for (auto& [n, v] : out->view.map_settings)
    if (n == name) {
      v.assign(value);
      return Status::OK();
    }
  out->view.map_settings.emplace_back(std::string(name), std::string(value));
  return Status::OK();
}

Status ParseCacheDir(std::string_view where, std::string_view value, OptionValues* out) {
  return AssignAbsolutePath(where, value, "folder", &out->source.remote.cache_dir);
}

Status ParseCaFile(std::string_view where, std::string_view value, OptionValues* out) {
  return AssignAbsolutePath(where, value, "file", &out->source.remote.ca_file);
}

Status ParseRemoteTimeout(std::string_view where, std::string_view value, OptionValues* out) {
  uint64_t n = 0;
  if (!ParseInteger(value, 1, 3600, &n)) return Status::InvalidArgument(where, "not a number of seconds from 1 to 3600");
  out->source.remote.timeout_seconds = static_cast<int>(n);
  return Status::OK();
}

Status ParseRemoteRetries(std::string_view where, std::string_view value, OptionValues* out) {
  uint64_t n = 0;
  if (!ParseInteger(value, 0, 20, &n)) return Status::InvalidArgument(where, "not a count from 0 to 20");
  out->source.remote.retries = static_cast<int>(n);
  return Status::OK();
}

Status ParseBackend(std::string_view where, std::string_view value, OptionValues* out) {
  if (value != "host" && value != "cuda" && value != "cufile" && value != "auto")
    return Status::InvalidArgument(where, "the back end must be host, cuda, cufile or auto");
  out->backend.assign(value);
  return Status::OK();
}

Status ParseDevice(std::string_view where, std::string_view value, OptionValues* out) {
  uint64_t n = 0;
  if (!ParseInteger(value, 0, kMaxCount, &n)) return Status::InvalidArgument(where, "not a device number");
  out->device = static_cast<int>(n);
  return Status::OK();
}

Status ParseSelect(std::string_view where, std::string_view value, OptionValues* out) {
  if (value.empty()) return Status::InvalidArgument(where, "needs a key or a shell glob, e.g. 'model.*'");
  out->load.select.emplace_back(value);
  return Status::OK();
}

Status ParseBufferSize(std::string_view where, std::string_view value, OptionValues* out) {
  uint64_t bytes = 0;
  CKPTFS_RETURN_IF_ERROR(ParseSizeAt(where, value, &bytes));
  // O_DIRECT reads land in the buffers in 4 KiB units; past 16 GiB pinned memory is the limit.
  if (bytes < 4096 || bytes > (uint64_t{1} << 34))
    return Status::InvalidArgument(where, "a buffer must be between 4KiB and 16GiB");
  out->load.buffer_bytes = bytes;
  return Status::OK();
}

Status ParseBuffers(std::string_view where, std::string_view value, OptionValues* out) {
  return ParseCount(where, value, &out->load.buffers);
}

Status ParseIoThreads(std::string_view where, std::string_view value, OptionValues* out) {
  return ParseCount(where, value, &out->load.io_threads);
}

// write: a comma list of model, tensors, files, all.
Status ParseExportParts(std::string_view where, std::string_view value, OptionValues* out) {
  static const std::pair<const char*, unsigned> kParts[] = {
      {"model", kExportModel}, {"tensors", kExportTensors}, {"files", kExportFiles},
      {"all", kExportModel | kExportTensors | kExportFiles}};
  unsigned parts = 0;
  size_t start = 0;
  while (start <= value.size()) {
    const size_t comma = std::min(value.find(',', start), value.size());
    const std::string part = Lower(value.substr(start, comma - start));
    bool found = false;
    for (const auto& [name, bits] : kParts)
      if (part == name) parts |= bits, found = true;
    if (!found) return Status::InvalidArgument(where, "write takes model, tensors, files or all, comma-separated");
    start = comma + 1;
  }
  out->export_parts = parts;
  return Status::OK();
}

constexpr auto kSwitch = OptionKind::kSwitch;
constexpr auto kValue = OptionKind::kValue;

const OptionSpec kTable[] = {
    // View options.
    {"dtype", kValue, kViewGroup, "T", "serve floating tensors as T (bf16, fp16, fp32), converted on read",
     ParseDType},
    {"root", kValue, kViewGroup, "PREFIX", "only the tensors under the key prefix PREFIX (e.g. model), prefix removed; or the model folder PREFIX of a folder source (e.g. unet), served as that folder",
     ParseRoot},
    {"map", kValue, kViewGroup, "MAP",
     "serve the checkpoint as another framework's model through a key map: auto (the one its config names), "
     "llama, mistral, qwen2, qwen3, mixtral, qwen3_moe (Megatron GPT as Hugging Face), or a map file's absolute path (doc/MAPS.md)",
     ParseMap},
    {"map.", kValue, kViewGroup, "NAME=V",
     "with map: set the map parameter or model_config field NAME to V over the checkpoint's config (repeatable)",
     ParseMapSetting, nullptr, false, /*family=*/true},
    {"shard_size", kValue, kViewGroup, "SIZE",
     "Hugging Face shards of at most SIZE (5GB, 2GiB) and an index instead of model.safetensors",
     ParseSizeInto<&OptionValues::view, &ViewOptions::shard_size>},
    {"passthrough", kValue, kMountOnlyGroup, "MODE",
     "auto (default): the kernel reads the files that are source files unchanged straight from them "
     "(Linux 6.9+, CAP_SYS_ADMIN; doc/MOUNT.md, \"Passthrough\"); off: every read through ckptfs",
     [](std::string_view where, std::string_view value, OptionValues* o) {
       if (value == "auto" || value == "off") {
         o->passthrough = value == "auto";
         return Status::OK();
       }
       return Status::InvalidArgument(where, "not a passthrough mode (auto or off)");
     }},
    {"checksums", kSwitch, kViewGroup, "", "manifest.json lists each tensor file's XXH3-64", nullptr,
     [](OptionValues* o, bool on) { o->view.checksums = on; }},
    // Source options.
    {"moments", kSwitch, kSourceGroup, "", "DeepSpeed ZeRO: also serve the Adam moments (exp_avg.*, exp_avg_sq.*)",
     nullptr, [](OptionValues* o, bool on) { o->source.zero_moments = on; }},
    {"optimizer", kSwitch, kSourceGroup, "",
     "veRL: also serve the consolidated optimizer state (optimizer.state.<name>.exp_avg, ...)", nullptr,
     [](OptionValues* o, bool on) { o->source.optimizer_state = on; }},
    {"max_pickle", kValue, kSourceGroup, "SIZE", "limit on one pickle record of untrusted metadata (default 1GiB)",
     ParseSizeInto<&OptionValues::source, &SourceOptions::limits, &ReadLimits::pickle_bytes>},
    {"max_pickle_memory", kValue, kSourceGroup, "SIZE", "limit on the memory parsing one pickle takes (default 4GiB)",
     ParseSizeInto<&OptionValues::source, &SourceOptions::limits, &ReadLimits::pickle_memory>},
    {"max_header", kValue, kSourceGroup, "SIZE",
     "limit on a safetensors JSON header or JSON index file (default 100MB)",
     ParseSizeInto<&OptionValues::source, &SourceOptions::limits, &ReadLimits::header_bytes>},
    {"max_tensors", kValue, kSourceGroup, "N", "limit on the tensors of one checkpoint (default 10000000)",
     ParseMaxTensors},
    {"catalog_cache", kValue, kSourceGroup, "DIR",
     "keep validated catalogs of checkpoint files in DIR (auto: ~/.cache/ckptfs/catalogs), so that reopening an "
     "unchanged one skips parsing it (default: off)",
     ParseCatalogCache},
    // What `ckptfs export` writes.
    {"write", kValue, kExportGroup, "PARTS",
     "what export writes, comma-separated: model (model.safetensors, or the shards and their index with "
     "--shard-size), tensors (tensors/, one file per tensor), files (manifest.json, metadata.json, the "
     "source folder's other files), all (default: model,files)",
     ParseExportParts},
    // Remote sources (http://, https://, s3://).
    {"cache_size", kValue, kSourceGroup, "SIZE",
     "remote sources: memory for fetched blocks, shared by all files (default 256MiB)",
     ParseSizeInto<&OptionValues::source, &SourceOptions::remote, &RemoteOptions::cache_bytes>},
    {"cache_dir", kValue, kSourceGroup, "DIR",
     "remote sources: also keep fetched blocks in folder DIR, keyed by URL and ETag, so a remount fetches "
     "nothing twice (default: none)",
     ParseCacheDir},
    {"cache_dir_size", kValue, kSourceGroup, "SIZE",
     "remote sources: keep at most SIZE of blocks in the cache_dir folder, shared by every mount and command "
     "using it, least recently used evicted first (default: unbounded)",
     ParseSizeInto<&OptionValues::source, &SourceOptions::remote, &RemoteOptions::cache_dir_bytes>},
    {"ca_file", kValue, kSourceGroup, "FILE",
     "https:// and s3:// sources: trust the CA certificates in FILE (default: $AWS_CA_BUNDLE for s3://, "
     "then $CURL_CA_BUNDLE, then the system's)",
     ParseCaFile},
    {"readahead", kValue, kSourceGroup, "SIZE",
     "remote sources: how far ahead of a sequential reader to fetch, in parallel requests (default 64MiB)",
     ParseSizeInto<&OptionValues::source, &SourceOptions::remote, &RemoteOptions::readahead_bytes>},
    {"remote_timeout", kValue, kSourceGroup, "SECONDS",
     "remote sources: abandon a request that moves no byte for this long, then retry (default 30)",
     ParseRemoteTimeout},
    {"remote_retries", kValue, kSourceGroup, "N",
     "remote sources: retries of a request after a timeout, reset, 5xx or bad answer before EIO (default 4)",
     ParseRemoteRetries},
    // What `ckptfs load` loads, and where.
    {"backend", kValue, kLoadTargetGroup, "B",
     "host, cuda, cufile or auto (default: auto = cufile, else cuda; a machine without a GPU is an error, "
     "never a silent host load)",
     ParseBackend},
    {"device", kValue, kLoadTargetGroup, "N", "CUDA device (default 0)", ParseDevice},
    {"select", kValue, kLoadTargetGroup, "PATTERN",
     "only tensors whose key is PATTERN or matches it as a shell glob (repeatable)", ParseSelect},
    // How a load to device memory runs.
    {"buffer_size", kValue, kDeviceLoadGroup, "S", "each pinned buffer, 4KiB to 16GiB (default 16MiB)",
     ParseBufferSize},
    {"buffers", kValue, kDeviceLoadGroup, "N", "ring size (default 4)", ParseBuffers},
    {"io_threads", kValue, kDeviceLoadGroup, "N", "threads filling buffers (default 2)", ParseIoThreads},
    {"direct_io", kSwitch, kDeviceLoadGroup, "", "buffered reads of the source files instead of O_DIRECT", nullptr,
     [](OptionValues* o, bool on) { o->load.direct_io = on; }, /*on_by_default=*/true},
    {"verify", kSwitch, kDeviceLoadGroup, "", "read each tensor back from the device and compare with the view",
     nullptr, [](OptionValues* o, bool on) { o->verify = on; }},
    // How two checkpoints are compared, and what `ckptfs diff` prints of it.
    {"atol", kValue, kDiffGroup, "X", "elements a, b are equal when |a-b| <= atol + rtol*|b| (default 0)",
     [](std::string_view where, std::string_view value, OptionValues* o) {
       return ParseTolerance(where, value, &o->diff.atol);
     }},
    {"rtol", kValue, kDiffGroup, "X", "(default 0: equal values only)",
     [](std::string_view where, std::string_view value, OptionValues* o) {
       return ParseTolerance(where, value, &o->diff.rtol);
     }},
    {"threads", kValue, kDiffGroup, "N", "worker threads (default: one per core, at most 8)",
     [](std::string_view where, std::string_view value, OptionValues* o) {
       uint64_t n = 0;
       CKPTFS_RETURN_IF_ERROR(ParseDiffCount(where, value, &n));
       o->diff.threads = static_cast<unsigned>(n);
       return Status::OK();
     }},
    {"rows", kValue, kDiffSummaryGroup, "N", "rows of the summary table (default 20; the worst tensors first)",
     [](std::string_view where, std::string_view value, OptionValues* o) {
       uint64_t n = 0;
       CKPTFS_RETURN_IF_ERROR(ParseDiffCount(where, value, &n));
       o->diff_rows = static_cast<unsigned>(n);
       return Status::OK();
     }},
};

}  // namespace

std::span<const OptionSpec> OptionTable() { return kTable; }

const OptionSpec* FindOption(std::string_view name) {
  for (const OptionSpec& spec : kTable)
    if (spec.family ? name.size() > spec.name.size() && name.starts_with(spec.name) : spec.name == name) return &spec;
  return nullptr;
}

Status ParseSize(std::string_view text, uint64_t* bytes) { return ParseSizeAt(text, text, bytes); }

}  // namespace ckptfs
