// Opening the cuFile driver once per process, and reading what it can do.
#include "device/cufile_driver.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ckptfs::device {
namespace {

// Whether `path` can be opened and read; the errno otherwise.
int ReadableErrno(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  char byte;
  ssize_t n;
  do {
    n = ::read(fd, &byte, 1);
  } while (n < 0 && errno == EINTR);
  const int err = n < 0 ? errno : 0;
  ::close(fd);
  return err;
}

}  // namespace

CuFileDriverInfo DescribeCuFileDriver(const CuFileDriverProps& props) {
  CuFileDriverInfo info;
  const bool nvfs = (props.nvfs.major_version != 0 || props.nvfs.minor_version != 0) && props.nvfs.dstatusflags != 0;
  const bool p2pdma = (props.fflags >> kCuFileFeatureP2PSupported) & 1u;
  info.gpudirect = nvfs || p2pdma;
  if (nvfs) {
    info.description = "GPUDirect (nvidia-fs " + std::to_string(props.nvfs.major_version) + "." +
                       std::to_string(props.nvfs.minor_version) + ")";
  } else if (p2pdma) {
    info.description = "GPUDirect (PCI P2PDMA)";
  } else {
    info.description = "compatibility mode (no GPUDirect)";
  }
  return info;
}

Status CuFileDriver::OpenOnce() {
  CKPTFS_RETURN_IF_ERROR(LoadCuFile(&api_));
  if (int err = ReadableErrno(proc_modules_); err != 0)
    return Status::NotSupported("no cuFile", "cannot read " + proc_modules_ + " (" + std::strerror(err) +
                                                 "), which cuFileDriverOpen needs: not opening the driver");
  CuFileError e = api_->DriverOpen();
  if (e.err != 0)
    return Status::NotSupported("no cuFile", "cuFileDriverOpen failed (cuFile error " + std::to_string(e.err) +
                                                 ", CUDA error " + std::to_string(e.cu_err) + ")");
  CuFileDriverProps props{};
  e = api_->DriverGetProperties(&props);
  if (e.err != 0)
    return Status::NotSupported("no cuFile", "cuFileDriverGetProperties failed (cuFile error " +
                                                 std::to_string(e.err) + ")");
  info_ = DescribeCuFileDriver(props);
  return Status::OK();
}

Status CuFileDriver::Open(const CuFileApi** api, CuFileDriverInfo* info) {
  std::call_once(once_, [this] { status_ = OpenOnce(); });
  *api = api_;
  *info = info_;
  return status_;
}

CuFileDriver& CuFileDriver::Process() {
  static CuFileDriver driver;
  return driver;
}

}  // namespace ckptfs::device
