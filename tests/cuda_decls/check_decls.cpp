// Compile-time check of src/device/cuda_api.hpp (our own declarations of the CUDA runtime
// and cuFile entry points, resolved with dlsym) against NVIDIA's headers: every function
// pointer type we call through, every constant we pass, and the layout of every struct we
// exchange must match what the libraries were built with. Compiled by
// scripts/check-cuda-decls.sh with the headers of each CUDA major version we support; a
// mismatch is a static_assert naming the declaration. Nothing here runs.
#include <cuda_runtime_api.h>
#include <cufile.h>

#include <cstddef>
#include <type_traits>

#include "device/cuda_api.hpp"

namespace ours = ckptfs::device;

namespace {

template <typename T>
constexpr bool kIntegerLike = std::is_integral_v<T> || std::is_enum_v<T>;

// Whether a value of our type `A` is passed or returned exactly as NVIDIA's `B` is: the
// same type, integers/enums of one size (we declare enums as int), pointers to
// compatible pointees with the same constness (void stands for an opaque handle's
// pointee), or structs of one size and alignment (their fields are checked apart).
template <typename A, typename B>
constexpr bool SameAbi() {
  if constexpr (std::is_same_v<A, B>) {
    return true;
  } else if constexpr (kIntegerLike<A> && kIntegerLike<B>) {
    return sizeof(A) == sizeof(B);
  } else if constexpr (std::is_pointer_v<A> && std::is_pointer_v<B>) {
    using PA = std::remove_pointer_t<A>;
    using PB = std::remove_pointer_t<B>;
    if constexpr (std::is_const_v<PA> != std::is_const_v<PB>) {
      return false;
    } else if constexpr (std::is_void_v<PA> || std::is_void_v<PB>) {
      return !std::is_pointer_v<PA> && !std::is_pointer_v<PB> && !kIntegerLike<PA> && !kIntegerLike<PB>;
    } else {
      return SameAbi<std::remove_cv_t<PA>, std::remove_cv_t<PB>>();
    }
  } else if constexpr (std::is_class_v<A> && std::is_class_v<B>) {
    return sizeof(A) == sizeof(B) && alignof(A) == alignof(B);
  } else {
    return false;
  }
}

template <typename R1, typename... A1, typename R2, typename... A2>
constexpr bool SameFunction(R1 (*)(A1...), R2 (*)(A2...)) {
  if constexpr (sizeof...(A1) != sizeof...(A2)) {
    return false;
  } else {
    return SameAbi<R1, R2>() && (SameAbi<A1, A2>() && ...);
  }
}

}  // namespace

#define CKPTFS_CHECK_FUNCTION(table, member, theirs)                                                 \
  static_assert(SameFunction(static_cast<decltype(ours::table::member)>(nullptr), &theirs),         \
                "ours::" #table "::" #member " does not match NVIDIA's " #theirs)
#define CKPTFS_CHECK_VALUE(mine, theirs) \
  static_assert(static_cast<long long>(mine) == static_cast<long long>(theirs), #mine " != NVIDIA's " #theirs)
#define CKPTFS_CHECK_FIELD(mine, theirs, field)                                                     \
  static_assert(offsetof(mine, field) == offsetof(theirs, field) &&                                \
                    sizeof(mine::field) == sizeof(theirs::field),                                  \
                #mine "::" #field " is not where NVIDIA's " #theirs " has it")

// ---- CUDA runtime ----------------------------------------------------------------------
static_assert(sizeof(ours::CudaError) == sizeof(cudaError_t), "CudaError is not cudaError_t's size");
CKPTFS_CHECK_VALUE(0, cudaSuccess);
CKPTFS_CHECK_VALUE(ours::kCudaErrorInsufficientDriver, cudaErrorInsufficientDriver);
CKPTFS_CHECK_VALUE(ours::kCudaMemcpyHostToDevice, cudaMemcpyHostToDevice);
CKPTFS_CHECK_VALUE(ours::kCudaMemcpyDeviceToHost, cudaMemcpyDeviceToHost);
CKPTFS_CHECK_VALUE(ours::kCudaMemcpyDeviceToDevice, cudaMemcpyDeviceToDevice);
CKPTFS_CHECK_VALUE(ours::kCudaHostAllocPortable, cudaHostAllocPortable);
CKPTFS_CHECK_VALUE(ours::kCudaStreamNonBlocking, cudaStreamNonBlocking);
CKPTFS_CHECK_VALUE(ours::kCudaEventDisableTiming, cudaEventDisableTiming);

CKPTFS_CHECK_FUNCTION(CudaRuntime, GetDeviceCount, cudaGetDeviceCount);
CKPTFS_CHECK_FUNCTION(CudaRuntime, GetDevice, cudaGetDevice);
CKPTFS_CHECK_FUNCTION(CudaRuntime, SetDevice, cudaSetDevice);
CKPTFS_CHECK_FUNCTION(CudaRuntime, GetLastError, cudaGetLastError);
CKPTFS_CHECK_FUNCTION(CudaRuntime, Malloc, cudaMalloc);
CKPTFS_CHECK_FUNCTION(CudaRuntime, Free, cudaFree);
CKPTFS_CHECK_FUNCTION(CudaRuntime, HostAlloc, cudaHostAlloc);
CKPTFS_CHECK_FUNCTION(CudaRuntime, FreeHost, cudaFreeHost);
CKPTFS_CHECK_FUNCTION(CudaRuntime, Memcpy, cudaMemcpy);
CKPTFS_CHECK_FUNCTION(CudaRuntime, MemcpyAsync, cudaMemcpyAsync);
CKPTFS_CHECK_FUNCTION(CudaRuntime, StreamCreateWithFlags, cudaStreamCreateWithFlags);
CKPTFS_CHECK_FUNCTION(CudaRuntime, StreamDestroy, cudaStreamDestroy);
CKPTFS_CHECK_FUNCTION(CudaRuntime, StreamSynchronize, cudaStreamSynchronize);
CKPTFS_CHECK_FUNCTION(CudaRuntime, StreamWaitEvent, cudaStreamWaitEvent);
CKPTFS_CHECK_FUNCTION(CudaRuntime, EventCreateWithFlags, cudaEventCreateWithFlags);
CKPTFS_CHECK_FUNCTION(CudaRuntime, EventDestroy, cudaEventDestroy);
CKPTFS_CHECK_FUNCTION(CudaRuntime, EventRecord, cudaEventRecord);
CKPTFS_CHECK_FUNCTION(CudaRuntime, EventSynchronize, cudaEventSynchronize);
CKPTFS_CHECK_FUNCTION(CudaRuntime, GetErrorString, cudaGetErrorString);
CKPTFS_CHECK_FUNCTION(CudaRuntime, RuntimeGetVersion, cudaRuntimeGetVersion);
CKPTFS_CHECK_FUNCTION(CudaRuntime, DriverGetVersion, cudaDriverGetVersion);

// ---- cuFile ------------------------------------------------------------------------------
CKPTFS_CHECK_VALUE(0, CU_FILE_SUCCESS);
CKPTFS_CHECK_VALUE(ours::kCuFileHandleTypeOpaqueFd, CU_FILE_HANDLE_TYPE_OPAQUE_FD);
#ifdef CKPTFS_CUFILE_HAS_P2P
CKPTFS_CHECK_VALUE(ours::kCuFileFeatureP2PSupported, CU_FILE_P2P_SUPPORTED);
#endif

static_assert(sizeof(ours::CuFileError) == sizeof(CUfileError_t), "CuFileError is not CUfileError_t's size");
CKPTFS_CHECK_FIELD(ours::CuFileError, CUfileError_t, err);
CKPTFS_CHECK_FIELD(ours::CuFileError, CUfileError_t, cu_err);

static_assert(sizeof(ours::CuFileDescr) == sizeof(CUfileDescr_t), "CuFileDescr is not CUfileDescr_t's size");
CKPTFS_CHECK_FIELD(ours::CuFileDescr, CUfileDescr_t, type);
CKPTFS_CHECK_FIELD(ours::CuFileDescr, CUfileDescr_t, handle);
CKPTFS_CHECK_FIELD(ours::CuFileDescr, CUfileDescr_t, handle.fd);
CKPTFS_CHECK_FIELD(ours::CuFileDescr, CUfileDescr_t, fs_ops);

static_assert(sizeof(ours::CuFileDriverProps) == sizeof(CUfileDrvProps_t),
              "CuFileDriverProps is not CUfileDrvProps_t's size");
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, nvfs.major_version);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, nvfs.minor_version);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, nvfs.poll_thresh_size);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, nvfs.max_direct_io_size);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, nvfs.dstatusflags);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, nvfs.dcontrolflags);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, fflags);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, max_device_cache_size);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, per_buffer_cache_size);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, max_device_pinned_mem_size);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, max_batch_io_size);
CKPTFS_CHECK_FIELD(ours::CuFileDriverProps, CUfileDrvProps_t, max_batch_io_timeout_msecs);

CKPTFS_CHECK_FUNCTION(CuFileApi, DriverOpen, cuFileDriverOpen);
CKPTFS_CHECK_FUNCTION(CuFileApi, DriverGetProperties, cuFileDriverGetProperties);
CKPTFS_CHECK_FUNCTION(CuFileApi, HandleRegister, cuFileHandleRegister);
CKPTFS_CHECK_FUNCTION(CuFileApi, HandleDeregister, cuFileHandleDeregister);
CKPTFS_CHECK_FUNCTION(CuFileApi, BufRegister, cuFileBufRegister);
CKPTFS_CHECK_FUNCTION(CuFileApi, BufDeregister, cuFileBufDeregister);
CKPTFS_CHECK_FUNCTION(CuFileApi, Read, cuFileRead);
