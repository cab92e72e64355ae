#include "fuse/push_ahead.hpp"

#include <linux/fuse.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ckptfs::fuse {

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

void PushAhead::OnOpen(fuse_ino_t ino) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++files_[ino].opens;
}

void PushAhead::OnRelease(fuse_ino_t ino) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = files_.find(ino);
  if (it == files_.end()) return;
  if (it->second.opens > 1) return (void)--it->second.opens;
  files_.erase(it);
  queue_.erase(std::remove(queue_.begin(), queue_.end(), ino), queue_.end());
}

void PushAhead::Mark(std::vector<uint64_t>& bits, uint64_t size, uint64_t begin, uint64_t end,
                     bool whole_blocks_only) {
  uint64_t first = begin / kBlock, last = (end + kBlock - 1) / kBlock;  // [first, last)
  if (whole_blocks_only) {
    if (begin % kBlock) ++first;
    if (end % kBlock && end != size) --last;
  }
  for (uint64_t b = first; b < last; ++b) bits[b / 64] |= uint64_t{1} << (b % 64);
}

bool PushAhead::Unread(fuse_ino_t ino, uint64_t* start, uint64_t* length) const {
  auto it = files_.find(ino);
  if (it == files_.end()) return false;
  const File& f = it->second;
  // The pusher claims a chunk, then reads it without the lock: meanwhile the file can be
  // released and opened again, and its new state has no bits until its first READ.
  if (f.read.empty()) return false;
  const uint64_t end = *start + *length;
  uint64_t from = end;
  while (from > *start && !Bit(f.read, (from - 1) / kBlock)) from = std::max(*start, ((from - 1) / kBlock) * kBlock);
  *length = end - from;
  *start = from;
  return *length > 0;
}

void PushAhead::OnRead(fuse_ino_t ino, uint64_t offset, uint64_t size) {
  const uint64_t file_size = fs_->view->SizeOf(NodeOf(ino));
  if (size == 0 || offset >= file_size) return;
  const uint64_t end = std::min(file_size, offset + size);
  std::lock_guard<std::mutex> lock(mutex_);
  if (disabled_ || stop_) return;
  File& f = files_[ino];
  if (f.served.empty()) {
    f.size = file_size;
    f.served.assign((file_size / kBlock + 1 + 63) / 64, 0);
    f.read = f.served;
  }
  Mark(f.served, f.size, offset, end, true);
  Mark(f.read, f.size, offset, end, false);
  // A small READ comes from a reader whose readahead is off or at its smallest, i.e. a random
  // one (FADV_RANDOM, MADV_RANDOM, scattered faults): it neither starts nor moves a stream.
  if (end - offset < kMinStreamRead) return;
  Stream* s = nullptr;
  // In a stream: at or behind where it pushes next (a chunk of slack: READs and pushes
  // interleave) and not before where it began.
  for (Stream& c : f.streams)
    if (offset + chunk_ >= c.begin && offset <= c.next + chunk_) s = &c;
  if (s) {
    s->reader = std::max(s->reader, end);
    // A reader that caught up with the push front: the kernel's own readahead already asks
    // for the next window, so pushing there would copy those bytes twice; push past it.
    if (end + chunk_ >= s->next) s->next = std::max(s->next, end + gap_);
    // The window grows fourfold with each READ of the stream, from 8 chunks after the second,
    // so a reader that only happened to land near another READ gets little pushed.
    s->confirmations = std::min(s->confirmations + 1, 10u);
    const uint64_t ahead = std::min(window_, chunk_ << (2 * s->confirmations + 1));
    s->target = std::min(file_size, std::max(s->target, s->reader + ahead));
  } else {
    if (f.streams.size() < kStreamsPerFile) {
      s = &f.streams.emplace_back();
    } else {
      s = &*std::min_element(f.streams.begin(), f.streams.end(),
                             [](const Stream& a, const Stream& b) { return a.used < b.used; });
      *s = Stream{};
    }
    // Nothing pushed yet: one READ does not make a sequential reader.
    s->begin = offset;
    s->reader = end;
    s->next = s->target = std::min(file_size, end + gap_);
  }
  s->used = ++clock_;
  if (s->next < s->target && !f.queued) {
    f.queued = true;
    queue_.push_back(ino);
    wake_.notify_one();
  }
}

bool PushAhead::Claim(File& f, uint64_t* start, uint64_t* length) {
  for (;;) {
    // The stream whose reader is closest to the bytes pushed for it needs them first.
    Stream* s = nullptr;
    for (Stream& c : f.streams)
      if (c.next < c.target && (!s || c.next - c.reader < s->next - s->reader)) s = &c;
    if (!s) return false;
    while (s->next < s->target && Served(f, s->next / kBlock)) s->next = (s->next / kBlock + 1) * kBlock;
    if (s->next >= s->target) continue;
    uint64_t stop = s->next;
    const uint64_t limit = std::min({s->target, f.size, s->next + chunk_});
    while (stop < limit && !Served(f, stop / kBlock)) stop = std::min(limit, (stop / kBlock + 1) * kBlock);
    *start = s->next;
    *length = stop - s->next;
    Mark(f.served, f.size, s->next, stop, false);
    s->next = stop;
    return true;
  }
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

PushAhead::Counters PushAhead::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

int PushAhead::StoreMalformed(fuse_ino_t ino, uint64_t offset, const char* data, size_t n) {
  // A store whose declared size is one byte more than it carries: the kernel checks the two
  // and answers EINVAL before it looks at the inode or its cache.
  fuse_notify_store_out store{};
  store.nodeid = ino;
  store.offset = offset;
  store.size = static_cast<uint32_t>(n + 1);
  fuse_out_header header{};
  header.len = static_cast<uint32_t>(sizeof header + sizeof store + n);
  header.error = FUSE_NOTIFY_STORE;
  iovec iov[3] = {{&header, sizeof header}, {&store, sizeof store}, {const_cast<char*>(data), n}};
  return ::writev(fuse_session_fd(session_), iov, 3) < 0 ? -errno : 0;
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
      auto it = files_.find(ino);
      if (it == files_.end()) continue;
      File& f = it->second;
      if (!Claim(f, &start, &length)) {
        f.queued = false;
        continue;
      }
      queue_.push_back(ino);  // files take turns, a chunk each; dropped once nothing is left
    }
    std::lock_guard<std::mutex> store(store_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (disabled_ || stop_ || !Unread(ino, &start, &length)) continue;
    }
    size_t n = 0;
    // Failures (a changed source) are the READ path's to report: a push is only a hint.
    if (!fs_->view->Read(NodeOf(ino), start, length, buf.data(), &n).ok() || n == 0) continue;
    {
      // A READ that came while this chunk was read needs no second copy of its bytes.
      std::lock_guard<std::mutex> lock(mutex_);
      uint64_t from = start, left = n;
      if (!Unread(ino, &from, &left)) continue;
      std::memmove(buf.data(), buf.data() + (from - start), left);
      start = from;
      n = left;
    }
    fuse_bufvec data = FUSE_BUFVEC_INIT(n);
    data.buf[0].mem = buf.data();
    const int rc = provoke_refusal_ ? StoreMalformed(ino, start, buf.data(), n)
                                    : fuse_lowlevel_notify_store(session_, ino, static_cast<off_t>(start), &data,
                                                                 static_cast<fuse_buf_copy_flags>(0));
    std::lock_guard<std::mutex> lock(mutex_);
    if (rc == 0) {
      counters_.pushed_bytes += n;
      ++counters_.stores;
    } else if (rc == -ENOENT) {
      // The kernel no longer has the inode (evicted after its last close): nothing to fill.
    } else if (rc == -ENODEV || rc == -ENOTCONN || rc == -EBADF) {
      disabled_ = true;  // the connection is gone: the mount is going away
      queue_.clear();
    } else {
      if (!disabled_ && !stop_)
        fuse_log(FUSE_LOG_WARNING, "ckptfs: the kernel refused pushed data (%s); reading on request only\n",
                 std::strerror(-rc));
      counters_.refused = true;
      disabled_ = true;
      queue_.clear();
    }
  }
}

}  // namespace ckptfs::fuse
