// Watches the source files of a mount and drops the kernel's cached pages of every
// virtual file as soon as one of them changes.
//
// The mount keeps the page cache (keep_cache) because the tree is immutable. Reads that
// reach the daemon re-check each source file's identity and fail with EIO, but pages
// cached before a change would never reach it: this watcher invalidates them, so the next
// read after a change is answered by the daemon, with EIO.
#ifndef CKPTFS_FUSE_SOURCE_WATCHER_HPP_
#define CKPTFS_FUSE_SOURCE_WATCHER_HPP_

#include <thread>

#include "fuse/filesystem.hpp"

namespace ckptfs::fuse {

class SourceWatcher {
 public:
  SourceWatcher() = default;
  SourceWatcher(const SourceWatcher&) = delete;
  SourceWatcher& operator=(const SourceWatcher&) = delete;
  ~SourceWatcher() { Stop(); }

  // Starts watching (inotify on each source file and its folder). Call after
  // fuse_daemonize: threads do not survive its fork. Returns false if inotify fails,
  // in which case the identity checks on read remain the only protection.
  bool Start(fuse_session* session, const Filesystem* fs);
  void Stop();

 private:
  void Run();
  void InvalidateAll();

  fuse_session* session_ = nullptr;
  const Filesystem* fs_ = nullptr;
  int inotify_fd_ = -1;
  int stop_fd_ = -1;  // eventfd that wakes the thread for shutdown
  std::thread thread_;
};

}  // namespace ckptfs::fuse

#endif  // CKPTFS_FUSE_SOURCE_WATCHER_HPP_
