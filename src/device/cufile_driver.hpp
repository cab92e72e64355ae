// The cuFile driver session: opened once per process (opening is slow and cuFile keeps
// process-wide state), after a probe that keeps a broken host from hanging the load, and
// described by the driver's properties, which say whether GPUDirect is really there.
#ifndef CKPTFS_DEVICE_CUFILE_DRIVER_HPP_
#define CKPTFS_DEVICE_CUFILE_DRIVER_HPP_

#include <mutex>
#include <string>

#include "ckptfs/status.hpp"
#include "device/cuda_api.hpp"

namespace ckptfs::device {

struct CuFileDriverInfo {
  // True when reads go storage -> GPU memory: nvidia-fs serves at least one file system
  // type, or PCI P2PDMA is supported. False in cuFile's compatibility mode, where cuFile
  // reads into its own host bounce buffers and copies (no better than the pinned route).
  bool gpudirect = false;
  std::string description;  // "GPUDirect (nvidia-fs 2.17)", "compatibility mode (no GPUDirect)"
};

class CuFileDriver {
 public:
  // `proc_modules` is read before cuFileDriverOpen, which needs it: cuFile 1.20 spins
  // forever when it cannot read the kernel module list.
  explicit CuFileDriver(std::string proc_modules = "/proc/modules") : proc_modules_(std::move(proc_modules)) {}

  // Loads cuFile and opens its driver on the first call; later calls give the first result.
  // Failures are kNotSupported statuses whose message starts "no cuFile:".
  Status Open(const CuFileApi** api, CuFileDriverInfo* info);

  // The one every load in this process shares. It is never closed: cuFile closes the
  // driver at process exit.
  static CuFileDriver& Process();

 private:
  Status OpenOnce();

  const std::string proc_modules_;
  std::once_flag once_;
  Status status_;
  const CuFileApi* api_ = nullptr;
  CuFileDriverInfo info_;
};

// What the driver's properties say (separate for tests).
CuFileDriverInfo DescribeCuFileDriver(const CuFileDriverProps& props);

}  // namespace ckptfs::device

#endif  // CKPTFS_DEVICE_CUFILE_DRIVER_HPP_
