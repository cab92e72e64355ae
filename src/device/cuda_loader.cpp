// Finding and loading the CUDA runtime and cuFile at run time.
#include <dlfcn.h>
#include <fnmatch.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "device/cuda_api.hpp"

namespace ckptfs::device {
namespace {

// The site-packages (Debian's python: dist-packages) folder that holds PATH, or "".
std::string SitePackagesHolding(const std::string& path) {
  for (std::filesystem::path p(path); p.has_relative_path(); p = p.parent_path()) {
    if (p.filename() == "site-packages" || p.filename() == "dist-packages") return p.string();
  }
  return {};
}

// The file of the object this code is in: libckptfs.so, or the program it is linked into
// (whose link map has no name).
std::string OwnObjectFile() {
  Dl_info info{};
  link_map* map = nullptr;
  if (::dladdr1(reinterpret_cast<void*>(&OwnObjectFile), &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) &&
      map && map->l_name && *map->l_name)
    return map->l_name;
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.string();
}

// The files of the shared objects in the process, in load order.
std::vector<std::string> LoadedObjectFiles() {
  std::vector<std::string> files;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        auto* names = static_cast<std::vector<std::string>*>(out);
        if (info->dlpi_name && *info->dlpi_name) names->push_back(info->dlpi_name);
        return 0;
      },
      &files);
  return files;
}

// The entries of DIR whose names match the glob PATTERN, sorted. DIR itself is taken
// literally (a folder may have glob characters in its name).
std::vector<std::string> Matching(const std::string& dir, const char* pattern) {
  std::vector<std::string> found;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (::fnmatch(pattern, name.c_str(), 0) == 0) found.push_back(it->path().string());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

std::vector<std::string> PythonSitePackages() {
  std::vector<std::string> folders;
  auto add = [&](const std::string& folder) {
    if (folder.empty() || std::find(folders.begin(), folders.end(), folder) != folders.end()) return;
    folders.push_back(folder);
  };
  // A wheel's ckptfs runs with the CUDA wheels installed beside it.
  add(SitePackagesHolding(OwnObjectFile()));
  // In a Python process, the environments its modules came from (torch's, numpy's).
  for (const std::string& file : LoadedObjectFiles()) add(SitePackagesHolding(file));
  // The active environment of the shell that started a program outside any environment
  // (/usr/bin/ckptfs).
  if (const char* v = std::getenv("VIRTUAL_ENV"); v && *v) {
    for (const std::string& lib : Matching(std::string(v) + "/lib", "python3*")) add(lib + "/site-packages");
  }
  return folders;
}

std::vector<std::string> PythonEnvLibraries(const char* pattern) {
  std::vector<std::string> found;
  for (const std::string& root : PythonSitePackages()) {
    for (const char* sub : {"nvidia/cuda_runtime/lib", "nvidia/cu13/lib", "nvidia/cu12/lib", "nvidia/cufile/lib"}) {
      for (std::string& path : Matching(root + "/" + sub, pattern)) found.push_back(std::move(path));
    }
  }
  return found;
}

namespace {

// dlopen the first of `names` that loads; *tried lists them all.
void* OpenFirst(const std::vector<std::string>& names, std::string* loaded, std::string* tried) {
  // A copy already in the process (torch's) first: the same runtime means the same context.
  for (const std::string& n : names) {
    if (n.find('/') != std::string::npos) continue;
    if (void* h = ::dlopen(n.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      *loaded = n;
      return h;
    }
  }
  for (const std::string& n : names) {
    if (void* h = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      *loaded = n;
      return h;
    }
    if (!tried->empty()) *tried += ", ";
    *tried += n;
  }
  return nullptr;
}

template <typename F>
bool Resolve(void* lib, const char* symbol, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(::dlsym(lib, symbol));
  if (!*fn) {
    if (!missing->empty()) *missing += ", ";
    *missing += symbol;
  }
  return *fn != nullptr;
}

// Every entry point of a runtime, or the names it lacks.
std::string ResolveRuntime(void* lib, CudaRuntime* api) {
  std::string missing;
  Resolve(lib, "cudaGetDeviceCount", &api->GetDeviceCount, &missing);
  Resolve(lib, "cudaGetDevice", &api->GetDevice, &missing);
  Resolve(lib, "cudaSetDevice", &api->SetDevice, &missing);
  Resolve(lib, "cudaGetLastError", &api->GetLastError, &missing);
  Resolve(lib, "cudaMalloc", &api->Malloc, &missing);
  Resolve(lib, "cudaFree", &api->Free, &missing);
  Resolve(lib, "cudaHostAlloc", &api->HostAlloc, &missing);
  Resolve(lib, "cudaFreeHost", &api->FreeHost, &missing);
  Resolve(lib, "cudaMemcpy", &api->Memcpy, &missing);
  Resolve(lib, "cudaMemcpyAsync", &api->MemcpyAsync, &missing);
  Resolve(lib, "cudaStreamCreateWithFlags", &api->StreamCreateWithFlags, &missing);
  Resolve(lib, "cudaStreamDestroy", &api->StreamDestroy, &missing);
  Resolve(lib, "cudaStreamSynchronize", &api->StreamSynchronize, &missing);
  Resolve(lib, "cudaStreamWaitEvent", &api->StreamWaitEvent, &missing);
  Resolve(lib, "cudaEventCreateWithFlags", &api->EventCreateWithFlags, &missing);
  Resolve(lib, "cudaEventDestroy", &api->EventDestroy, &missing);
  Resolve(lib, "cudaEventRecord", &api->EventRecord, &missing);
  Resolve(lib, "cudaEventSynchronize", &api->EventSynchronize, &missing);
  Resolve(lib, "cudaGetErrorString", &api->GetErrorString, &missing);
  Resolve(lib, "cudaRuntimeGetVersion", &api->RuntimeGetVersion, &missing);
  Resolve(lib, "cudaDriverGetVersion", &api->DriverGetVersion, &missing);
  return missing;
}

}  // namespace

Status OpenCudaRuntimeFrom(const std::vector<std::string>& candidates, CudaRuntime* out) {
  // Libraries already in the process first (torch's): the same runtime means the same
  // context and the same current device as the caller's.
  std::vector<std::pair<void*, std::string>> opened;
  for (const std::string& n : candidates) {
    if (n.find('/') != std::string::npos) continue;
    if (void* h = ::dlopen(n.c_str(), RTLD_NOW | RTLD_NOLOAD)) opened.emplace_back(h, n);
  }
  std::string tried, rejected;
  std::optional<CudaRuntime> too_new;
  auto consider = [&](void* lib, const std::string& name) -> bool {
    CudaRuntime api;
    api.library = name;
    if (std::string missing = ResolveRuntime(lib, &api); !missing.empty()) {
      rejected += (rejected.empty() ? "" : "; ") + name + " lacks " + missing;
      return false;
    }
    int count = 0;
    if (api.GetDeviceCount(&count) == kCudaErrorInsufficientDriver) {
      // Newer than the driver: another runtime on the list may be old enough. The rejected
      // library stays loaded: an initialized libcudart must not be unloaded.
      (void)api.GetLastError();
      if (!too_new) too_new = api;
      return false;
    }
    *out = api;
    return true;
  };
  for (const auto& [lib, name] : opened)
    if (consider(lib, name)) return Status::OK();
  for (const std::string& n : candidates) {
    void* lib = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      tried += (tried.empty() ? "" : ", ") + n;
      continue;
    }
    if (consider(lib, n)) return Status::OK();
  }
  if (too_new) {
    *out = *too_new;
    return Status::OK();
  }
  if (!rejected.empty()) return Status::NotSupported("no CUDA device", rejected);
  // Name the usual soname first: that is what a user installs.
  return Status::NotSupported("no CUDA device", "libcudart.so.12 not found (tried " + tried + ")");
}

Status LoadCudaRuntime(const CudaRuntime** out) {
  static CudaRuntime api;
  static Status status;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> names;
    if (const char* e = std::getenv("CKPTFS_CUDART"); e && *e) names.push_back(e);
    for (const char* n : {"libcudart.so.12", "libcudart.so.13", "libcudart.so"}) names.push_back(n);
    for (const std::string& p : PythonEnvLibraries("libcudart.so.1*")) names.push_back(p);
    status = OpenCudaRuntimeFrom(names, &api);
  });
  *out = &api;
  return status;
}

Status LoadCuFile(const CuFileApi** out) {
  static CuFileApi api;
  static Status status;
  static std::once_flag once;
  std::call_once(once, [] {
    // cuFile reads CUFILE_LOGFILE_PATH when it initializes.
    if (!std::getenv("CUFILE_LOGFILE_PATH")) {
      const char* tmp = std::getenv("TMPDIR");
      const std::string log = std::string(tmp && *tmp ? tmp : "/tmp") + "/ckptfs-cufile-" + std::to_string(::getuid()) + ".log";
      ::setenv("CUFILE_LOGFILE_PATH", log.c_str(), 0);
    }
    std::vector<std::string> names;
    if (const char* e = std::getenv("CKPTFS_CUFILE"); e && *e) names.push_back(e);
    names.push_back("libcufile.so.0");
    names.push_back("libcufile.so");
    for (const std::string& p : PythonEnvLibraries("libcufile.so.0")) names.push_back(p);
    std::string tried;
    void* lib = OpenFirst(names, &api.library, &tried);
    if (!lib) {
      status = Status::NotSupported("no cuFile", "libcufile.so.0 not found (tried " + tried + ")");
      return;
    }
    std::string missing;
    Resolve(lib, "cuFileDriverOpen", &api.DriverOpen, &missing);
    Resolve(lib, "cuFileDriverGetProperties", &api.DriverGetProperties, &missing);
    Resolve(lib, "cuFileHandleRegister", &api.HandleRegister, &missing);
    Resolve(lib, "cuFileHandleDeregister", &api.HandleDeregister, &missing);
    Resolve(lib, "cuFileBufRegister", &api.BufRegister, &missing);
    Resolve(lib, "cuFileBufDeregister", &api.BufDeregister, &missing);
    Resolve(lib, "cuFileRead", &api.Read, &missing);
    if (!missing.empty()) status = Status::NotSupported("no cuFile", api.library + " lacks " + missing);
  });
  *out = &api;
  return status;
}

}  // namespace ckptfs::device
