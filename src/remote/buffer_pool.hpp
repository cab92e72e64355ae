// BufferPool: the buffers range requests land in, recycled. A fresh multi-megabyte buffer
// is fresh pages from the kernel, each faulted in and zeroed on first touch: at loopback
// speeds that cost a fifth of the daemon's time (a perf profile of bench_remote's read). So
// buffers are never zero-filled here (a fetch writes every byte a block exposes), and those
// of the pool's size come back when the last cache block that slices one is evicted, up to
// a bound that keeps the pool within the cache's own size.
// Thread-safety: Get may be called concurrently.
#ifndef CKPTFS_REMOTE_BUFFER_POOL_HPP_
#define CKPTFS_REMOTE_BUFFER_POOL_HPP_

#include <sys/mman.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace ckptfs {

// Bytes one request filled; `size` of them are in use (a pooled buffer may be larger).
class FetchBuffer {
 public:
  // Uninitialized on purpose: see above. A pooled buffer is mapped with its pages
  // populated at once: the kernel still zeroes them, but without a fault per 4 KiB page
  // taken in the middle of a copy out of libcurl.
  explicit FetchBuffer(size_t capacity, bool populate = false) : capacity_(capacity), size_(capacity) {
    if (populate && capacity > 0) {
      void* p = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      if (p != MAP_FAILED) {
        bytes_ = static_cast<char*>(p);
        mapped_ = true;
        return;
      }
    }
    bytes_ = new char[capacity];
  }
  ~FetchBuffer() {
    if (mapped_) ::munmap(bytes_, capacity_);
    else delete[] bytes_;
  }
  FetchBuffer(const FetchBuffer&) = delete;
  FetchBuffer& operator=(const FetchBuffer&) = delete;

  char* data() { return bytes_; }
  const char* data() const { return bytes_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  void resize(size_t size) { size_ = size; }  // at most capacity()

 private:
  char* bytes_ = nullptr;
  bool mapped_ = false;
  size_t capacity_;
  size_t size_;
};

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Recycles buffers of `buffer_bytes`, keeping at most `max_buffers` of them in existence
  // (handed out or idle) once they come back.
  BufferPool(size_t buffer_bytes, size_t max_buffers) : buffer_bytes_(buffer_bytes), max_buffers_(max_buffers) {}

  // A buffer of `size` bytes (contents undefined). Sizes from half the pool's size up to it
  // get a pooled buffer; others (a catalog's scattered small reads) one of their own size,
  // so a small block never pins a large buffer in the cache.
  std::shared_ptr<FetchBuffer> Get(size_t size) {
    if (size > buffer_bytes_ || size < buffer_bytes_ / 2) return std::make_shared<FetchBuffer>(size);
    std::unique_ptr<FetchBuffer> buffer;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        buffer = std::move(free_.back());
        free_.pop_back();
      } else {
        ++outstanding_;
      }
    }
    if (!buffer) buffer = std::make_unique<FetchBuffer>(buffer_bytes_, /*populate=*/true);
    buffer->resize(size);
    std::weak_ptr<BufferPool> pool = weak_from_this();
    return std::shared_ptr<FetchBuffer>(buffer.release(), [pool](FetchBuffer* b) {
      std::unique_ptr<FetchBuffer> owned(b);
      if (auto p = pool.lock()) p->Put(std::move(owned));
    });
  }

 private:
  void Put(std::unique_ptr<FetchBuffer> buffer) {
    std::lock_guard<std::mutex> lock(mu_);
    if (outstanding_ > max_buffers_) {
      --outstanding_;
      return;  // freed: more exist than the bound allows
    }
    free_.push_back(std::move(buffer));
  }

  const size_t buffer_bytes_;
  const size_t max_buffers_;
  std::mutex mu_;
  size_t outstanding_ = 0;  // pooled buffers in existence, handed out or idle
  std::vector<std::unique_ptr<FetchBuffer>> free_;
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_BUFFER_POOL_HPP_
