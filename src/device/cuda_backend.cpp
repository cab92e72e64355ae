// The CUDA back end (pinned host buffers, cudaMemcpyAsync on non-blocking streams, events)
// and its cuFile extension (GPUDirect Storage reads into device staging buffers), on the
// entry points cuda_loader.cpp resolves at run time. Also OpenBackend, which picks one.
//
// The runtime is shared with the caller (PyTorch loads the same libcudart), so the back end
// leaves the caller's state as it found it: its thread's current device is given back, and
// an error ckptfs reports is cleared from the runtime's "last error" (else PyTorch's next
// check would raise it again).
#include "device/cuda_backend.hpp"

#include <dlfcn.h>

#include <cerrno>

#include "device/cuda_api.hpp"

namespace ckptfs::device {
namespace {

// Makes `device` current on the calling thread until destroyed, then the previous one.
// cudaGetDevice answers 0 on a thread that never chose one: the runtime's default, so
// giving 0 back is what that thread would have used anyway.
class CurrentDeviceSwitch {
 public:
  CurrentDeviceSwitch(const CudaRuntime* rt, int device) : rt_(rt), device_(device) {
    if (rt_->GetDevice(&saved_) != 0) {
      (void)rt_->GetLastError();
      saved_ = -1;
    }
    error_ = rt_->SetDevice(device_);
    if (error_ != 0) (void)rt_->GetLastError();
  }
  ~CurrentDeviceSwitch() { Restore(rt_, device_, saved_); }
  CudaError error() const { return error_; }
  int saved() const { return saved_; }

  static void Restore(const CudaRuntime* rt, int bound, int saved) {
    if (saved < 0 || saved == bound) return;
    if (rt->SetDevice(saved) != 0) (void)rt->GetLastError();
  }

 private:
  const CudaRuntime* rt_;
  int device_;
  int saved_ = -1;
  CudaError error_ = 0;
};

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(const CudaRuntime* rt, const CuFileApi* cufile, std::string cufile_mode, int device)
      : rt_(rt), cufile_(cufile), cufile_mode_(std::move(cufile_mode)), device_(device) {}

  const char* name() const override { return cufile_ ? "cufile" : "cuda"; }
  std::string Describe() const override {
    int runtime = 0, driver = 0;
    Quiet(rt_->RuntimeGetVersion(&runtime));
    Quiet(rt_->DriverGetVersion(&driver));
    std::string d = "CUDA device " + std::to_string(device_) + ", runtime " + Version(runtime) + " (" + rt_->library +
                    "), driver " + Version(driver);
    if (cufile_) d += ", cuFile " + cufile_mode_ + " (" + cufile_->library + ")";
    return d;
  }
  Status BindThread() override { return Check(rt_->SetDevice(device_), "cudaSetDevice"); }
  Status BindCallerThread(int* saved) override {
    if (rt_->GetDevice(saved) != 0) {
      (void)rt_->GetLastError();
      *saved = -1;
    }
    return BindThread();
  }
  void RestoreCallerThread(int saved) override { CurrentDeviceSwitch::Restore(rt_, device_, saved); }

  Status AllocDevice(size_t bytes, void** ptr) override {
    *ptr = nullptr;
    return Check(rt_->Malloc(ptr, bytes), "cudaMalloc(" + std::to_string(bytes) + ")");
  }
  void FreeDevice(void* ptr) override {
    if (ptr) Quiet(rt_->Free(ptr));
  }
  Status AllocPinned(size_t bytes, void** ptr) override {
    *ptr = nullptr;
    return Check(rt_->HostAlloc(ptr, bytes, kCudaHostAllocPortable), "cudaHostAlloc(" + std::to_string(bytes) + ")");
  }
  void FreePinned(void* ptr) override {
    if (ptr) Quiet(rt_->FreeHost(ptr));
  }
  Status CreateStream(DeviceStream* stream) override {
    return Check(rt_->StreamCreateWithFlags(stream, kCudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  void DestroyStream(DeviceStream stream) override { Quiet(rt_->StreamDestroy(stream)); }
  Status CreateEvent(DeviceEvent* event) override {
    return Check(rt_->EventCreateWithFlags(event, kCudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  void DestroyEvent(DeviceEvent event) override { Quiet(rt_->EventDestroy(event)); }
  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream stream) override {
    const int k = kind == CopyKind::kHostToDevice ? kCudaMemcpyHostToDevice : kCudaMemcpyDeviceToDevice;
    return Check(rt_->MemcpyAsync(dst, src, bytes, k, stream), "cudaMemcpyAsync");
  }
  Status RecordEvent(DeviceEvent event, DeviceStream stream) override {
    return Check(rt_->EventRecord(event, stream), "cudaEventRecord");
  }
  Status WaitEvent(DeviceEvent event) override { return Check(rt_->EventSynchronize(event), "cudaEventSynchronize"); }
  Status StreamWaitEvent(DeviceStream stream, DeviceEvent event) override {
    return Check(rt_->StreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent");
  }
  Status Synchronize(DeviceStream stream) override {
    return Check(rt_->StreamSynchronize(stream), "cudaStreamSynchronize");
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Check(rt_->Memcpy(dst, src, bytes, kCudaMemcpyDeviceToHost), "cudaMemcpy");
  }

  bool SupportsDirectRead() const override { return cufile_ != nullptr; }
  Status OpenDirect(int fd, const std::string& path, DirectFile* file) override {
    if (!cufile_) return DeviceBackend::OpenDirect(fd, path, file);
    CuFileDescr descr{};
    descr.type = kCuFileHandleTypeOpaqueFd;
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
  Status RegisterDirectBuffer(void* device_ptr, size_t bytes) override {
    if (!cufile_) return Status::OK();
    CuFileError e = cufile_->BufRegister(device_ptr, bytes, 0);
    if (e.err == 0) return Status::OK();
    return Status::NotSupported("CUDA device " + std::to_string(device_),
                                "cuFileBufRegister(" + std::to_string(bytes) + ") failed (cuFile error " +
                                    std::to_string(e.err) + ", CUDA error " + std::to_string(e.cu_err) + ")");
  }
  void DeregisterDirectBuffer(void* device_ptr) override {
    if (cufile_) cufile_->BufDeregister(device_ptr);
  }
  Status ReadDirect(DirectFile file, const std::string& path, void* buffer_base, uint64_t buffer_offset, size_t bytes,
                    uint64_t file_offset) override {
    size_t done = 0;
    while (done < bytes) {
      ssize_t n = cufile_->Read(file, buffer_base, bytes - done, static_cast<off_t>(file_offset + done),
                                static_cast<off_t>(buffer_offset + done));
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
  // A failure nobody reports: cleared so that the caller's next check does not see it.
  void Quiet(CudaError e) const {
    if (e != 0) (void)rt_->GetLastError();
  }
  Status Check(CudaError e, const std::string& what) const {
    if (e == 0) return Status::OK();
    (void)rt_->GetLastError();
    return Status::FromErrno("CUDA device " + std::to_string(device_),
                             what + " failed: " + rt_->GetErrorString(e) + " (cuda error " + std::to_string(e) + ")",
                             EIO);
  }

  const CudaRuntime* rt_;
  const CuFileApi* cufile_;
  std::string cufile_mode_;
  int device_;
};

}  // namespace

Status OpenCudaBackendWith(int device, CuFileUse use, CuFileDriver& driver, std::unique_ptr<DeviceBackend>* out) {
  const CudaRuntime* rt = nullptr;
  CKPTFS_RETURN_IF_ERROR(LoadCudaRuntime(&rt));
  int count = 0;
  if (CudaError e = rt->GetDeviceCount(&count); e != 0) {
    (void)rt->GetLastError();
    // Without a driver the runtime says "driver version is insufficient": name the cause.
    void* nvidia_driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!nvidia_driver)
      return Status::NotSupported("no CUDA device", "no NVIDIA driver (libcuda.so.1 not found; CUDA runtime " +
                                                        rt->library + ")");
    ::dlclose(nvidia_driver);
    return Status::NotSupported("no CUDA device", std::string("cudaGetDeviceCount: ") + rt->GetErrorString(e) +
                                                      " (runtime " + rt->library + ")");
  }
  if (count == 0) return Status::NotSupported("no CUDA device", "the CUDA runtime sees no GPU (" + rt->library + ")");
  if (device < 0 || device >= count)
    return Status::InvalidArgument("device " + std::to_string(device),
                                   "out of range: " + std::to_string(count) + " CUDA device(s)");
  // The device is current while cuFile opens (its driver binds to the current context),
  // and the caller's is current again when this returns.
  CurrentDeviceSwitch on_device(rt, device);
  if (on_device.error() != 0)
    return Status::NotSupported("no CUDA device", std::string("cudaSetDevice: ") + rt->GetErrorString(on_device.error()));
  const CuFileApi* cufile = nullptr;
  std::string cufile_mode;
  if (use != CuFileUse::kNone) {
    CuFileDriverInfo info;
    Status s = driver.Open(&cufile, &info);
    if (!s.ok() && use == CuFileUse::kRequired) return s;
    if (s.ok() && (info.gpudirect || use == CuFileUse::kRequired)) {
      cufile_mode = info.description;
    } else {
      cufile = nullptr;  // "auto": the pinned route is as good as cuFile without GPUDirect
    }
  }
  *out = std::make_unique<CudaBackend>(rt, cufile, cufile_mode, device);
  return Status::OK();
}

Status OpenBackendWith(const std::string& name, int device, CuFileDriver& driver,
                       std::unique_ptr<DeviceBackend>* out) {
  if (name == "host") {
    *out = MakeHostBackend();
    return Status::OK();
  }
  if (name == "cuda") return OpenCudaBackendWith(device, CuFileUse::kNone, driver, out);
  if (name == "cufile") return OpenCudaBackendWith(device, CuFileUse::kRequired, driver, out);
  if (name == "auto") return OpenCudaBackendWith(device, CuFileUse::kIfGpuDirect, driver, out);
  return Status::InvalidArgument(name, "unknown back end (host, cuda, cufile, auto)");
}

}  // namespace ckptfs::device

namespace ckptfs {

Status OpenCudaBackend(int device, bool with_cufile, std::unique_ptr<DeviceBackend>* out) {
  return device::OpenCudaBackendWith(device, with_cufile ? device::CuFileUse::kRequired : device::CuFileUse::kNone,
                                     device::CuFileDriver::Process(), out);
}

Status OpenBackend(const std::string& name, int device, std::unique_ptr<DeviceBackend>* out) {
  return device::OpenBackendWith(name, device, device::CuFileDriver::Process(), out);
}

}  // namespace ckptfs
