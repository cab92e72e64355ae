// A stand-in for libcufile, built for the tests: file handles are descriptors, reads are
// pread into the (host) "device" buffer, and it counts what the back end did: driver opens,
// reads whose base pointer is not a registered buffer, deregistrations of buffers that were
// never registered. cuFileDriverGetProperties answers as a GPUDirect host or as one in
// compatibility mode (no nvidia-fs), as the test sets.
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>

#define FAKE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// NVIDIA's types as cufile.h lays them out, written here apart from src/device/cuda_api.hpp on
// purpose: a fake that reused our declarations would agree with a wrong one.
struct Error {
  int err;
  int cu_err;
};
struct Descr {
  int type;
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};
struct DriverProps {
  struct {
    unsigned major_version, minor_version;
    size_t poll_thresh_size, max_direct_io_size;
    unsigned dstatusflags, dcontrolflags;
  } nvfs;
  unsigned fflags, max_device_cache_size, per_buffer_cache_size, max_device_pinned_mem_size, max_batch_io_size,
      max_batch_io_timeout_msecs;
};
constexpr int kInvalidValue = 5022;  // CU_FILE_INVALID_VALUE
constexpr int kPinningFailed = 5026;  // CU_FILE_GPU_MEMORY_PINNING_FAILED

std::mutex g_mu;
bool g_gpudirect = true;
bool g_fail_register = false;
int g_opens = 0, g_reads = 0, g_reads_with_offset = 0, g_reads_off_registered = 0, g_bad_deregisters = 0;
std::map<const void*, size_t> g_registered;

}  // namespace

FAKE_EXPORT void fake_cufile_reset(int gpudirect, int fail_register) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_gpudirect = gpudirect != 0;
  g_fail_register = fail_register != 0;
  g_opens = g_reads = g_reads_with_offset = g_reads_off_registered = g_bad_deregisters = 0;
  g_registered.clear();
}
FAKE_EXPORT int fake_cufile_opens() { return g_opens; }
FAKE_EXPORT int fake_cufile_reads() { return g_reads; }
FAKE_EXPORT int fake_cufile_reads_with_offset() { return g_reads_with_offset; }
FAKE_EXPORT int fake_cufile_reads_off_registered() { return g_reads_off_registered; }
FAKE_EXPORT int fake_cufile_bad_deregisters() { return g_bad_deregisters; }

FAKE_EXPORT Error cuFileDriverOpen() {
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_opens;
  return {0, 0};
}
FAKE_EXPORT Error cuFileDriverGetProperties(DriverProps* props) {
  *props = DriverProps{};
  if (g_gpudirect) {
    props->nvfs.major_version = 2;
    props->nvfs.minor_version = 17;
    props->nvfs.dstatusflags = 1u << 4;  // NVMe
  }
  props->nvfs.dcontrolflags = 1u << 1;  // compatibility mode allowed
  return {0, 0};
}
FAKE_EXPORT Error cuFileHandleRegister(void** fh, Descr* descr) {
  *fh = reinterpret_cast<void*>(static_cast<intptr_t>(descr->handle.fd) + 1);
  return {0, 0};
}
FAKE_EXPORT void cuFileHandleDeregister(void*) {}
FAKE_EXPORT Error cuFileBufRegister(const void* base, size_t length, int) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_fail_register) return {kPinningFailed, 0};
  g_registered[base] = length;
  return {0, 0};
}
FAKE_EXPORT Error cuFileBufDeregister(const void* base) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_registered.erase(base)) {
    ++g_bad_deregisters;
    return {kInvalidValue, 0};
  }
  return {0, 0};
}
FAKE_EXPORT ssize_t cuFileRead(void* fh, void* base, size_t size, off_t file_offset, off_t base_offset) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_reads;
    if (base_offset != 0) ++g_reads_with_offset;
    auto it = g_registered.find(base);
    if (!g_fail_register && (it == g_registered.end() || static_cast<size_t>(base_offset) + size > it->second))
      ++g_reads_off_registered;
  }
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(fh) - 1);
  // The descriptor may be O_DIRECT: whole blocks, the end of the file stops it.
  const size_t want = (size + 4095) / 4096 * 4096;
  char* dst = static_cast<char*>(base) + base_offset;
  size_t done = 0;
  while (done < want) {
    ssize_t n = ::pread(fd, dst + done, want - done, file_offset + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(done < size ? done : size);
}
