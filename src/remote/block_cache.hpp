// BlockCache: fetched blocks of remote objects in memory, bounded in bytes, least recently
// used first out. A block is created "pending" by whoever fetches it; everyone else who
// needs it waits for it instead of fetching it again, so one range is never requested twice
// at once. A failed block leaves the cache, so the next reader tries the network again.
// Blocks a sequential reader has read to their end are "consumed": the kernel's page cache
// holds those bytes now, so they leave first and only a few megabytes of them are kept (for
// the neighbouring read that needs the start of a block another read finished). A stream
// then recycles a readahead window's worth of buffers instead of filling the whole cache
// with fresh memory.
// Thread-safety: all methods may be called concurrently.
#ifndef CKPTFS_REMOTE_BLOCK_CACHE_HPP_
#define CKPTFS_REMOTE_BLOCK_CACHE_HPP_

#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "ckptfs/status.hpp"
#include "remote/buffer_pool.hpp"

namespace ckptfs {

class BlockCache {
 public:
  // One block's bytes: a slice of the buffer one request filled (several blocks share it,
  // so a multi-block fetch is never copied).
  struct Block {
    std::shared_ptr<const FetchBuffer> buffer;
    size_t offset = 0;
    size_t length = 0;
    const char* data() const { return buffer->data() + offset; }
  };

  // Keeps at most `capacity_bytes` of ready blocks, of which at most `consumed_keep_bytes`
  // consumed ones.
  BlockCache(uint64_t capacity_bytes, uint64_t consumed_keep_bytes)
      : capacity_(capacity_bytes), consumed_keep_(consumed_keep_bytes) {}

  // Finds block (object, index). When it is ready, copies it to *block and returns kReady;
  // when another thread is fetching it, kPending; when absent and `claim` is true, marks it
  // pending for the caller (who must then Fill or Fail it) and returns kClaimed; else kAbsent.
  enum class Lookup { kReady, kPending, kClaimed, kAbsent };
  Lookup Find(uint64_t object, uint64_t index, bool claim, Block* block);

  // Waits until block (object, index) is no longer pending; then as Find without claiming.
  Lookup Wait(uint64_t object, uint64_t index, Block* block);

  // Completes a claimed block.
  void Fill(uint64_t object, uint64_t index, Block block);
  // Completes claimed blocks first, first+1, ... at once (one request's blocks): one lock
  // and one wake-up for the readers waiting on any of them.
  void FillRun(uint64_t object, uint64_t first, std::vector<Block> blocks);
  // Abandons a claimed block (its fetch failed): waiters see it absent and try themselves.
  void Fail(uint64_t object, uint64_t index);
  // Marks a ready block consumed (see above); absent or pending blocks are left alone.
  void Consumed(uint64_t object, uint64_t index);

  uint64_t capacity() const { return capacity_; }

 private:
  using Key = std::pair<uint64_t, uint64_t>;
  struct Entry {
    bool pending = true;
    bool consumed = false;
    Block block;
    std::list<Key>::iterator lru;  // in lru_ or consumed_; valid when !pending
  };
  // Moves a ready entry to the front of its list (it is being used again).
  void TouchLocked(Entry& e);
  void EraseLocked(std::map<Key, Entry>::iterator it);
  void EvictLocked(size_t keep);

  const uint64_t capacity_;
  const uint64_t consumed_keep_;
  std::mutex mu_;
  std::condition_variable done_;
  std::map<Key, Entry> entries_;
  std::list<Key> lru_;       // ready blocks not consumed, most recently used first
  std::list<Key> consumed_;  // consumed blocks, most recently consumed first
  uint64_t ready_bytes_ = 0;
  uint64_t consumed_bytes_ = 0;
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_BLOCK_CACHE_HPP_
