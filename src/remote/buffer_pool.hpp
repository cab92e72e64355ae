// BufferPool: the buffers range requests land in, recycled. A fresh multi-megabyte buffer
// is fresh pages from the kernel, each zeroed on first touch: at loopback speeds that cost
// as much as the copy out of the socket. Buffers come back when the last cache block that
// slices one is evicted.
// Thread-safety: Get may be called concurrently.
#ifndef CKPTFS_REMOTE_BUFFER_POOL_HPP_
#define CKPTFS_REMOTE_BUFFER_POOL_HPP_

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace ckptfs {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Keeps at most `max_free` idle buffers of `buffer_bytes`.
  BufferPool(size_t buffer_bytes, size_t max_free) : buffer_bytes_(buffer_bytes), max_free_(max_free) {}

  // A buffer of `size` bytes (contents undefined); recycled when it is the pool's size.
  std::shared_ptr<std::vector<char>> Get(size_t size) {
    std::unique_ptr<std::vector<char>> buffer;
    if (size == buffer_bytes_) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        buffer = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!buffer) buffer = std::make_unique<std::vector<char>>(size);
    std::weak_ptr<BufferPool> pool = weak_from_this();
    return std::shared_ptr<std::vector<char>>(buffer.release(), [pool](std::vector<char>* b) {
      std::unique_ptr<std::vector<char>> owned(b);
      if (auto p = pool.lock()) p->Put(std::move(owned));
    });
  }

 private:
  void Put(std::unique_ptr<std::vector<char>> buffer) {
    if (buffer->size() != buffer_bytes_) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < max_free_) free_.push_back(std::move(buffer));
  }

  const size_t buffer_bytes_;
  const size_t max_free_;
  std::mutex mu_;
  std::vector<std::unique_ptr<std::vector<char>>> free_;
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_BUFFER_POOL_HPP_
