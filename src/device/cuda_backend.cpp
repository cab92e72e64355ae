// The CUDA back end (pinned host buffers, cudaMemcpyAsync on non-blocking streams, events)
// and its cuFile extension (GPUDirect Storage reads into device staging buffers), on the
// entry points cuda_loader.cpp resolves at run time. Also OpenBackend, which picks one.
#include <dlfcn.h>

#include <cerrno>

#include "ckptfs/device.hpp"
#include "device/cuda_api.hpp"

namespace ckptfs {
namespace {

using device::CudaError;
using device::CudaRuntime;
using device::CuFileApi;
using device::CuFileError;

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(const CudaRuntime* rt, const CuFileApi* cufile, int device) : rt_(rt), cufile_(cufile), device_(device) {}
  ~CudaBackend() override {
    if (cufile_) cufile_->DriverClose();
  }

  const char* name() const override { return cufile_ ? "cufile" : "cuda"; }
  std::string Describe() const override {
    int runtime = 0, driver = 0;
    rt_->RuntimeGetVersion(&runtime);
    rt_->DriverGetVersion(&driver);
    std::string d = "CUDA device " + std::to_string(device_) + ", runtime " + Version(runtime) + " (" + rt_->library +
                    "), driver " + Version(driver);
    if (cufile_) d += ", cuFile (" + cufile_->library + ")";
    return d;
  }
  Status BindThread() override { return Check(rt_->SetDevice(device_), "cudaSetDevice"); }

  Status AllocDevice(size_t bytes, void** ptr) override {
    *ptr = nullptr;
    return Check(rt_->Malloc(ptr, bytes), "cudaMalloc(" + std::to_string(bytes) + ")");
  }
  void FreeDevice(void* ptr) override {
    if (ptr) rt_->Free(ptr);
  }
  Status AllocPinned(size_t bytes, void** ptr) override {
    *ptr = nullptr;
    return Check(rt_->HostAlloc(ptr, bytes, device::kCudaHostAllocPortable), "cudaHostAlloc(" + std::to_string(bytes) + ")");
  }
  void FreePinned(void* ptr) override {
    if (ptr) rt_->FreeHost(ptr);
  }
  Status CreateStream(DeviceStream* stream) override {
    return Check(rt_->StreamCreateWithFlags(stream, device::kCudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  void DestroyStream(DeviceStream stream) override { rt_->StreamDestroy(stream); }
  Status CreateEvent(DeviceEvent* event) override {
    return Check(rt_->EventCreateWithFlags(event, device::kCudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  void DestroyEvent(DeviceEvent event) override { rt_->EventDestroy(event); }
  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream stream) override {
    const int k = kind == CopyKind::kHostToDevice ? device::kCudaMemcpyHostToDevice : device::kCudaMemcpyDeviceToDevice;
    return Check(rt_->MemcpyAsync(dst, src, bytes, k, stream), "cudaMemcpyAsync");
  }
  Status RecordEvent(DeviceEvent event, DeviceStream stream) override {
    return Check(rt_->EventRecord(event, stream), "cudaEventRecord");
  }
  Status WaitEvent(DeviceEvent event) override { return Check(rt_->EventSynchronize(event), "cudaEventSynchronize"); }
  Status Synchronize(DeviceStream stream) override {
    return Check(rt_->StreamSynchronize(stream), "cudaStreamSynchronize");
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Check(rt_->Memcpy(dst, src, bytes, device::kCudaMemcpyDeviceToHost), "cudaMemcpy");
  }

  bool SupportsDirectRead() const override { return cufile_ != nullptr; }
  Status OpenDirect(int fd, const std::string& path, DirectFile* file) override {
    if (!cufile_) return DeviceBackend::OpenDirect(fd, path, file);
    device::CuFileDescr descr{};
    descr.type = device::kCuFileHandleTypeOpaqueFd;
    descr.handle.fd = fd;
    descr.fs_ops = nullptr;
    void* handle = nullptr;
    CuFileError e = cufile_->HandleRegister(&handle, &descr);
    if (e.err != 0)
      return Status::NotSupported(path, "cuFileHandleRegister failed (cuFile error " + std::to_string(e.err) + ")");
    *file = handle;
    return Status::OK();
  }
  void CloseDirect(DirectFile file) override {
    if (cufile_ && file) cufile_->HandleDeregister(file);
  }
  void RegisterDirectBuffer(void* device_ptr, size_t bytes) override {
    // Optional: unregistered buffers work, through cuFile's own bounce buffers.
    if (cufile_) cufile_->BufRegister(device_ptr, bytes, 0);
  }
  void DeregisterDirectBuffer(void* device_ptr) override {
    if (cufile_) cufile_->BufDeregister(device_ptr);
  }
  Status ReadDirect(DirectFile file, const std::string& path, void* device_ptr, size_t bytes,
                    uint64_t file_offset) override {
    size_t done = 0;
    while (done < bytes) {
      ssize_t n = cufile_->Read(file, device_ptr, bytes - done, static_cast<off_t>(file_offset + done),
                                static_cast<off_t>(done));
      if (n < 0) {
        // -1: a system error in errno; other negative values: -CUfileOpError.
        if (n == -1) return Status::FromErrno(path, "cuFileRead failed", errno);
        return Status::FromErrno(path, "cuFileRead failed (cuFile error " + std::to_string(-n) + ")", EIO);
      }
      if (n == 0) return Status::SourceChanged(path, "file is shorter than when it was indexed");
      done += static_cast<size_t>(n);
    }
    return Status::OK();
  }

 private:
  static std::string Version(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }
  Status Check(CudaError e, const std::string& what) const {
    if (e == 0) return Status::OK();
    return Status::FromErrno("CUDA device " + std::to_string(device_),
                             what + " failed: " + rt_->GetErrorString(e) + " (cuda error " + std::to_string(e) + ")",
                             EIO);
  }

  const CudaRuntime* rt_;
  const CuFileApi* cufile_;
  int device_;
};

}  // namespace

Status OpenCudaBackend(int device, bool with_cufile, std::unique_ptr<DeviceBackend>* out) {
  const CudaRuntime* rt = nullptr;
  CKPTFS_RETURN_IF_ERROR(device::LoadCudaRuntime(&rt));
  int count = 0;
  if (CudaError e = rt->GetDeviceCount(&count); e != 0) {
    // Without a driver the runtime says "driver version is insufficient": name the cause.
    void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!driver)
      return Status::NotSupported("no CUDA device", "no NVIDIA driver (libcuda.so.1 not found; CUDA runtime " +
                                                        rt->library + ")");
    ::dlclose(driver);
    return Status::NotSupported("no CUDA device", std::string("cudaGetDeviceCount: ") + rt->GetErrorString(e) +
                                                      " (runtime " + rt->library + ")");
  }
  if (count == 0) return Status::NotSupported("no CUDA device", "the CUDA runtime sees no GPU (" + rt->library + ")");
  if (device < 0 || device >= count)
    return Status::InvalidArgument("device " + std::to_string(device),
                                   "out of range: " + std::to_string(count) + " CUDA device(s)");
  if (CudaError e = rt->SetDevice(device); e != 0)
    return Status::NotSupported("no CUDA device", std::string("cudaSetDevice: ") + rt->GetErrorString(e));
  const CuFileApi* cufile = nullptr;
  if (with_cufile) {
    CKPTFS_RETURN_IF_ERROR(device::LoadCuFile(&cufile));
    CuFileError e = cufile->DriverOpen();
    if (e.err != 0)
      return Status::NotSupported("no cuFile", "cuFileDriverOpen failed (cuFile error " + std::to_string(e.err) +
                                                   ", CUDA error " + std::to_string(e.cu_err) + ")");
  }
  *out = std::make_unique<CudaBackend>(rt, cufile, device);
  return Status::OK();
}

Status OpenBackend(const std::string& name, int device, std::unique_ptr<DeviceBackend>* out) {
  if (name == "host") {
    *out = MakeHostBackend();
    return Status::OK();
  }
  if (name == "cuda") return OpenCudaBackend(device, false, out);
  if (name == "cufile") return OpenCudaBackend(device, true, out);
  if (name == "auto") {
    Status s = OpenCudaBackend(device, true, out);
    if (s.ok() || s.message().rfind("no cuFile", 0) != 0) return s;
    return OpenCudaBackend(device, false, out);
  }
  return Status::InvalidArgument(name, "unknown back end (host, cuda, cufile, auto)");
}

}  // namespace ckptfs
