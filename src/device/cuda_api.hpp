// The CUDA runtime and cuFile entry points ckptfs uses, declared here (our own minimal
// declarations of their stable C ABI) and resolved at run time with dlopen/dlsym, so ckptfs
// builds without a CUDA toolkit and one binary runs with or without a GPU.
#ifndef CKPTFS_DEVICE_CUDA_API_HPP_
#define CKPTFS_DEVICE_CUDA_API_HPP_

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

#include "ckptfs/status.hpp"

namespace ckptfs::device {

// cudaError_t is an int-sized enum; 0 is success. Streams and events are pointers.
// tests/cuda_decls checks every declaration here against NVIDIA's headers.
using CudaError = int;
// cudaErrorInsufficientDriver: this runtime is newer than the installed driver.
inline constexpr int kCudaErrorInsufficientDriver = 35;
inline constexpr int kCudaMemcpyHostToDevice = 1;
inline constexpr int kCudaMemcpyDeviceToHost = 2;
inline constexpr int kCudaMemcpyDeviceToDevice = 3;
inline constexpr unsigned kCudaHostAllocPortable = 0x01;
inline constexpr unsigned kCudaStreamNonBlocking = 0x01;
inline constexpr unsigned kCudaEventDisableTiming = 0x02;

struct CudaRuntime {
  std::string library;  // the path or soname that was loaded
  CudaError (*GetDeviceCount)(int*) = nullptr;
  CudaError (*GetDevice)(int*) = nullptr;
  CudaError (*SetDevice)(int) = nullptr;
  CudaError (*GetLastError)() = nullptr;
  CudaError (*Malloc)(void**, size_t) = nullptr;
  CudaError (*Free)(void*) = nullptr;
  CudaError (*HostAlloc)(void**, size_t, unsigned) = nullptr;
  CudaError (*FreeHost)(void*) = nullptr;
  CudaError (*Memcpy)(void*, const void*, size_t, int) = nullptr;
  CudaError (*MemcpyAsync)(void*, const void*, size_t, int, void*) = nullptr;
  CudaError (*StreamCreateWithFlags)(void**, unsigned) = nullptr;
  CudaError (*StreamDestroy)(void*) = nullptr;
  CudaError (*StreamSynchronize)(void*) = nullptr;
  CudaError (*EventCreateWithFlags)(void**, unsigned) = nullptr;
  CudaError (*EventDestroy)(void*) = nullptr;
  CudaError (*EventRecord)(void*, void*) = nullptr;
  CudaError (*EventSynchronize)(void*) = nullptr;
  CudaError (*StreamWaitEvent)(void* stream, void* event, unsigned flags) = nullptr;
  const char* (*GetErrorString)(CudaError) = nullptr;
  CudaError (*RuntimeGetVersion)(int*) = nullptr;
  CudaError (*DriverGetVersion)(int*) = nullptr;
};

// cuFile (GPUDirect Storage). CUfileError_t is {CUfileOpError err; CUresult cu_err;}, two
// int-sized enums returned by value; CUfileHandle_t is a pointer.
struct CuFileError {
  int err;
  int cu_err;
};
inline constexpr int kCuFileHandleTypeOpaqueFd = 1;
struct CuFileDescr {
  int type;
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};

// CUfileDrvProps_t, as cuFileDriverGetProperties fills it.
struct CuFileDriverProps {
  struct {
    unsigned major_version;
    unsigned minor_version;
    size_t poll_thresh_size;
    size_t max_direct_io_size;
    unsigned dstatusflags;  // bit CUfileDriverStatusFlags: file systems GPUDirect reaches
    unsigned dcontrolflags;
  } nvfs;
  unsigned fflags;  // bit CUfileFeatureFlags
  unsigned max_device_cache_size;
  unsigned per_buffer_cache_size;
  unsigned max_device_pinned_mem_size;
  unsigned max_batch_io_size;
  unsigned max_batch_io_timeout_msecs;
};
// CU_FILE_P2P_SUPPORTED (cuFile 1.15 and later): GPUDirect over PCI P2PDMA, without nvidia-fs.
inline constexpr int kCuFileFeatureP2PSupported = 4;

struct CuFileApi {
  std::string library;
  CuFileError (*DriverOpen)() = nullptr;
  CuFileError (*DriverGetProperties)(CuFileDriverProps* props) = nullptr;
  CuFileError (*HandleRegister)(void** fh, CuFileDescr* descr) = nullptr;
  void (*HandleDeregister)(void* fh) = nullptr;
  CuFileError (*BufRegister)(const void* ptr, size_t length, int flags) = nullptr;
  CuFileError (*BufDeregister)(const void* ptr) = nullptr;
  // buf_base is the pointer given to BufRegister; buf_offset says where in it the bytes go.
  ssize_t (*Read)(void* fh, void* buf_base, size_t size, off_t file_offset, off_t buf_offset) = nullptr;
};

// Loads the CUDA runtime once per process: an already loaded libcudart (torch's), then
// $CKPTFS_CUDART, libcudart.so.12, libcudart.so.13, libcudart.so (LD_LIBRARY_PATH and the
// system's), then the copies in Python environments' NVIDIA wheels (PythonEnvLibraries). A
// runtime that is too new for the driver is passed over for the next candidate. The error
// says what was tried.
Status LoadCudaRuntime(const CudaRuntime** out);
// The first of `candidates` (sonames or paths) that loads, has every entry point, and whose
// cudaGetDeviceCount does not answer cudaErrorInsufficientDriver; if every runtime that
// loads answers that, the first of them (its error is then what the caller reports).
// Libraries already in the process are preferred (RTLD_NOLOAD).
Status OpenCudaRuntimeFrom(const std::vector<std::string>& candidates, CudaRuntime* out);
// Loads cuFile ($CKPTFS_CUFILE, libcufile.so.0, the Python environments' copies) once. Unless
// the user chose one, cuFile's log goes to $TMPDIR (cufile.json's default is the current
// directory).
Status LoadCuFile(const CuFileApi** out);

// The site-packages folders searched for NVIDIA's wheels (nvidia-cuda-runtime, nvidia-cufile
// and their cu12/cu13 bundles), in this order, each once: the one holding the code running
// (libckptfs.so, or the ckptfs binary, installed from the wheel), those holding the other
// shared objects in the process (an interpreter's torch and numpy), then those of
// $VIRTUAL_ENV. Nothing of the machine that built ckptfs is searched.
std::vector<std::string> PythonSitePackages();
// The files matching the glob PATTERN in the NVIDIA wheels' lib folders (nvidia/cuda_runtime,
// nvidia/cu13, nvidia/cu12, nvidia/cufile) of PythonSitePackages(), in that order.
std::vector<std::string> PythonEnvLibraries(const char* pattern);

}  // namespace ckptfs::device

#endif  // CKPTFS_DEVICE_CUDA_API_HPP_
