// Device loading: streams the tensors of a View into device (GPU) memory.
//
// The pipeline reads source extents into a ring of pinned host buffers (O_DIRECT where the
// file system takes it, 4 KiB-widened, slack trimmed; buffered pread otherwise), while
// earlier buffers are copied to the device asynchronously; a buffer is refilled only after
// the event recorded behind its last copy has completed. Tensors that need a dtype
// conversion or a gather (strided .pt tensors) are read through the View, so the device gets
// exactly the bytes the View serves. With a back end that reads files straight into device
// memory (cuFile / GPUDirect Storage), tensors that need no conversion skip the host.
//
// The pipeline is written against DeviceBackend. Back ends:
//   host    device memory is host heap, copies are done by one worker thread per stream
//           (works everywhere: tests, benchmarks, and loads into CPU tensors);
//   cuda    the CUDA runtime, loaded at run time with dlopen (no build-time dependency);
//   cufile  cuda plus cuFile (GPUDirect Storage) for direct reads.
#ifndef CKPTFS_DEVICE_HPP_
#define CKPTFS_DEVICE_HPP_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/dtype.hpp"
#include "ckptfs/status.hpp"
#include "ckptfs/view.hpp"

namespace ckptfs {

// Opaque back-end handles.
using DeviceStream = void*;
using DeviceEvent = void*;
using DirectFile = void*;

enum class CopyKind : uint8_t { kHostToDevice, kDeviceToDevice };

// What the pipeline needs from a device. All calls may come from several threads; every
// worker thread calls BindThread() first (CUDA's current device is per thread). The caller's
// own thread is bound through ScopedDeviceBinding, which gives its current device back.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual const char* name() const = 0;
  // A line that says which device and library this is (for summaries).
  virtual std::string Describe() const = 0;
  virtual Status BindThread() = 0;
  // For a thread ckptfs does not own (the caller's, whose current device PyTorch shares):
  // BindThread, after saving what RestoreCallerThread needs to undo it.
  virtual Status BindCallerThread(int* saved) {
    *saved = -1;
    return BindThread();
  }
  virtual void RestoreCallerThread(int saved) {}

  virtual Status AllocDevice(size_t bytes, void** ptr) = 0;
  virtual void FreeDevice(void* ptr) = 0;
  // Page-locked host memory, at least 4 KiB aligned (O_DIRECT reads land in it).
  virtual Status AllocPinned(size_t bytes, void** ptr) = 0;
  virtual void FreePinned(void* ptr) = 0;

  virtual Status CreateStream(DeviceStream* stream) = 0;
  virtual void DestroyStream(DeviceStream stream) = 0;
  virtual Status CreateEvent(DeviceEvent* event) = 0;
  virtual void DestroyEvent(DeviceEvent event) = 0;
  // Enqueues a copy on `stream`; `src` must stay untouched until an event recorded after
  // it has completed.
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream stream) = 0;
  virtual Status RecordEvent(DeviceEvent event, DeviceStream stream) = 0;
  // Blocks until everything enqueued before the last RecordEvent(event) has completed.
  virtual Status WaitEvent(DeviceEvent event) = 0;
  // Work enqueued on `stream` from now on starts after the last RecordEvent(event) completed
  // (the host does not wait).
  virtual Status StreamWaitEvent(DeviceStream stream, DeviceEvent event) = 0;
  virtual Status Synchronize(DeviceStream stream) = 0;
  // Synchronous device -> host copy (verification).
  virtual Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;

  // Direct file -> device reads (cuFile). Back ends without them return false.
  virtual bool SupportsDirectRead() const { return false; }
  // `fd` is open with O_DIRECT; the handle stays valid until CloseDirect.
  virtual Status OpenDirect(int fd, const std::string& path, DirectFile* file) {
    return Status::NotSupported(path, "direct reads are not supported by this back end");
  }
  virtual void CloseDirect(DirectFile file) {}
  // Registers a device buffer that direct reads go to (a speed-up: reads into an
  // unregistered buffer still work). Deregister only what registered successfully.
  virtual Status RegisterDirectBuffer(void* device_ptr, size_t bytes) { return Status::OK(); }
  virtual void DeregisterDirectBuffer(void* device_ptr) {}
  // Reads `bytes` at `file_offset` into `buffer_base` + `buffer_offset` (synchronous).
  // `buffer_base` is the pointer given to RegisterDirectBuffer (cuFile wants the registered
  // base and the offset apart). Offsets and sizes are 4 KiB aligned except where the read
  // reaches the end of the file.
  virtual Status ReadDirect(DirectFile file, const std::string& path, void* buffer_base, uint64_t buffer_offset,
                            size_t bytes, uint64_t file_offset) {
    return Status::NotSupported(path, "direct reads are not supported by this back end");
  }
};

struct HostBackendOptions {
  // Test hooks: each copy sleeps this long in the worker (so a pipeline that reuses a
  // buffer before its copy completed gets caught), and the Nth CopyAsync (1-based) fails.
  unsigned copy_delay_us = 0;
  uint64_t fail_copy_at = 0;
  // Serve SupportsDirectRead() with pread into "device" memory: exercises the direct path's
  // planning (alignment, staging, trimming) without cuFile.
  bool emulate_direct = false;
};

// Counters a HostBackend keeps, for tests.
struct HostBackendStats {
  uint64_t live_device_allocs = 0, live_pinned_allocs = 0, live_streams = 0, live_events = 0;
  uint64_t copies = 0, direct_reads = 0;
  // Pinned buffers freed while a copy from them was queued or running.
  uint64_t freed_while_in_flight = 0;
  // Direct reads whose buffer base was not a registered buffer.
  uint64_t unregistered_direct_reads = 0;
};

// Binds the calling thread to the back end's device for the lifetime of this object, then
// makes the thread's previous device current again, on every path.
class ScopedDeviceBinding {
 public:
  explicit ScopedDeviceBinding(DeviceBackend& backend) : backend_(backend) {
    status_ = backend_.BindCallerThread(&saved_);
  }
  ~ScopedDeviceBinding() { backend_.RestoreCallerThread(saved_); }
  ScopedDeviceBinding(const ScopedDeviceBinding&) = delete;
  ScopedDeviceBinding& operator=(const ScopedDeviceBinding&) = delete;
  const Status& status() const { return status_; }

 private:
  DeviceBackend& backend_;
  int saved_ = -1;
  Status status_;
};

std::unique_ptr<DeviceBackend> MakeHostBackend(const HostBackendOptions& options = {});
HostBackendStats GetHostBackendStats(const DeviceBackend& host_backend);

// Opens the CUDA runtime (and cuFile with `with_cufile`) for device `device`. Fails with a
// kNotSupported status whose message starts "no CUDA device:" when there is no usable GPU
// (library missing, no driver, no device), "no cuFile:" when cuFile is asked for and missing.
// The calling thread's current device is left as it was.
Status OpenCudaBackend(int device, bool with_cufile, std::unique_ptr<DeviceBackend>* out);

// "host", "cuda", "cufile", or "auto" (cufile where its driver reports GPUDirect, else cuda,
// else the CUDA error; never host).
Status OpenBackend(const std::string& name, int device, std::unique_ptr<DeviceBackend>* out);

struct DeviceLoadOptions {
  // Keys or shell globs (fnmatch) of the tensors to load; empty: all. A pattern that
  // matches nothing is an error.
  std::vector<std::string> select;
  size_t buffer_bytes = size_t{16} << 20;  // each ring buffer (a multiple of 4 KiB)
  int buffers = 4;                         // ring size
  int io_threads = 2;                      // threads filling ring buffers
  bool direct_io = true;                   // O_DIRECT source reads (fallback to buffered)
  bool use_direct_read = true;             // cuFile reads when the back end has them
  // The caller's stream (PyTorch's current stream): what is enqueued on it before the load
  // starts completes before the load writes a destination (its memory may come from a
  // caching allocator that still has kernels queued on it). nullptr: no ordering.
  DeviceStream after_stream = nullptr;
  // Checked before each buffer is filled; true aborts the load (status ECANCELED).
  std::function<bool()> cancelled;
};

struct DeviceTensor {
  size_t index = 0;  // in view.served()
  std::string key;
  DType dtype = DType::kF32;  // as served
  std::vector<uint64_t> shape;  // as the catalog has it (complex types: before the real view)
  void* device_ptr = nullptr;
  uint64_t nbytes = 0;  // served bytes
};

struct DeviceLoadStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;           // served bytes written to the device
  uint64_t bytes_read = 0;      // read from source files (with alignment slack and gaps)
  uint64_t direct_bytes = 0;    // of `bytes`, read file -> device (cuFile)
  uint64_t view_bytes = 0;      // of `bytes`, through the View (conversion, gather)
  uint64_t buffers_filled = 0;
  bool used_o_direct = false;
  double seconds = 0;
  // Of a load into private maps (LoadMapped, include/ckptfs/tensor_map.hpp): tensor bytes
  // that are pages of source files, and the maps made.
  uint64_t mapped_bytes = 0;
  uint64_t maps = 0;

  double gb_per_s() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0; }
};

// The back-end name of loads into private maps (LoadMapped), in their statistics.
inline constexpr char kMapLoadBackend[] = "map";

// One load's statistics as a JSON object, the one form `ckptfs load --json` prints and
// ckptfs_last_load_stats returns: backend, device (the back end's Describe()), tensors, bytes,
// bytes_read, direct_bytes, view_bytes, buffers_filled, o_direct, seconds, gb_per_s,
// verified; a load into private maps (backend kMapLoadBackend) adds mapped_bytes and maps.
std::string LoadStatsJson(const DeviceLoadStats& stats, std::string_view backend, std::string_view device,
                          bool verified);

// The tensors of `view` that `select` picks, in catalog order (an error names a pattern
// that matched nothing).
Status SelectTensors(const View& view, const std::vector<std::string>& select, std::vector<size_t>* indices);

// One destination: tensor `index` goes to `device_ptr`, which holds `nbytes` (must equal
// the tensor's served bytes).
struct DeviceDestination {
  size_t index = 0;
  void* device_ptr = nullptr;
  uint64_t nbytes = 0;
};

// Streams the destinations' tensors into caller-provided device memory. On error (I/O,
// source changed, back-end failure, cancellation) every copy in flight is drained before
// returning; the destinations then hold partial data.
Status LoadIntoDevice(const View& view, DeviceBackend& backend, const DeviceLoadOptions& options,
                      const std::vector<DeviceDestination>& destinations, DeviceLoadStats* stats = nullptr);

// Allocates device memory for each selected tensor (backend.AllocDevice) and loads it.
// On success the caller owns the pointers (FreeDeviceTensors); on error nothing is left
// allocated.
Status LoadToDevice(const View& view, DeviceBackend& backend, const DeviceLoadOptions& options,
                    std::vector<DeviceTensor>* out, DeviceLoadStats* stats = nullptr);
void FreeDeviceTensors(DeviceBackend& backend, std::vector<DeviceTensor>* tensors);

// Compares each tensor's device bytes (copied back) with the View's bytes.
Status VerifyDeviceTensors(const View& view, DeviceBackend& backend, const std::vector<DeviceTensor>& tensors);

}  // namespace ckptfs

#endif  // CKPTFS_DEVICE_HPP_
