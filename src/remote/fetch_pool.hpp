// FetchPool: the threads that fetch readahead blocks, so several range requests are in
// flight while the reader consumes earlier ones. Jobs still queued when the pool stops are
// dropped (readahead is best effort); running ones finish their request. A fork waits for
// every pool to be idle (fetch_pool.cpp says why).
// Thread-safety: Submit may be called concurrently.
#ifndef CKPTFS_REMOTE_FETCH_POOL_HPP_
#define CKPTFS_REMOTE_FETCH_POOL_HPP_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ckptfs {

class FetchPool {
 public:
  // A job runs with run=true, or with run=false when the pool stops before it ran.
  using Job = std::function<void(bool run)>;
  explicit FetchPool(int threads);
  ~FetchPool();
  FetchPool(const FetchPool&) = delete;
  FetchPool& operator=(const FetchPool&) = delete;

  void Submit(Job job);
  // Drops queued jobs and waits for running ones. The owner of the pool calls it while it
  // still holds what the jobs use, so no job ever ends up destroying the pool's owner.
  void Stop();
  // Drops queued jobs and waits for running ones; workers start again on the next Submit.
  void Quiesce();

 private:
  void Loop();
  const int threads_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  std::vector<std::thread> workers_;  // started on the first Submit
  bool stopped_ = false;    // for good
  bool quiescing_ = false;  // until Quiesce returns
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_FETCH_POOL_HPP_
