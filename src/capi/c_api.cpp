// libckptfs.so: the C ABI of include/ckptfs/c_api.h.
#include "ckptfs/c_api.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/device.hpp"
#include "ckptfs/diff.hpp"
#include "ckptfs/open.hpp"
#include "ckptfs/options.hpp"
#include "ckptfs/tensor_map.hpp"
#include "ckptfs/view.hpp"

#define CKPTFS_EXPORT extern "C" __attribute__((visibility("default")))

struct ckptfs_handle {
  std::unique_ptr<ckptfs::View> view;
  std::string info;          // ckptfs_tensor_info
  std::string source_files;  // ckptfs_source_files
  std::string metadata;      // ckptfs_metadata
  std::string loading;       // ckptfs_tensor_loading, made when first asked for
};

namespace {

using ckptfs::OptionValues;
using ckptfs::Status;

thread_local std::string g_error;
thread_local std::string g_stats = "{}";
thread_local std::string g_map_layout;
thread_local std::string g_selection;

void SetError(const std::string& message) { g_error = message; }

// The options JSON of ckptfs_open, ckptfs_load_into or ckptfs_diff (NULL or "" for none),
// parsed through the option table for the groups that call takes.
Status ParseOptionsText(const char* text, unsigned groups, OptionValues* out) {
  if (!text || !*text) return Status::OK();
  const nlohmann::json options = nlohmann::json::parse(text, nullptr, false);
  if (options.is_discarded() || !options.is_object())
    return Status::InvalidArgument("options", std::string("not a JSON object: ") + text);
  return ParseJsonOptions(options, groups, out);
}

nlohmann::json TensorInfo(const ckptfs::View& view) {
  nlohmann::json info = nlohmann::json::array();
  const ckptfs::ServedTensors& tensors = view.served();
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string_view dtype;
    std::vector<uint64_t> shape;
    ckptfs::ServedDTypeAndShape(tensors[i], &dtype, &shape);
    nlohmann::json entry = {{"index", i}, {"key", tensors[i].key()}, {"dtype", std::string(dtype)},
                            {"shape", shape}, {"nbytes", tensors[i].nbytes()}};
    if (auto extent = MappableExtent(tensors[i], *view.source().files))
      entry["extent"] = {{"file", extent->file}, {"offset", extent->offset}};
    else if (size_t maps = ckptfs::MappedPieceCount(tensors[i], *view.source().files); maps > 0)
      entry["maps"] = maps;
    info.push_back(std::move(entry));
  }
  return info;
}

nlohmann::json TensorLoading(const ckptfs::View& view) {
  nlohmann::json loading = nlohmann::json::array();
  const ckptfs::SourceFiles& files = *view.source().files;
  const ckptfs::ServedTensors& tensors = view.served();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ckptfs::ServedTensor t = tensors[i];
    const ckptfs::DTypeInfo& served = ckptfs::Info(ckptfs::ServedAs(t.dtype).dtype);
    std::string_view name;
    std::vector<uint64_t> torch_shape;
    ckptfs::ServedDTypeAndShape(t, &name, &torch_shape);
    // The served (safetensors) shape of F4 counts values, two to each byte; torch's
    // float4_e2m1fn_x2 counts bytes.
    if (served.dtype == ckptfs::DType::kF4x2 && !torch_shape.empty()) torch_shape.back() /= 2;
    loading.push_back({{"itemsize", served.itemsize},
                       {"torch_dtype", std::string(served.torch_name)},
                       {"torch_shape", torch_shape},
                       {"numpy_dtype", served.numpy_name.empty() ? nlohmann::json(nullptr)
                                                                 : nlohmann::json(std::string(served.numpy_name))},
                       {"cpu", ckptfs::CpuPlacementName(ckptfs::PlaceOnCpu(t, files))}});
  }
  return loading;
}

nlohmann::json SourceFilesInfo(const ckptfs::SourceFiles& files) {
  nlohmann::json out = nlohmann::json::array();
  for (uint32_t i = 0; i < files.count(); ++i) {
    const ckptfs::FileIdentity& id = files.identity(i);
    out.push_back({{"name", files.path(i)}, {"local_path", files.file(i).local_path()}, {"size", id.size},
                   {"dev", id.dev}, {"ino", id.ino}, {"mtime_ns", id.mtime_ns}, {"ctime_ns", id.ctime_ns}});
  }
  return out;
}

}  // namespace

CKPTFS_EXPORT int ckptfs_api_version(void) { return CKPTFS_C_API_VERSION; }

CKPTFS_EXPORT const char* ckptfs_version(void) { return CKPTFS_VERSION; }

CKPTFS_EXPORT ckptfs_handle* ckptfs_open(const char* source, const char* options_json) {
  using namespace ckptfs;
  try {
    OptionValues options;
    if (Status s = ParseOptionsText(options_json, kOpenGroups, &options); !s.ok()) {
      SetError(s.message());
      return nullptr;
    }
    OpenedSource opened;
    Status s = OpenSource(source, OpenRequest{options.source, options.view}, &opened);
    // The library has no channel for warnings of its own: they go where the command's go.
    for (const std::string& note : opened.notes) std::fprintf(stderr, "ckptfs: %s\n", note.c_str());
    if (!s.ok()) {
      SetError(StatusText(s, OptionSpelling::kJson));
      return nullptr;
    }
    auto handle = std::make_unique<ckptfs_handle>();
    handle->view = std::move(opened.view);
    const ServedTensors& presented = handle->view->served();
    handle->info = TensorInfo(*handle->view).dump();
    handle->source_files = SourceFilesInfo(*presented.source().files).dump();
    handle->metadata = presented.metadata().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return handle.release();
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_open: ") + e.what());
    return nullptr;
  }
}

CKPTFS_EXPORT void ckptfs_close(ckptfs_handle* handle) { delete handle; }

CKPTFS_EXPORT size_t ckptfs_tensor_count(const ckptfs_handle* handle) {
  return handle ? handle->view->served().size() : 0;
}

CKPTFS_EXPORT const char* ckptfs_tensor_info(ckptfs_handle* handle) { return handle ? handle->info.c_str() : "[]"; }

CKPTFS_EXPORT const char* ckptfs_source_files(ckptfs_handle* handle) {
  return handle ? handle->source_files.c_str() : "[]";
}

CKPTFS_EXPORT const char* ckptfs_metadata(ckptfs_handle* handle) { return handle ? handle->metadata.c_str() : "{}"; }

CKPTFS_EXPORT int ckptfs_read_tensor(ckptfs_handle* handle, uint64_t index, size_t count, const uint64_t* offsets,
                                     const uint64_t* lengths, void* out) {
  using namespace ckptfs;
  try {
    if (!handle) return SetError("ckptfs_read_tensor: null handle"), -1;
    char* dst = static_cast<char*>(out);
    for (size_t i = 0; i < count; ++i) {
      // ReadTensorData checks each range against the tensor's size.
      Status s = handle->view->ReadTensorData(static_cast<size_t>(index), offsets[i], static_cast<size_t>(lengths[i]), dst);
      if (!s.ok()) return SetError(s.message()), -1;
      dst += lengths[i];
    }
    return 0;
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_read_tensor: ") + e.what());
    return -1;
  }
}

namespace {

int LoadInto(ckptfs_handle* handle, size_t count, const uint64_t* indices, void* const* ptrs, const uint64_t* nbytes,
             const char* backend, int device, void* after_stream, const char* options_json) {
  using namespace ckptfs;
  try {
    if (!handle) {
      SetError("ckptfs_load_into: null handle");
      return -1;
    }
    OptionValues options;
    if (Status s = ParseOptionsText(options_json, kLoadIntoGroups, &options); !s.ok()) {
      SetError(s.message());
      return -1;
    }
    std::unique_ptr<DeviceBackend> be;
    Status s = OpenBackend(backend ? backend : "auto", device, &be);
    if (!s.ok()) return SetError(s.message()), -1;
    std::vector<DeviceDestination> dests;
    std::vector<DeviceTensor> check;
    const View& view = *handle->view;
    for (size_t i = 0; i < count; ++i) {
      dests.push_back({static_cast<size_t>(indices[i]), ptrs[i], nbytes[i]});
      if (options.verify && indices[i] < view.served().size()) {
        DeviceTensor t;
        t.index = indices[i];
        t.key = view.served()[indices[i]].key();
        t.device_ptr = ptrs[i];
        t.nbytes = nbytes[i];
        check.push_back(t);
      }
    }
    options.load.after_stream = after_stream;
    DeviceLoadStats stats;
    s = LoadIntoDevice(view, *be, options.load, dests, &stats);
    if (s.ok() && options.verify) s = VerifyDeviceTensors(view, *be, check);
    if (!s.ok()) return SetError(s.message()), -1;
    g_stats = LoadStatsJson(stats, be->name(), be->Describe(), options.verify);
    return 0;
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_load_into: ") + e.what());
    return -1;
  }
}

}  // namespace

CKPTFS_EXPORT int ckptfs_load_into(ckptfs_handle* handle, size_t count, const uint64_t* indices, void* const* ptrs,
                                   const uint64_t* nbytes, const char* backend, int device, const char* options_json) {
  return LoadInto(handle, count, indices, ptrs, nbytes, backend, device, nullptr, options_json);
}

CKPTFS_EXPORT int ckptfs_load_into_stream(ckptfs_handle* handle, size_t count, const uint64_t* indices,
                                          void* const* ptrs, const uint64_t* nbytes, const char* backend, int device,
                                          void* stream, const char* options_json) {
  return LoadInto(handle, count, indices, ptrs, nbytes, backend, device, stream, options_json);
}

CKPTFS_EXPORT const char* ckptfs_map_tensors(ckptfs_handle* handle, size_t count, const uint64_t* indices,
                                             void** region, uint64_t* region_size) {
  using namespace ckptfs;
  try {
    *region = nullptr;
    *region_size = 0;
    if (!handle) return SetError("ckptfs_map_tensors: null handle"), nullptr;
    TensorRegion mapped;
    Status s = MapTensors(*handle->view, std::vector<size_t>(indices, indices + count), &mapped);
    if (!s.ok()) return SetError(s.message()), nullptr;
    nlohmann::json reads = nlohmann::json::array();
    for (const TensorRead& r : mapped.reads) reads.push_back({r.tensor, r.offset, r.length});
    try {
      g_map_layout = nlohmann::json{{"offsets", mapped.offsets}, {"reads", std::move(reads)},
                                    {"mapped_bytes", mapped.mapped_bytes}, {"maps", mapped.maps}}
                         .dump();
    } catch (...) {
      UnmapRegion(mapped.base, mapped.size);
      throw;
    }
    *region = mapped.base;
    *region_size = mapped.size;
    return g_map_layout.c_str();
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_map_tensors: ") + e.what());
    return nullptr;
  }
}

CKPTFS_EXPORT int ckptfs_load_mapped(ckptfs_handle* handle, size_t count, const uint64_t* indices, void** region,
                                     uint64_t* region_size, uint64_t* offsets) {
  using namespace ckptfs;
  try {
    *region = nullptr;
    *region_size = 0;
    if (!handle) return SetError("ckptfs_load_mapped: null handle"), -1;
    TensorRegion mapped;
    DeviceLoadStats stats;
    if (Status s = LoadMapped(*handle->view, std::vector<size_t>(indices, indices + count), &mapped, &stats); !s.ok())
      return SetError(s.message()), -1;
    try {
      g_stats = LoadStatsJson(stats, kMapLoadBackend, "host memory (private maps of the source files)", false);
    } catch (...) {
      UnmapRegion(mapped.base, mapped.size);
      throw;
    }
    std::copy(mapped.offsets.begin(), mapped.offsets.end(), offsets);
    *region = mapped.base;
    *region_size = mapped.size;
    return 0;
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_load_mapped: ") + e.what());
    return -1;
  }
}

CKPTFS_EXPORT const char* ckptfs_tensor_loading(ckptfs_handle* handle) {
  if (!handle) return "[]";
  try {
    if (handle->loading.empty()) handle->loading = TensorLoading(*handle->view).dump();
    return handle->loading.c_str();
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_tensor_loading: ") + e.what());
    return nullptr;
  }
}

CKPTFS_EXPORT const char* ckptfs_select(ckptfs_handle* handle, const char* patterns_json) {
  using namespace ckptfs;
  try {
    if (!handle) return SetError("ckptfs_select: null handle"), nullptr;
    const nlohmann::json patterns =
        patterns_json ? nlohmann::json::parse(patterns_json, nullptr, false) : nlohmann::json(nullptr);
    std::vector<size_t> indices;
    if (patterns.is_null()) {
      for (size_t i = 0; i < handle->view->served().size(); ++i) indices.push_back(i);
    } else {
      std::vector<std::string> select;
      if (patterns.is_string()) select.push_back(patterns.get<std::string>());
      if (patterns.is_array())
        for (const nlohmann::json& p : patterns) {
          if (!p.is_string()) return SetError("select: not a list of keys or globs: " + patterns.dump()), nullptr;
          select.push_back(p.get<std::string>());
        }
      if (!patterns.is_string() && !patterns.is_array())
        return SetError(std::string("select: not a key, a glob or a list of them: ") + patterns_json), nullptr;
      // An empty list selects nothing (SelectTensors reads no patterns as all of them).
      if (!select.empty())
        if (Status s = SelectTensors(*handle->view, select, &indices); !s.ok()) return SetError(s.message()), nullptr;
    }
    g_selection = nlohmann::json(indices).dump();
    return g_selection.c_str();
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_select: ") + e.what());
    return nullptr;
  }
}

CKPTFS_EXPORT int ckptfs_open_source_file(ckptfs_handle* handle, uint32_t file) {
  using namespace ckptfs;
  try {
    if (!handle) return SetError("ckptfs_open_source_file: null handle"), -1;
    int fd = -1;
    if (Status s = OpenUnchangedForMap(*handle->view->source().files, file, &fd); !s.ok())
      return SetError(s.message()), -1;
    return fd;
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_open_source_file: ") + e.what());
    return -1;
  }
}

CKPTFS_EXPORT int ckptfs_unmap(void* region, uint64_t region_size) {
  if (ckptfs::Status s = ckptfs::UnmapRegion(region, region_size); !s.ok()) return SetError(s.message()), -1;
  return 0;
}

CKPTFS_EXPORT const char* ckptfs_options(void) {
  // Built once: the table never changes while the library is loaded.
  static const std::string description = [] {
    try {
      return ckptfs::DescribeOptions().dump();
    } catch (const std::exception&) {
      return std::string("[]");
    }
  }();
  return description.c_str();
}

CKPTFS_EXPORT const char* ckptfs_last_load_stats(void) { return g_stats.c_str(); }

CKPTFS_EXPORT const char* ckptfs_last_error(void) { return g_error.c_str(); }

namespace {
thread_local std::string g_diff;
}  // namespace

CKPTFS_EXPORT const char* ckptfs_diff(ckptfs_handle* a, ckptfs_handle* b, const char* options_json) {
  using namespace ckptfs;
  try {
    if (!a || !b) return SetError("ckptfs_diff: null handle"), nullptr;
    OptionValues values;
    if (Status s = ParseOptionsText(options_json, kDiffGroups, &values); !s.ok()) return SetError(s.message()), nullptr;
    const DiffOptions& options = values.diff;
    DiffResult result;
    DiffSide failed = DiffSide::kNone;
    if (Status s = CompareViews(*a->view, *b->view, options, {}, &result, &failed); !s.ok()) {
      // The message names the side it came from, as `ckptfs diff` does.
      const std::string& source = failed == DiffSide::kB ? b->view->source().source : a->view->source().source;
      const bool named = failed == DiffSide::kNone || s.message().rfind(source + ":", 0) == 0;
      return SetError(named ? s.message() : source + ": " + s.message()), nullptr;
    }
    g_diff = DiffToJson(result).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return g_diff.c_str();
  } catch (const std::exception& e) {
    SetError(std::string("ckptfs_diff: ") + e.what());
    return nullptr;
  }
}
