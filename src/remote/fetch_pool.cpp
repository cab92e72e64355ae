#include "remote/fetch_pool.hpp"

namespace ckptfs {

FetchPool::~FetchPool() { Stop(); }

void FetchPool::Stop() {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  wake_.notify_all();
  for (Job& job : dropped) job(false);
  for (std::thread& t : workers_)
    if (t.joinable()) t.join();
}

void FetchPool::Submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      // Threads start on first use: a source read only for its catalog starts none.
      if (workers_.empty())
        for (int i = 0; i < threads_; ++i) workers_.emplace_back([this] { Loop(); });
      queue_.push_back(std::move(job));
      job = nullptr;
    }
  }
  if (job) return job(false);
  wake_.notify_one();
}

void FetchPool::Loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job(true);
  }
}

}  // namespace ckptfs
