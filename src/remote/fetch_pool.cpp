#include "remote/fetch_pool.hpp"

#include <pthread.h>

#include <set>

namespace ckptfs {
namespace {

// The mount forks into the background after the catalog is built (fuse_daemonize), and a
// forked child has none of its parent's threads: a worker caught mid-fetch would leave its
// blocks pending forever there. So fork waits for every pool to go idle; workers start again
// on the next Submit, in whichever process submits.
std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::set<FetchPool*>& Registry() {
  static std::set<FetchPool*> pools;
  return pools;
}

void BeforeFork() {
  RegistryMutex().lock();
  for (FetchPool* pool : Registry()) pool->Quiesce();
}
void AfterFork() { RegistryMutex().unlock(); }

void RegisterForkHandlersOnce() {
  static const int registered = pthread_atfork(&BeforeFork, &AfterFork, &AfterFork);
  (void)registered;
}

}  // namespace

FetchPool::FetchPool(int threads) : threads_(threads) {
  RegisterForkHandlersOnce();
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry().insert(this);
}

FetchPool::~FetchPool() {
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry().erase(this);
  }
  Stop();
}

void FetchPool::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  Quiesce();
}

void FetchPool::Quiesce() {
  std::deque<Job> dropped;
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    quiescing_ = true;
    dropped.swap(queue_);
    workers.swap(workers_);
  }
  wake_.notify_all();
  for (Job& job : dropped) job(false);
  for (std::thread& t : workers) t.join();
  std::lock_guard<std::mutex> lock(mu_);
  quiescing_ = false;
}

void FetchPool::Submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_ && !quiescing_) {
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
      wake_.wait(lock, [&] { return quiescing_ || stopped_ || !queue_.empty(); });
      if (quiescing_ || stopped_ || queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job(true);
  }
}

}  // namespace ckptfs
