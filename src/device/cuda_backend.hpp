// Opening the CUDA back end with a given cuFile driver session (the process's, or a test's).
#ifndef CKPTFS_DEVICE_CUDA_BACKEND_HPP_
#define CKPTFS_DEVICE_CUDA_BACKEND_HPP_

#include <memory>
#include <string>

#include "ckptfs/device.hpp"
#include "device/cufile_driver.hpp"

namespace ckptfs::device {

enum class CuFileUse {
  kNone,         // "cuda": pinned buffers only
  kRequired,     // "cufile": cuFile or an error (compatibility mode included)
  kIfGpuDirect,  // "auto": cuFile only where its driver reports GPUDirect, else pinned buffers
};

Status OpenCudaBackendWith(int device, CuFileUse use, CuFileDriver& driver, std::unique_ptr<DeviceBackend>* out);
// OpenBackend over `driver`.
Status OpenBackendWith(const std::string& name, int device, CuFileDriver& driver,
                       std::unique_ptr<DeviceBackend>* out);

}  // namespace ckptfs::device

#endif  // CKPTFS_DEVICE_CUDA_BACKEND_HPP_
