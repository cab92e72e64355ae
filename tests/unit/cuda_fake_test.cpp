// The CUDA back end and its cuFile route over fake libcudart / libcufile libraries
// (tests/fakes: host memory, every call logged), so what the back end asks of NVIDIA's
// libraries is checked without a GPU: the caller's current device comes back after loads
// that succeed and fail, reported errors are cleared from the runtime, the load waits for
// the caller's stream, cuFileRead gets the registered base and the offset apart, the driver
// opens once per process and never when /proc/modules cannot be read, "auto" leaves cuFile
// alone in compatibility mode, a runtime too new for the driver is passed over, and the
// Python environments searched for NVIDIA's wheels are the process's and $VIRTUAL_ENV's.
#define BOOST_TEST_MODULE cuda_fake_test
#include <boost/test/unit_test.hpp>

#include <dlfcn.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <vector>

#include "ckptfs/device.hpp"
#include "ckptfs/view.hpp"
#include "device/cuda_api.hpp"
#include "device/cuda_backend.hpp"
#include "device/cufile_driver.hpp"
#include "test_util.hpp"

using ckptfs::DeviceBackend;
using ckptfs::DeviceDestination;
using ckptfs::DeviceLoadOptions;
using ckptfs::DeviceTensor;
using ckptfs::Status;
using ckptfs::View;
using ckptfs::device::CuFileDriver;
using ckptfs::device::OpenBackendWith;
using namespace ckptfs_test;

namespace {

// The fakes' control functions, from the same copies the loader opened.
struct Fakes {
  void* cudart = nullptr;
  void* cufile = nullptr;
  void (*cudart_reset)(int) = nullptr;
  void (*cudart_fail)(const char*, int, int) = nullptr;
  const char* (*cudart_log)() = nullptr;
  int (*uncleared_errors)() = nullptr;
  int (*set_device)(int) = nullptr;
  int (*get_device)(int*) = nullptr;
  int (*create_stream)(void**, unsigned) = nullptr;
  int (*destroy_stream)(void*) = nullptr;
  void (*cufile_reset)(int, int) = nullptr;
  int (*cufile_opens)() = nullptr;
  int (*cufile_reads)() = nullptr;
  int (*cufile_reads_with_offset)() = nullptr;
  int (*cufile_reads_off_registered)() = nullptr;
  int (*cufile_bad_deregisters)() = nullptr;

  template <typename F>
  static void Get(void* lib, const char* name, F* fn) {
    *fn = reinterpret_cast<F>(::dlsym(lib, name));
    if (!*fn) throw std::runtime_error(std::string("fake lacks ") + name);
  }
  Fakes() {
    // The loader takes these from the environment; set before its first (once per process) use.
    ::setenv("CKPTFS_CUDART", FAKE_CUDART, 1);
    ::setenv("CKPTFS_CUFILE", FAKE_CUFILE, 1);
    cudart = ::dlopen(FAKE_CUDART, RTLD_NOW | RTLD_LOCAL);
    cufile = ::dlopen(FAKE_CUFILE, RTLD_NOW | RTLD_LOCAL);
    if (!cudart || !cufile) throw std::runtime_error(::dlerror());
    Get(cudart, "fake_cudart_reset", &cudart_reset);
    Get(cudart, "fake_cudart_fail", &cudart_fail);
    Get(cudart, "fake_cudart_log", &cudart_log);
    Get(cudart, "fake_cudart_uncleared_errors", &uncleared_errors);
    Get(cudart, "cudaSetDevice", &set_device);
    Get(cudart, "cudaGetDevice", &get_device);
    Get(cudart, "cudaStreamCreateWithFlags", &create_stream);
    Get(cudart, "cudaStreamDestroy", &destroy_stream);
    Get(cufile, "fake_cufile_reset", &cufile_reset);
    Get(cufile, "fake_cufile_opens", &cufile_opens);
    Get(cufile, "fake_cufile_reads", &cufile_reads);
    Get(cufile, "fake_cufile_reads_with_offset", &cufile_reads_with_offset);
    Get(cufile, "fake_cufile_reads_off_registered", &cufile_reads_off_registered);
    Get(cufile, "fake_cufile_bad_deregisters", &cufile_bad_deregisters);
  }
  int CurrentDevice() const {
    int d = -1;
    get_device(&d);
    return d;
  }
  std::vector<std::string> Log() const {
    std::vector<std::string> lines;
    std::istringstream in(cudart_log());
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }
};

Fakes& TheFakes() {
  static Fakes fakes;
  return fakes;
}

// Every test starts from a clean fake: two devices, device 0 current, GPUDirect cuFile.
struct FreshFakes {
  Fakes& f = TheFakes();
  FreshFakes() {
    f.cudart_reset(2);
    f.cufile_reset(1, 0);
    BOOST_REQUIRE(f.set_device(0) == 0);
  }
};

// a.small, a 200 KiB tensor, b.small: selecting the small ones gives two reads (the gap is
// wider than kMaxMergeGap) into one ring buffer, the second at a non-zero buffer offset.
struct Source {
  TempDir dir;
  std::string path = dir.File("model.safetensors");
  std::vector<std::string> bytes;
  Source() {
    const std::vector<std::pair<std::string, size_t>> tensors = {
        {"a.small", 5000}, {"filler", 200 * 1024}, {"b.small", 6000}};
    std::string header = "{", data;
    for (size_t i = 0; i < tensors.size(); ++i) {
      bytes.push_back(PatternBytes(tensors[i].second, static_cast<uint32_t>(i + 7)));
      if (i) header += ",";
      header += "\"" + tensors[i].first + "\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(tensors[i].second) +
                "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
                std::to_string(data.size() + tensors[i].second) + "]}";
      data += bytes.back();
    }
    header += "}";
    while ((8 + header.size()) % 8) header += ' ';
    WriteFile(path, SafetensorsBytes(header, data));
  }
  std::unique_ptr<View> OpenView() const {
    std::shared_ptr<const ckptfs::Catalog> catalog;
    Status s = ckptfs::OpenCatalog(path, &catalog);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    std::unique_ptr<View> view;
    s = View::Build(std::move(catalog), {}, &view);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    return view;
  }
};

DeviceLoadOptions SmallTensors() {
  DeviceLoadOptions o;
  o.select = {"a.small", "b.small"};
  o.buffer_bytes = size_t{1} << 20;
  o.buffers = 2;
  return o;
}

void CheckBytes(const Source& src, const std::vector<DeviceTensor>& tensors) {
  BOOST_REQUIRE_EQUAL(tensors.size(), 2u);
  BOOST_TEST(std::memcmp(tensors[0].device_ptr, src.bytes[0].data(), src.bytes[0].size()) == 0);
  BOOST_TEST(std::memcmp(tensors[1].device_ptr, src.bytes[2].data(), src.bytes[2].size()) == 0);
}

// A readable stand-in for /proc/modules.
struct ModulesFile {
  TempDir dir;
  std::string path = dir.File("modules");
  ModulesFile() { WriteFile(path, "nvidia_fs 262144 0 - Live 0x0000000000000000 (OE)\n"); }
};

}  // namespace

BOOST_FIXTURE_TEST_CASE(current_device_restored_after_load_and_failed_load, FreshFakes) {
  Source src;
  auto view = src.OpenView();
  CuFileDriver driver;
  std::unique_ptr<DeviceBackend> backend;
  Status s = OpenBackendWith("cuda", 1, driver, &backend);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(f.CurrentDevice() == 0);

  std::vector<DeviceTensor> tensors;
  s = ckptfs::LoadToDevice(*view, *backend, SmallTensors(), &tensors);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(f.CurrentDevice() == 0);
  CheckBytes(src, tensors);
  s = ckptfs::VerifyDeviceTensors(*view, *backend, tensors);
  BOOST_TEST(s.ok(), s.message());
  BOOST_TEST(f.CurrentDevice() == 0);
  ckptfs::FreeDeviceTensors(*backend, &tensors);

  // Failures on a worker thread and on the caller's thread: the device comes back, and
  // no error stays set in the runtime.
  for (const char* call : {"cudaMemcpyAsync", "cudaHostAlloc", "cudaMalloc"}) {
    BOOST_TEST_CONTEXT(call) {
      f.cudart_fail(call, 1, 2 /* cudaErrorMemoryAllocation */);
      s = ckptfs::LoadToDevice(*view, *backend, SmallTensors(), &tensors);
      BOOST_TEST(!s.ok());
      BOOST_TEST(Contains(s.message(), "cuda error 2"), s.message());
      BOOST_TEST(f.CurrentDevice() == 0);
      BOOST_TEST(f.uncleared_errors() == 0);
    }
  }
}

BOOST_FIXTURE_TEST_CASE(current_device_restored_when_opening_fails, FreshFakes) {
  CuFileDriver driver;
  std::unique_ptr<DeviceBackend> backend;
  f.cudart_fail("cudaSetDevice", 1, 101);
  Status s = OpenBackendWith("cuda", 1, driver, &backend);
  BOOST_TEST(Contains(s.message(), "no CUDA device: cudaSetDevice"), s.message());
  BOOST_TEST(f.CurrentDevice() == 0);
  BOOST_TEST(f.uncleared_errors() == 0);
  BOOST_TEST((OpenBackendWith("cuda", 5, driver, &backend).code() == Status::Code::kInvalidArgument));
  BOOST_TEST(f.CurrentDevice() == 0);
}

BOOST_FIXTURE_TEST_CASE(load_waits_for_the_callers_stream, FreshFakes) {
  Source src;
  auto view = src.OpenView();
  CuFileDriver driver;
  std::unique_ptr<DeviceBackend> backend;
  BOOST_REQUIRE(OpenBackendWith("cuda", 0, driver, &backend).ok());
  void* caller_stream = nullptr;
  BOOST_REQUIRE(f.create_stream(&caller_stream, 0) == 0);
  DeviceLoadOptions options = SmallTensors();
  options.after_stream = caller_stream;
  std::vector<DeviceTensor> tensors;
  f.cudart_reset(2);
  Status s = ckptfs::LoadToDevice(*view, *backend, options, &tensors);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  CheckBytes(src, tensors);
  ckptfs::FreeDeviceTensors(*backend, &tensors);

  // cudaEventRecord(E, caller) first, then each copy stream waits on E before its first copy.
  std::ostringstream caller;
  caller << caller_stream;
  std::string event;
  std::vector<std::string> waited;
  size_t copies = 0;
  for (const std::string& line : f.Log()) {
    std::istringstream in(line);
    std::string call, a, b;
    in >> call >> a >> b;
    if (call == "cudaEventRecord" && b == caller.str()) {
      BOOST_TEST(event.empty());
      event = a;
    } else if (call == "cudaStreamWaitEvent") {
      BOOST_TEST(b == event, line << ": waits before the caller's stream was recorded");
      waited.push_back(a);
    } else if (call == "cudaMemcpyAsync") {
      ++copies;
      BOOST_TEST((std::find(waited.begin(), waited.end(), a) != waited.end()), line << ": copy before the wait");
    }
  }
  BOOST_TEST(!event.empty());
  BOOST_TEST(copies == 2u);
  BOOST_TEST(f.destroy_stream(caller_stream) == 0);
}

BOOST_FIXTURE_TEST_CASE(cufile_reads_into_the_registered_base_at_an_offset, FreshFakes) {
  Source src;
  auto view = src.OpenView();
  ModulesFile modules;
  CuFileDriver driver(modules.path);
  for (bool register_fails : {false, true}) {
    BOOST_TEST_CONTEXT("registration fails: " << register_fails) {
      f.cufile_reset(1, register_fails);
      std::unique_ptr<DeviceBackend> backend;
      Status s = OpenBackendWith("auto", 0, driver, &backend);
      BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
      BOOST_TEST(backend->name() == std::string("cufile"));
      BOOST_TEST(Contains(backend->Describe(), "GPUDirect (nvidia-fs 2.17)"), backend->Describe());
      std::vector<DeviceTensor> tensors;
      ckptfs::DeviceLoadStats stats;
      s = ckptfs::LoadToDevice(*view, *backend, SmallTensors(), &tensors, &stats);
      BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
      CheckBytes(src, tensors);
      ckptfs::FreeDeviceTensors(*backend, &tensors);
      BOOST_TEST(stats.direct_bytes == 11000u);
      BOOST_TEST(f.cufile_reads() >= 2);
      BOOST_TEST(f.cufile_reads_with_offset() >= 1);  // the second read lands past the first
      BOOST_TEST(f.cufile_reads_off_registered() == 0);
      BOOST_TEST(f.cufile_bad_deregisters() == 0);
    }
  }
  BOOST_TEST(f.cufile_opens() == 0);  // reset above; the driver opened before, once
}

BOOST_FIXTURE_TEST_CASE(cufile_driver_opens_once_per_process, FreshFakes) {
  ModulesFile modules;
  CuFileDriver driver(modules.path);
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<DeviceBackend> backend;
    BOOST_REQUIRE(OpenBackendWith("cufile", 0, driver, &backend).ok());
  }
  BOOST_TEST(f.cufile_opens() == 1);
}

BOOST_FIXTURE_TEST_CASE(unreadable_proc_modules_never_reaches_driver_open, FreshFakes) {
  TempDir dir;
  for (const std::string& modules : {dir.File("missing"), dir.path() /* a directory: read fails */}) {
    BOOST_TEST_CONTEXT(modules) {
      CuFileDriver driver(modules);
      std::unique_ptr<DeviceBackend> backend;
      Status s = OpenBackendWith("cufile", 0, driver, &backend);
      BOOST_TEST(s.message().rfind("no cuFile: cannot read " + modules, 0) == 0u, s.message());
      BOOST_TEST(f.cufile_opens() == 0);
      // "auto" goes on without cuFile.
      s = OpenBackendWith("auto", 0, driver, &backend);
      BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
      BOOST_TEST(backend->name() == std::string("cuda"));
      BOOST_TEST(f.cufile_opens() == 0);
    }
  }
}

BOOST_FIXTURE_TEST_CASE(auto_leaves_cufile_in_compatibility_mode, FreshFakes) {
  f.cufile_reset(0, 0);
  ModulesFile modules;
  CuFileDriver driver(modules.path);
  std::unique_ptr<DeviceBackend> backend;
  BOOST_REQUIRE(OpenBackendWith("auto", 0, driver, &backend).ok());
  BOOST_TEST(backend->name() == std::string("cuda"));
  // Asked for by name, cuFile is used, and says it is in compatibility mode.
  BOOST_REQUIRE(OpenBackendWith("cufile", 0, driver, &backend).ok());
  BOOST_TEST(backend->name() == std::string("cufile"));
  BOOST_TEST(Contains(backend->Describe(), "compatibility mode (no GPUDirect)"), backend->Describe());
}

BOOST_AUTO_TEST_CASE(driver_properties_decide_gpudirect) {
  ckptfs::device::CuFileDriverProps props{};
  BOOST_TEST(!ckptfs::device::DescribeCuFileDriver(props).gpudirect);
  props.nvfs.major_version = 2;  // nvidia-fs loaded, but no file system it serves
  BOOST_TEST(!ckptfs::device::DescribeCuFileDriver(props).gpudirect);
  props.nvfs.dstatusflags = 1u << 4;
  BOOST_TEST(ckptfs::device::DescribeCuFileDriver(props).gpudirect);
  props = {};
  props.fflags = 1u << ckptfs::device::kCuFileFeatureP2PSupported;
  BOOST_TEST(ckptfs::device::DescribeCuFileDriver(props).gpudirect);
}

BOOST_FIXTURE_TEST_CASE(runtime_too_new_for_the_driver_is_passed_over, FreshFakes) {
  ckptfs::device::CudaRuntime rt;
  Status s = ckptfs::device::OpenCudaRuntimeFrom({FAKE_CUDART_TOO_NEW, FAKE_CUDART}, &rt);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(rt.library == FAKE_CUDART);
  // Alone, it is still chosen, so that its error is what the user sees.
  s = ckptfs::device::OpenCudaRuntimeFrom({FAKE_CUDART_TOO_NEW}, &rt);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(rt.library == FAKE_CUDART_TOO_NEW);
  s = ckptfs::device::OpenCudaRuntimeFrom({"libckptfs-no-such-cudart.so"}, &rt);
  BOOST_TEST(s.message().rfind("no CUDA device: ", 0) == 0u, s.message());
}

// Where NVIDIA's wheels are looked for, from the process itself: the site-packages holding a
// loaded shared object (an interpreter's torch), then $VIRTUAL_ENV's; a folder that is no
// site-packages adds nothing, and each folder comes once.
BOOST_AUTO_TEST_CASE(python_environments_come_from_the_process_and_virtual_env) {
  namespace fs = std::filesystem;
  TempDir tmp;
  const std::string interpreter_site = tmp.File("interp/lib/python3.11/site-packages");
  const std::string venv = tmp.File("venv");
  const std::string venv_site = venv + "/lib/python3.12/site-packages";
  // A loaded object of the interpreter's environment (a copy of a fake: a library with no
  // thread_locals, so one more copy in the process is harmless), and one outside any.
  fs::create_directories(interpreter_site + "/torch/lib");
  fs::create_directories(tmp.File("elsewhere/lib"));
  fs::copy_file(FAKE_CUFILE, interpreter_site + "/torch/lib/libtorch_stand_in.so");
  fs::copy_file(FAKE_CUFILE, tmp.File("elsewhere/lib/libother.so"));
  void* in_site = ::dlopen((interpreter_site + "/torch/lib/libtorch_stand_in.so").c_str(), RTLD_NOW | RTLD_LOCAL);
  void* outside = ::dlopen(tmp.File("elsewhere/lib/libother.so").c_str(), RTLD_NOW | RTLD_LOCAL);
  BOOST_REQUIRE(in_site && outside);
  // The wheels' libraries in both environments.
  for (const std::string& lib : {interpreter_site + "/nvidia/cu13/lib", venv_site + "/nvidia/cuda_runtime/lib"}) {
    fs::create_directories(lib);
    WriteFile(lib + "/libcudart.so.13", "");
  }
  WriteFile(venv_site + "/nvidia/cuda_runtime/lib/libcudart.so.12", "");

  const char* old = std::getenv("VIRTUAL_ENV");
  const std::string saved = old ? old : "";
  ::setenv("VIRTUAL_ENV", venv.c_str(), 1);
  const std::vector<std::string> sites = ckptfs::device::PythonSitePackages();
  const std::vector<std::string> runtimes = ckptfs::device::PythonEnvLibraries("libcudart.so.1*");
  if (old) ::setenv("VIRTUAL_ENV", saved.c_str(), 1); else ::unsetenv("VIRTUAL_ENV");
  ::dlclose(outside);
  ::dlclose(in_site);

  // The test program lies in no site-packages, and neither do its libraries.
  const std::vector<std::string> want_sites{interpreter_site, venv_site};
  BOOST_TEST(sites == want_sites, boost::test_tools::per_element());
  const std::vector<std::string> want_runtimes{interpreter_site + "/nvidia/cu13/lib/libcudart.so.13",
                                               venv_site + "/nvidia/cuda_runtime/lib/libcudart.so.12",
                                               venv_site + "/nvidia/cuda_runtime/lib/libcudart.so.13"};
  BOOST_TEST(runtimes == want_runtimes, boost::test_tools::per_element());
}
