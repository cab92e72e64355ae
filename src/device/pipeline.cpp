// The device load pipeline: a ring of pinned buffers filled by I/O threads, each followed
// by asynchronous copies to the device and an event, so that buffer k + N is filled only
// after the copies out of buffer k have completed.
//
// Ordering: batch b uses ring slot b % N. The thread that takes batch b waits until the
// slot's turn reaches b / N (the thread of batch b - N has enqueued its copies and recorded
// its event), then waits on that event, fills the slot, enqueues its copies and records the
// event again. On any error (I/O, source change, back end, cancellation) the first status
// is kept, no new batch starts, and every stream is synchronized before any buffer is freed.
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "ckptfs/device.hpp"
#include "device/plan.hpp"
#include "device/source_reader.hpp"

namespace ckptfs {
namespace {

using device::Batch;
using device::BufferRead;
using device::Piece;
using device::Plan;
using device::Route;
using device::SourceReader;

struct Slot {
  void* host = nullptr;   // pinned buffer
  void* stage = nullptr;  // device staging buffer (direct batches)
  bool stage_registered = false;
  DeviceStream stream = nullptr;
  DeviceEvent event = nullptr;
  bool in_flight = false;  // copies enqueued since the last completed wait
  uint64_t turn = 0;       // guarded by Loader::mu_
};

class Loader {
 public:
  Loader(const View& view, DeviceBackend& backend, const DeviceLoadOptions& options,
         const std::vector<DeviceDestination>& dests)
      : view_(view), backend_(backend), options_(options), dests_(dests),
        reader_(*view.source().files, options.direct_io) {}

  ~Loader() { Release(); }

  Status Run(DeviceLoadStats* stats);

 private:
  Status Prepare();
  void Worker();
  Status Fill(size_t batch_index, Slot& slot);
  Status EnqueueCopies(const BufferRead& r, char* base, CopyKind kind, Slot& slot);
  void SetError(const Status& s);
  void Release();

  const View& view_;
  DeviceBackend& backend_;
  const DeviceLoadOptions& options_;
  const std::vector<DeviceDestination>& dests_;
  SourceReader reader_;
  Plan plan_;
  std::vector<Slot> slots_;
  std::vector<DirectFile> direct_files_;  // per source file, or nullptr
  DeviceEvent after_event_ = nullptr;      // recorded on options_.after_stream
  bool released_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  size_t next_batch_ = 0;  // guarded by mu_
  bool failed_ = false;    // guarded by mu_
  Status error_;           // guarded by mu_
  std::mutex cancel_mu_;   // the callback is called from one thread at a time
  std::atomic<bool> stop_{false};  // set with failed_, read without the lock

  std::atomic<uint64_t> bytes_read_{0}, direct_bytes_{0}, view_bytes_{0}, copied_{0}, filled_{0};
};

void Loader::SetError(const Status& s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_) {
    failed_ = true;
    stop_ = true;
    error_ = s;
  }
  cv_.notify_all();
}

Status Loader::Prepare() {
  const Catalog& catalog = view_.source();
  // Which source files the pinned and direct routes read.
  std::vector<bool> stored_file(catalog.files->count(), false);
  for (const DeviceDestination& d : dests_) {
    if (d.index >= view_.served().size()) continue;  // MakePlan reports it
    const ServedTensor t = view_.served()[d.index];
    const TensorEntry* stored = nullptr;
    if (RouteOf(t) != ReadRoute::kExtents || !t.Stored(&stored).ok()) continue;
    for (const Box& box : stored->boxes)
      if (box.file < stored_file.size()) stored_file[box.file] = true;
  }
  direct_files_.assign(catalog.files->count(), nullptr);
  const bool try_direct = options_.use_direct_read && backend_.SupportsDirectRead();
  for (uint32_t f = 0; f < stored_file.size(); ++f) {
    if (!stored_file[f]) continue;
    CKPTFS_RETURN_IF_ERROR(reader_.Open(f));
    if (try_direct && reader_.fd(f) >= 0) {
      DirectFile handle = nullptr;
      // A file the back end cannot read directly (no local path, no O_DIRECT, a file system
      // GDS does not support) takes the pinned route.
      if (backend_.OpenDirect(reader_.fd(f), catalog.files->path(f), &handle).ok()) direct_files_[f] = handle;
    }
  }
  CKPTFS_RETURN_IF_ERROR(device::MakePlan(view_, dests_, options_.buffer_bytes,
                                          [&](uint32_t f) { return direct_files_[f] != nullptr; }, &plan_));

  bool any_direct = false;
  for (const Batch& b : plan_.batches) any_direct |= b.route == Route::kDirect;
  const size_t nslots = std::min<size_t>(std::max(1, options_.buffers), std::max<size_t>(1, plan_.batches.size()));
  slots_.resize(nslots);
  for (Slot& s : slots_) {
    CKPTFS_RETURN_IF_ERROR(backend_.AllocPinned(plan_.buffer_capacity, &s.host));
    if (any_direct) {
      CKPTFS_RETURN_IF_ERROR(backend_.AllocDevice(plan_.buffer_capacity, &s.stage));
      // An unregistered staging buffer still works (cuFile bounces through its own buffers),
      // so a failed registration only means it must not be deregistered.
      s.stage_registered = backend_.RegisterDirectBuffer(s.stage, plan_.buffer_capacity).ok();
    }
    CKPTFS_RETURN_IF_ERROR(backend_.CreateStream(&s.stream));
    CKPTFS_RETURN_IF_ERROR(backend_.CreateEvent(&s.event));
  }
  if (options_.after_stream) {
    // Every copy of the load is enqueued behind what the caller's stream holds now.
    CKPTFS_RETURN_IF_ERROR(backend_.CreateEvent(&after_event_));
    CKPTFS_RETURN_IF_ERROR(backend_.RecordEvent(after_event_, options_.after_stream));
    for (Slot& s : slots_) CKPTFS_RETURN_IF_ERROR(backend_.StreamWaitEvent(s.stream, after_event_));
  }
  return Status::OK();
}

Status Loader::EnqueueCopies(const BufferRead& r, char* base, CopyKind kind, Slot& slot) {
  for (size_t i = r.first_piece; i < r.first_piece + r.piece_count; ++i) {
    const Piece& p = plan_.pieces[i];
    char* dst = static_cast<char*>(dests_[p.dest].device_ptr) + p.dst_offset;
    slot.in_flight = true;  // even a failed enqueue may have started something: drain it
    Status s = backend_.CopyAsync(dst, base + p.buffer_offset, p.length, kind, slot.stream);
    if (!s.ok()) return s;  // the back end's message names the call that failed
    copied_ += p.length;
  }
  return Status::OK();
}

Status Loader::Fill(size_t batch_index, Slot& slot) {
  if (slot.in_flight) {
    CKPTFS_RETURN_IF_ERROR(backend_.WaitEvent(slot.event));
    slot.in_flight = false;
  }
  // Another thread failed or saw the cancellation: start nothing more (its status is kept).
  if (stop_) return Status::FromErrno(view_.source().source, "load stopped", ECANCELED);
  if (options_.cancelled) {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    if (stop_) return Status::FromErrno(view_.source().source, "load stopped", ECANCELED);
    if (options_.cancelled()) {
      stop_ = true;
      return Status::FromErrno(view_.source().source, "load cancelled", ECANCELED);
    }
  }
  const Batch& batch = plan_.batches[batch_index];
  const Catalog& catalog = view_.source();
  for (const BufferRead& r : batch.reads) {
    switch (r.route) {
      case Route::kStored: {
        char* base = static_cast<char*>(slot.host);
        uint64_t n = 0;
        Status s = reader_.Read(r.file, r.offset, r.length, base + r.buffer_offset, &n);
        bytes_read_ += n;
        CKPTFS_RETURN_IF_ERROR(s);
        CKPTFS_RETURN_IF_ERROR(EnqueueCopies(r, base, CopyKind::kHostToDevice, slot));
        break;
      }
      case Route::kView: {
        char* base = static_cast<char*>(slot.host);
        const Piece& p = plan_.pieces[r.first_piece];
        CKPTFS_RETURN_IF_ERROR(view_.ReadTensorData(dests_[p.dest].index, r.offset, r.length, base + r.buffer_offset));
        view_bytes_ += r.length;
        CKPTFS_RETURN_IF_ERROR(EnqueueCopies(r, base, CopyKind::kHostToDevice, slot));
        break;
      }
      case Route::kDirect: {
        char* base = static_cast<char*>(slot.stage);
        const std::string& path = catalog.files->path(r.file);
        CKPTFS_RETURN_IF_ERROR(catalog.files->CheckUnchanged(r.file));
        const uint64_t a0 = device::AlignDown(r.offset);
        const uint64_t a1 = std::min(device::AlignUp(r.offset + r.length), catalog.files->size(r.file));
        CKPTFS_RETURN_IF_ERROR(backend_.ReadDirect(direct_files_[r.file], path, slot.stage, r.buffer_offset, a1 - a0, a0));
        bytes_read_ += a1 - a0;
        uint64_t useful = 0;
        for (size_t i = r.first_piece; i < r.first_piece + r.piece_count; ++i) useful += plan_.pieces[i].length;
        direct_bytes_ += useful;
        CKPTFS_RETURN_IF_ERROR(EnqueueCopies(r, base, CopyKind::kDeviceToDevice, slot));
        break;
      }
    }
  }
  if (slot.in_flight) CKPTFS_RETURN_IF_ERROR(backend_.RecordEvent(slot.event, slot.stream));
  ++filled_;
  return Status::OK();
}

void Loader::Worker() {
  if (Status s = backend_.BindThread(); !s.ok()) return SetError(s);
  const size_t n = slots_.size();
  for (;;) {
    size_t b;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (failed_ || next_batch_ >= plan_.batches.size()) return;
      b = next_batch_++;
      Slot& slot = slots_[b % n];
      cv_.wait(lock, [&] { return failed_ || slot.turn == b / n; });
      if (failed_) return;
    }
    Slot& slot = slots_[b % n];
    Status s = Fill(b, slot);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++slot.turn;
      if (!s.ok() && !failed_) {
        failed_ = true;
        stop_ = true;
        error_ = s;
      }
      cv_.notify_all();
    }
    if (!s.ok()) return;
  }
}

void Loader::Release() {
  if (released_) return;
  released_ = true;
  // Nothing is freed before every copy out of it has completed.
  for (Slot& s : slots_) {
    if (s.stream) (void)backend_.Synchronize(s.stream);
  }
  for (Slot& s : slots_) {
    if (s.event) backend_.DestroyEvent(s.event);
    if (s.stream) backend_.DestroyStream(s.stream);
    if (s.stage) {
      if (s.stage_registered) backend_.DeregisterDirectBuffer(s.stage);
      backend_.FreeDevice(s.stage);
    }
    if (s.host) backend_.FreePinned(s.host);
  }
  slots_.clear();
  if (after_event_) {
    // Still recorded on the caller's stream if the load failed before waiting on it.
    (void)backend_.WaitEvent(after_event_);
    backend_.DestroyEvent(after_event_);
  }
  after_event_ = nullptr;
  for (DirectFile f : direct_files_)
    if (f) backend_.CloseDirect(f);
  direct_files_.clear();
}

Status Loader::Run(DeviceLoadStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  if (options_.buffers < 1) return Status::InvalidArgument("load", "at least one buffer is needed");
  if (options_.buffer_bytes < device::kAlign)
    return Status::InvalidArgument("load", "buffers must hold at least 4 KiB");
  // Release() below runs inside the binding: everything is freed on the load's device.
  ScopedDeviceBinding binding(backend_);
  Status s = binding.status();
  if (s.ok()) s = Prepare();
  if (s.ok()) {
    const size_t nthreads =
        std::min<size_t>(std::max(1, options_.io_threads), std::max<size_t>(1, slots_.size()));
    if (nthreads == 1) {
      Worker();
    } else {
      std::vector<std::thread> threads;
      for (size_t i = 0; i < nthreads; ++i) threads.emplace_back([this] { Worker(); });
      for (auto& t : threads) t.join();
    }
    // Every copy must have landed before the caller may use the destinations.
    for (Slot& slot : slots_) {
      Status sync = backend_.Synchronize(slot.stream);
      if (!sync.ok()) SetError(sync);
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) s = error_;
  }
  Release();
  if (stats) {
    *stats = DeviceLoadStats();
    for (const DeviceDestination& d : dests_) {
      if (d.index < view_.served().size()) ++stats->tensors;
    }
    stats->bytes = copied_;
    stats->bytes_read = bytes_read_;
    stats->direct_bytes = direct_bytes_;
    stats->view_bytes = view_bytes_;
    stats->buffers_filled = filled_;
    stats->used_o_direct = reader_.any_direct();
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return s;
}

}  // namespace

Status LoadIntoDevice(const View& view, DeviceBackend& backend, const DeviceLoadOptions& options,
                      const std::vector<DeviceDestination>& destinations, DeviceLoadStats* stats) {
  Loader loader(view, backend, options, destinations);
  return loader.Run(stats);
}

Status LoadToDevice(const View& view, DeviceBackend& backend, const DeviceLoadOptions& options,
                    std::vector<DeviceTensor>* out, DeviceLoadStats* stats) {
  out->clear();
  std::vector<size_t> indices;
  CKPTFS_RETURN_IF_ERROR(SelectTensors(view, options.select, &indices));
  ScopedDeviceBinding binding(backend);
  CKPTFS_RETURN_IF_ERROR(binding.status());
  std::vector<DeviceTensor> tensors;
  std::vector<DeviceDestination> dests;
  Status s;
  for (size_t i : indices) {
    const ServedTensor t = view.served()[i];
    DeviceTensor dt;
    dt.index = i;
    dt.key = t.key();
    dt.dtype = t.dtype;
    dt.shape = t.shape();
    dt.nbytes = t.nbytes();
    if (dt.nbytes > 0) {
      s = backend.AllocDevice(dt.nbytes, &dt.device_ptr);
      if (!s.ok()) break;
    }
    tensors.push_back(dt);
    dests.push_back({i, dt.device_ptr, dt.nbytes});
  }
  if (s.ok()) s = LoadIntoDevice(view, backend, options, dests, stats);
  if (!s.ok()) {
    FreeDeviceTensors(backend, &tensors);
    return s;
  }
  *out = std::move(tensors);
  return Status::OK();
}

void FreeDeviceTensors(DeviceBackend& backend, std::vector<DeviceTensor>* tensors) {
  for (DeviceTensor& t : *tensors)
    if (t.device_ptr) backend.FreeDevice(t.device_ptr);
  tensors->clear();
}

}  // namespace ckptfs
