// The CUDA runtime and cuFile entry points ckptfs uses, declared here (our own minimal
// declarations of their stable C ABI) and resolved at run time with dlopen/dlsym, so ckptfs
// builds without a CUDA toolkit and one binary runs with or without a GPU.
#ifndef CKPTFS_DEVICE_CUDA_API_HPP_
#define CKPTFS_DEVICE_CUDA_API_HPP_

#include <sys/types.h>

#include <cstddef>
#include <string>

#include "ckptfs/status.hpp"

namespace ckptfs::device {

// cudaError_t is an int-sized enum; 0 is success. Streams and events are pointers.
using CudaError = int;
inline constexpr int kCudaMemcpyHostToDevice = 1;
inline constexpr int kCudaMemcpyDeviceToHost = 2;
inline constexpr int kCudaMemcpyDeviceToDevice = 3;
inline constexpr unsigned kCudaHostAllocPortable = 0x01;
inline constexpr unsigned kCudaStreamNonBlocking = 0x01;
inline constexpr unsigned kCudaEventDisableTiming = 0x02;

struct CudaRuntime {
  std::string library;  // the path or soname that was loaded
  CudaError (*GetDeviceCount)(int*) = nullptr;
  CudaError (*SetDevice)(int) = nullptr;
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

struct CuFileApi {
  std::string library;
  CuFileError (*DriverOpen)() = nullptr;
  CuFileError (*DriverClose)() = nullptr;
  CuFileError (*HandleRegister)(void** fh, CuFileDescr* descr) = nullptr;
  void (*HandleDeregister)(void* fh) = nullptr;
  CuFileError (*BufRegister)(const void* ptr, size_t length, int flags) = nullptr;
  CuFileError (*BufDeregister)(const void* ptr) = nullptr;
  ssize_t (*Read)(void* fh, void* buf, size_t size, off_t file_offset, off_t buf_offset) = nullptr;
};

// Loads the CUDA runtime once per process: an already loaded libcudart (torch's), then
// $CKPTFS_CUDART, libcudart.so.12, libcudart.so.13, libcudart.so, then the copies in a
// Python environment (nvidia/cuda_runtime/lib, nvidia/cu1*/lib under $VIRTUAL_ENV and the
// build's test environment). The error says what was tried.
Status LoadCudaRuntime(const CudaRuntime** out);
// Loads cuFile (libcufile.so.0, $CKPTFS_CUFILE, the Python environment's copy) once.
Status LoadCuFile(const CuFileApi** out);

}  // namespace ckptfs::device

#endif  // CKPTFS_DEVICE_CUDA_API_HPP_
