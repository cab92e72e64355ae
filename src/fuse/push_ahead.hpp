// Pushes the bytes ahead of a sequential reader into the kernel's page cache
// (fuse_lowlevel_notify_store) from a thread of its own.
//
// A loader that maps a served file (safetensors load_file, from_pretrained,
// torch.load(mmap=True)) reads it by page faults: each fault that misses the cache waits for
// the kernel's readahead READs, so the loader and the daemon take turns. When READs of a file
// come in order, this thread stores the next `window` bytes into the file's cache while the
// loader works, and the loader's faults find them there.
//
// Bounded: at most `window` bytes ahead of the furthest READ of each file, one chunk in
// flight; stopped for a file when nobody has it open (release) and for good on unmount or
// when a kernel refuses the store. Never stale: bytes come from View::Read, which checks the
// source files like any READ, and Disable() (called by the source watcher before it drops
// cached pages) waits for a store in flight, so no push can land after that invalidation.
#ifndef CKPTFS_FUSE_PUSH_AHEAD_HPP_
#define CKPTFS_FUSE_PUSH_AHEAD_HPP_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fuse/filesystem.hpp"

namespace ckptfs::fuse {

class PushAhead {
 public:
  PushAhead(uint64_t window, uint64_t chunk) : window_(window), chunk_(chunk) {}
  PushAhead(const PushAhead&) = delete;
  PushAhead& operator=(const PushAhead&) = delete;
  ~PushAhead() { Stop(); }

  // Starts the pushing thread. Call after fuse_daemonize (threads do not survive its fork).
  void Start(fuse_session* session, const Filesystem* fs);
  // Stops and joins the thread; work not done is dropped. Call before the session is destroyed.
  void Stop();

  // A READ of [offset, offset + size) of `ino` was answered.
  void OnRead(fuse_ino_t ino, uint64_t offset, uint64_t size);
  // The last open of `ino` was released: nothing more to push for it.
  void Forget(fuse_ino_t ino);
  // A source changed: no more pushes, and none in flight once this returns.
  void Disable();

  // Bytes stored into the kernel so far (for tests through the debug log and benchmarks).
  uint64_t pushed_bytes() const;

 private:
  struct Stream {
    uint64_t end = 0;      // furthest byte any READ of the file reached
    uint64_t pushed = 0;   // bytes before this are cached or claimed by a push
    uint64_t target = 0;   // push up to here
    unsigned in_order = 0; // consecutive READs that continued where the previous ones ended
    bool queued = false;
  };
  void Run();

  const uint64_t window_, chunk_;
  fuse_session* session_ = nullptr;
  const Filesystem* fs_ = nullptr;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::unordered_map<fuse_ino_t, Stream> streams_;
  std::deque<fuse_ino_t> queue_;
  bool stop_ = false, disabled_ = false;
  uint64_t pushed_bytes_ = 0;
  std::mutex store_mutex_;  // held while one chunk is read and stored
  std::thread thread_;
};

}  // namespace ckptfs::fuse

#endif  // CKPTFS_FUSE_PUSH_AHEAD_HPP_
