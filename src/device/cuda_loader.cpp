// Finding and loading the CUDA runtime and cuFile at run time.
#include <dlfcn.h>
#include <glob.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "device/cuda_api.hpp"

namespace ckptfs::device {
namespace {

// Python environments whose nvidia-* wheels may carry the libraries: the active one, and
// the one the build's tests use (CMake passes it).
std::vector<std::string> PythonEnvLibraries(const std::string& pattern) {
  std::vector<std::string> roots;
  if (const char* v = std::getenv("VIRTUAL_ENV"); v && *v) roots.push_back(v);
#ifdef CKPTFS_PYTHON_ENV
  roots.push_back(CKPTFS_PYTHON_ENV);
#endif
  std::vector<std::string> found;
  for (const std::string& root : roots) {
    for (const char* sub : {"nvidia/cuda_runtime/lib", "nvidia/cu13/lib", "nvidia/cu12/lib", "nvidia/cufile/lib"}) {
      const std::string g = root + "/lib/python3*/site-packages/" + sub + "/" + pattern;
      glob_t gl{};
      if (::glob(g.c_str(), 0, nullptr, &gl) == 0) {
        for (size_t i = 0; i < gl.gl_pathc; ++i) found.push_back(gl.gl_pathv[i]);
      }
      ::globfree(&gl);
    }
  }
  return found;
}

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
