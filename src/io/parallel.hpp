// A few threads for the few steps of opening a checkpoint whose work grows with its tensor
// count (decoding a cached catalog, checking layouts, sorting file names): for a million
// tensors each is tens of milliseconds on one core while the other cores wait.
//
// Small work runs on the calling thread alone: a checkpoint of a few hundred tensors pays
// nothing for this. Workers are plain threads started per call and joined before it
// returns (these steps run once per open; a pool would outlive them for nothing).
#ifndef CKPTFS_IO_PARALLEL_HPP_
#define CKPTFS_IO_PARALLEL_HPP_

#include <algorithm>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace ckptfs {

// Threads used at most, the calling one included: beyond a few, these steps are bound by
// memory (page faults, allocation), not by cores.
constexpr size_t kMaxWorkers = 4;

// How many threads to split `items` among so that each gets at least `min_items`:
// 1 (the calling thread alone) when there are fewer than 2 * min_items.
inline size_t WorkerCount(size_t items, size_t min_items) {
  const size_t cores = std::max<size_t>(1, std::thread::hardware_concurrency());
  const size_t by_items = min_items == 0 ? items : items / min_items;
  return std::max<size_t>(1, std::min({kMaxWorkers, cores, by_items}));
}

// Calls work(w) for w in [0, workers), work(0) on the calling thread and the others on
// threads of their own, and returns when all have. A thread that cannot be started runs
// its share on the calling thread. The first exception any share throws is rethrown here,
// after every share has ended.
template <typename Work>
void RunOnWorkers(size_t workers, Work work) {
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto guarded = [&](size_t w) {
    try {
      work(w);
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  std::vector<size_t> unstarted;
  for (size_t w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(guarded, w);
    } catch (const std::exception&) {  // std::system_error: no thread to be had
      unstarted.push_back(w);
    }
  }
  guarded(0);
  for (size_t w : unstarted) guarded(w);
  for (std::thread& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
}

// [begin, end) of part `part` of `count` items split into `parts` consecutive ranges.
inline std::pair<size_t, size_t> PartRange(size_t count, size_t parts, size_t part) {
  const size_t base = count / parts, extra = count % parts;
  const size_t begin = part * base + std::min(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

}  // namespace ckptfs

#endif  // CKPTFS_IO_PARALLEL_HPP_
