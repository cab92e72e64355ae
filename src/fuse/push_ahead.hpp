// Pushes the bytes just ahead of a reader into the kernel's page cache
// (fuse_lowlevel_notify_store) from a thread of its own.
//
// A loader that maps a served file (safetensors load_file, from_pretrained,
// torch.load(mmap=True)) reads it by page faults. Each fault that misses the cache allocates
// the readahead window's pages in the loader's own context and waits for the READ that fills
// them: the loader and the daemon take turns, and on a 2-core machine one core idles. This
// thread stores the bytes that follow each READ while the loader works on the current ones,
// so the loader's next faults find them cached and the page allocation happens here.
//
// Readers are followed as streams: a READ that lands inside a stream's range moves it on; one
// that lands elsewhere starts a new stream (a few per file, the least recently read one
// replaced), since a loader walks tensors in its own order and may fault at two places at once
// (torch's parallel ops split a tensor). A stream pushes nothing until a second READ continues
// it, then twice as far with each READ up to the window, and never the bytes just after a
// READ, which the kernel's own readahead asks for next. Small READs (a random reader's) do
// not count. Bytes already read or pushed while the file is open are not pushed (again), and a
// chunk is trimmed to what no READ asked for while it was being read from the source.
//
// Bounded: at most `window` bytes past the furthest READ of each stream, one chunk in flight;
// a file's state goes with its last release, everything with Stop() at unmount, and pushing
// stops for good when the kernel refuses a store (READs never depended on pushes). Never
// stale: bytes come from View::Read, which checks the source files like any READ, and
// Disable() (called by the source watcher before it drops cached pages) waits for a store in
// flight, so no push lands after that invalidation.
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
  // `window`: bytes pushed past a stream's furthest READ (0: off); `chunk`: bytes per store;
  // `gap`: bytes after a READ left to the kernel's own readahead. `provoke_refusal` (tests
  // only) sends every store malformed (StoreMalformed), so that the kernel's refusal, and the
  // fallback to READs, can be tested on a kernel that accepts stores.
  PushAhead(uint64_t window, uint64_t chunk, uint64_t gap, bool provoke_refusal = false)
      : window_(window), chunk_(chunk), gap_(gap), provoke_refusal_(provoke_refusal) {}
  PushAhead(const PushAhead&) = delete;
  PushAhead& operator=(const PushAhead&) = delete;
  ~PushAhead() { Stop(); }

  uint64_t window() const { return window_; }

  // Starts the pushing thread. Call after fuse_daemonize (threads do not survive its fork).
  void Start(fuse_session* session, const Filesystem* fs);
  // Stops and joins the thread; work not done is dropped. Call before the session is destroyed.
  void Stop();

  // `ino` was opened / its open was released (the state goes with the last release).
  void OnOpen(fuse_ino_t ino);
  void OnRelease(fuse_ino_t ino);
  // A READ of [offset, offset + size) of `ino` came (call before answering it).
  void OnRead(fuse_ino_t ino, uint64_t offset, uint64_t size);
  // A source changed: no more pushes, and none in flight once this returns.
  void Disable();

  struct Counters {
    uint64_t pushed_bytes = 0;  // stored into the kernel
    uint64_t stores = 0;
    bool refused = false;       // the kernel refused a store; pushing is off
  };
  Counters counters() const;

 private:
  // Served-ranges are kept per block of this many bytes.
  static constexpr uint64_t kBlock = 128 * 1024;
  static constexpr int kStreamsPerFile = 4;
  // READs smaller than this come from random readers (see OnRead).
  static constexpr uint64_t kMinStreamRead = 128 * 1024;
  struct Stream {
    uint64_t begin = 0;   // first byte a READ of this stream asked for
    uint64_t reader = 0;  // furthest byte a READ of this stream reached
    uint64_t next = 0;    // next byte to push
    uint64_t target = 0;  // push up to here
    uint64_t used = 0;    // last use, for replacement
    unsigned confirmations = 0;  // READs of the stream after the one that started it
  };
  struct File {
    unsigned opens = 0;
    uint64_t size = 0;
    std::vector<uint64_t> served;  // bit per block: read or pushed (or claimed) while open
    std::vector<uint64_t> read;    // bit per block: asked for by a READ
    std::vector<Stream> streams;
    bool queued = false;
  };
  static bool Bit(const std::vector<uint64_t>& bits, uint64_t block) { return (bits[block / 64] >> (block % 64)) & 1; }
  bool Served(const File& f, uint64_t block) const { return Bit(f.served, block); }
  // Sets the bits of [begin, end) in `bits`: blocks wholly inside, or every block it touches.
  static void Mark(std::vector<uint64_t>& bits, uint64_t size, uint64_t begin, uint64_t end, bool whole_blocks_only);
  // The part of a claimed [*start, *start + *length) still worth storing: what follows the
  // last block a READ asked for meanwhile (a pusher that fell behind its reader).
  bool Unread(fuse_ino_t ino, uint64_t* start, uint64_t* length) const;
  // The next range of `f` to push, claimed (marked served); false when nothing is left.
  bool Claim(File& f, uint64_t* start, uint64_t* length);
  void Run();
  int StoreMalformed(fuse_ino_t ino, uint64_t offset, const char* data, size_t n);

  const uint64_t window_, chunk_, gap_;
  const bool provoke_refusal_;
  fuse_session* session_ = nullptr;
  const Filesystem* fs_ = nullptr;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::unordered_map<fuse_ino_t, File> files_;
  std::deque<fuse_ino_t> queue_;
  uint64_t clock_ = 0;
  bool stop_ = false, disabled_ = false;
  Counters counters_;
  std::mutex store_mutex_;  // held while one chunk is read and stored
  std::thread thread_;
};

}  // namespace ckptfs::fuse

#endif  // CKPTFS_FUSE_PUSH_AHEAD_HPP_
