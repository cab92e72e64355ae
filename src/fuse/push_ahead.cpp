#include "fuse/push_ahead.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ckptfs::fuse {
namespace {

// READs in order before pushing starts: one READ at the frontier may be chance (a random
// reader), two in a row are a sequential reader.
constexpr unsigned kInOrderBeforePushing = 2;

}  // namespace

void PushAhead::Start(fuse_session* session, const Filesystem* fs) {
  session_ = session;
  fs_ = fs;
  thread_ = std::thread([this] { Run(); });
}

void PushAhead::Stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    queue_.clear();
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PushAhead::OnRead(fuse_ino_t ino, uint64_t offset, uint64_t size) {
  if (size == 0) return;
  const uint64_t file_size = fs_->view->node(NodeOf(ino)).size;
  std::lock_guard<std::mutex> lock(mutex_);
  if (disabled_ || stop_) return;
  Stream& s = streams_[ino];
  // In order: the READ reaches past the furthest byte read so far without skipping past
  // what is already read or pushed (mmap read-around windows may start a little behind).
  const bool in_order = offset <= std::max(s.end, s.pushed) && offset + size > s.end;
  s.end = std::max(s.end, offset + size);
  if (!in_order) {
    s.in_order = 0;
    s.target = s.pushed;  // a jump: stop pushing until the reader is sequential again
    return;
  }
  if (++s.in_order < kInOrderBeforePushing) return;
  s.pushed = std::max(s.pushed, s.end);
  s.target = std::min(file_size, s.end + window_);
  if (s.pushed < s.target && !s.queued) {
    s.queued = true;
    queue_.push_back(ino);
    wake_.notify_one();
  }
}

void PushAhead::Forget(fuse_ino_t ino) {
  std::lock_guard<std::mutex> lock(mutex_);
  streams_.erase(ino);
  queue_.erase(std::remove(queue_.begin(), queue_.end(), ino), queue_.end());
}

void PushAhead::Disable() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    disabled_ = true;
    queue_.clear();
  }
  // A push that checked the flag before it was set finishes its store before this returns.
  std::lock_guard<std::mutex> store(store_mutex_);
}

uint64_t PushAhead::pushed_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pushed_bytes_;
}

void PushAhead::Run() {
  std::vector<char> buf(chunk_);
  for (;;) {
    fuse_ino_t ino = 0;
    uint64_t start = 0, length = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      ino = queue_.front();
      queue_.pop_front();
      auto it = streams_.find(ino);
      if (it == streams_.end()) continue;
      Stream& s = it->second;
      if (s.pushed >= s.target) {
        s.queued = false;
        continue;
      }
      start = s.pushed;
      length = std::min(chunk_, s.target - start);
      s.pushed += length;  // claimed: READs that come meanwhile see it as pushed
      if (s.pushed < s.target) queue_.push_back(ino);  // files take turns, a chunk each
      else s.queued = false;
    }
    std::lock_guard<std::mutex> store(store_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (disabled_ || stop_) continue;
    }
    size_t n = 0;
    // Failures (a changed source) are the READ path's to report: a push is only a hint.
    if (!fs_->view->Read(NodeOf(ino), start, length, buf.data(), &n).ok() || n == 0) continue;
    fuse_bufvec data = FUSE_BUFVEC_INIT(n);
    data.buf[0].mem = buf.data();
    const int rc = fuse_lowlevel_notify_store(session_, ino, static_cast<off_t>(start), &data,
                                              static_cast<fuse_buf_copy_flags>(0));
    std::lock_guard<std::mutex> lock(mutex_);
    if (rc == 0) {
      pushed_bytes_ += n;
    } else if (rc != -ENOENT) {  // ENOENT: the kernel no longer has the inode; nothing to fill
      // The kernel refuses stores (or the connection is gone): readers fall back to READ
      // requests, which never depended on pushes.
      if (!disabled_ && !stop_)
        fuse_log(FUSE_LOG_WARNING, "ckptfs: the kernel refused pushed data (%s); reading on request only\n",
                 std::strerror(-rc));
      disabled_ = true;
      queue_.clear();
    }
  }
}

}  // namespace ckptfs::fuse
