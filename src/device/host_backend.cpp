// The host back end: "device" memory is host heap and each stream is a worker thread that
// performs the copies in order, so asynchronous semantics (a buffer reused before its copy
// ran, a missing wait) show up as wrong bytes in tests, as they would on a GPU.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "ckptfs/device.hpp"
#include "device/plan.hpp"
#include "io/full_pread.hpp"
#include "io/source_changed.hpp"

namespace ckptfs {
namespace {

struct HostEvent {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, done = 0;
};

struct Op {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
  HostEvent* event = nullptr;  // a signal instead of a copy
  uint64_t generation = 0;
  HostEvent* wait_for = nullptr;  // a wait for `generation` of this event instead of a copy
};

class HostBackend;

struct HostStream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  bool busy = false;  // an op taken from the queue is running
  const void* running_src = nullptr;
  bool stop = false;
  std::thread worker;
};

class HostBackend final : public DeviceBackend {
 public:
  explicit HostBackend(const HostBackendOptions& options) : options_(options) {}
  ~HostBackend() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (HostStream* s : streams_) StopStream(s);
  }

  const char* name() const override { return "host"; }
  std::string Describe() const override { return "host memory (no GPU; copies by worker threads)"; }
  Status BindThread() override { return Status::OK(); }

  Status AllocDevice(size_t bytes, void** ptr) override {
    *ptr = std::aligned_alloc(device::kAlign, device::AlignUp(std::max<size_t>(bytes, 1)));
    if (!*ptr) return Status::FromErrno("host backend", "cannot allocate " + std::to_string(bytes) + " bytes", ENOMEM);
    ++stats_.live_device_allocs;
    return Status::OK();
  }
  void FreeDevice(void* ptr) override {
    if (!ptr) return;
    --stats_.live_device_allocs;
    std::free(ptr);
  }
  Status AllocPinned(size_t bytes, void** ptr) override {
    const size_t size = device::AlignUp(std::max<size_t>(bytes, 1));
    *ptr = std::aligned_alloc(device::kAlign, size);
    if (!*ptr) return Status::FromErrno("host backend", "cannot allocate " + std::to_string(bytes) + " bytes", ENOMEM);
    std::lock_guard<std::mutex> lock(mu_);
    pinned_[*ptr] = size;
    ++stats_.live_pinned_allocs;
    return Status::OK();
  }
  void FreePinned(void* ptr) override {
    if (!ptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t size = pinned_[ptr];
      pinned_.erase(ptr);
      const char* lo = static_cast<const char*>(ptr);
      auto inside = [&](const void* p) {
        return p && static_cast<const char*>(p) >= lo && static_cast<const char*>(p) < lo + size;
      };
      for (HostStream* s : streams_) {
        std::lock_guard<std::mutex> slock(s->mu);
        bool hit = s->busy && inside(s->running_src);
        for (const Op& op : s->queue) hit |= !op.event && !op.wait_for && inside(op.src);
        if (hit) ++stats_.freed_while_in_flight;
      }
      --stats_.live_pinned_allocs;
    }
    std::free(ptr);
  }

  Status CreateStream(DeviceStream* stream) override {
    auto* s = new HostStream;
    s->worker = std::thread([this, s] { Run(s); });
    std::lock_guard<std::mutex> lock(mu_);
    streams_.push_back(s);
    ++stats_.live_streams;
    *stream = s;
    return Status::OK();
  }
  void DestroyStream(DeviceStream stream) override {
    auto* s = static_cast<HostStream*>(stream);
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < streams_.size(); ++i)
      if (streams_[i] == s) streams_.erase(streams_.begin() + static_cast<long>(i));
    StopStream(s);
    --stats_.live_streams;
  }
  Status CreateEvent(DeviceEvent* event) override {
    *event = new HostEvent;
    ++stats_.live_events;
    return Status::OK();
  }
  void DestroyEvent(DeviceEvent event) override {
    delete static_cast<HostEvent*>(event);
    --stats_.live_events;
  }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream stream) override {
    const uint64_t n = ++copy_calls_;
    if (options_.fail_copy_at != 0 && n == options_.fail_copy_at)
      return Status::FromErrno("host backend", "injected copy failure", EIO);
    Push(static_cast<HostStream*>(stream), Op{dst, src, bytes, nullptr, 0, nullptr});
    return Status::OK();
  }
  Status RecordEvent(DeviceEvent event, DeviceStream stream) override {
    auto* e = static_cast<HostEvent*>(event);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(e->mu);
      gen = ++e->recorded;
    }
    Push(static_cast<HostStream*>(stream), Op{nullptr, nullptr, 0, e, gen, nullptr});
    return Status::OK();
  }
  Status WaitEvent(DeviceEvent event) override {
    auto* e = static_cast<HostEvent*>(event);
    std::unique_lock<std::mutex> lock(e->mu);
    const uint64_t want = e->recorded;
    e->cv.wait(lock, [&] { return e->done >= want; });
    return Status::OK();
  }
  Status StreamWaitEvent(DeviceStream stream, DeviceEvent event) override {
    auto* e = static_cast<HostEvent*>(event);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(e->mu);
      gen = e->recorded;
    }
    Op op;
    op.wait_for = e;
    op.generation = gen;
    Push(static_cast<HostStream*>(stream), op);
    return Status::OK();
  }
  Status Synchronize(DeviceStream stream) override {
    auto* s = static_cast<HostStream*>(stream);
    std::unique_lock<std::mutex> lock(s->mu);
    s->cv.wait(lock, [&] { return s->queue.empty() && !s->busy; });
    return Status::OK();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::OK();
  }

  bool SupportsDirectRead() const override { return options_.emulate_direct; }
  Status OpenDirect(int fd, const std::string& path, DirectFile* file) override {
    if (!options_.emulate_direct) return DeviceBackend::OpenDirect(fd, path, file);
    *file = reinterpret_cast<DirectFile>(static_cast<intptr_t>(fd) + 1);
    return Status::OK();
  }
  Status RegisterDirectBuffer(void* device_ptr, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    registered_.insert(device_ptr);
    return Status::OK();
  }
  void DeregisterDirectBuffer(void* device_ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    registered_.erase(device_ptr);
  }
  Status ReadDirect(DirectFile file, const std::string& path, void* buffer_base, uint64_t buffer_offset, size_t bytes,
                    uint64_t file_offset) override {
    {
      // As cuFile wants it: the registered base, and the offset into it apart.
      std::lock_guard<std::mutex> lock(mu_);
      if (!registered_.count(buffer_base)) ++stats_.unregistered_direct_reads;
    }
    void* device_ptr = static_cast<char*>(buffer_base) + buffer_offset;
    const int fd = static_cast<int>(reinterpret_cast<intptr_t>(file) - 1);
    if (file_offset % device::kAlign != 0) return Status::InvalidArgument(path, "unaligned direct read");
    // O_DIRECT descriptors want whole blocks: read them, the end of the file stops it.
    const size_t want = device::AlignUp(bytes);
    size_t done = 0;
    if (Status s = PreadFull(fd, device_ptr, want, file_offset, path, &done); !s.ok())
      return Status::FromErrno(path, "direct read failed", s.sys_errno());
    if (done < bytes) return ShorterThanIndexed(path);
    ++stats_.direct_reads;
    return Status::OK();
  }

  HostBackendStats stats() const {
    HostBackendStats s;
    s.live_device_allocs = stats_.live_device_allocs;
    s.live_pinned_allocs = stats_.live_pinned_allocs;
    s.live_streams = stats_.live_streams;
    s.live_events = stats_.live_events;
    s.copies = stats_.copies;
    s.direct_reads = stats_.direct_reads;
    s.freed_while_in_flight = stats_.freed_while_in_flight;
    s.unregistered_direct_reads = stats_.unregistered_direct_reads;
    return s;
  }

 private:
  struct AtomicStats {
    std::atomic<uint64_t> live_device_allocs{0}, live_pinned_allocs{0}, live_streams{0}, live_events{0};
    std::atomic<uint64_t> copies{0}, direct_reads{0}, freed_while_in_flight{0}, unregistered_direct_reads{0};
  };

  void Push(HostStream* s, Op op) {
    std::lock_guard<std::mutex> lock(s->mu);
    s->queue.push_back(op);
    s->cv.notify_all();
  }

  void Run(HostStream* s) {
    std::unique_lock<std::mutex> lock(s->mu);
    for (;;) {
      s->cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      if (s->queue.empty()) return;  // stop, and nothing left
      Op op = s->queue.front();
      s->queue.pop_front();
      s->busy = true;
      s->running_src = op.src;
      lock.unlock();
      if (op.wait_for) {
        std::unique_lock<std::mutex> elock(op.wait_for->mu);
        op.wait_for->cv.wait(elock, [&] { return op.wait_for->done >= op.generation; });
      } else if (op.event) {
        std::lock_guard<std::mutex> elock(op.event->mu);
        op.event->done = std::max(op.event->done, op.generation);
        op.event->cv.notify_all();
      } else {
        if (options_.copy_delay_us) std::this_thread::sleep_for(std::chrono::microseconds(options_.copy_delay_us));
        std::memcpy(op.dst, op.src, op.bytes);
        ++stats_.copies;
      }
      lock.lock();
      s->busy = false;
      s->running_src = nullptr;
      s->cv.notify_all();
    }
  }

  // Called with mu_ held: drains the stream's queue, ends its worker, frees it.
  void StopStream(HostStream* s) {
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->stop = true;
      s->cv.notify_all();
    }
    s->worker.join();
    delete s;
  }

  HostBackendOptions options_;
  std::mutex mu_;
  std::vector<HostStream*> streams_;
  std::map<void*, size_t> pinned_;
  std::set<void*> registered_;  // direct buffers
  std::atomic<uint64_t> copy_calls_{0};
  AtomicStats stats_;
};

}  // namespace

std::unique_ptr<DeviceBackend> MakeHostBackend(const HostBackendOptions& options) {
  return std::make_unique<HostBackend>(options);
}

HostBackendStats GetHostBackendStats(const DeviceBackend& backend) {
  return dynamic_cast<const HostBackend&>(backend).stats();
}

}  // namespace ckptfs
