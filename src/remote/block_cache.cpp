#include "remote/block_cache.hpp"

namespace ckptfs {

BlockCache::Lookup BlockCache::Find(uint64_t object, uint64_t index, bool claim, Block* block) {
  std::lock_guard<std::mutex> lock(mu_);
  const Key key{object, index};
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    if (!claim) return Lookup::kAbsent;
    entries_.emplace(key, Entry{});
    return Lookup::kClaimed;
  }
  if (it->second.pending) return Lookup::kPending;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  *block = it->second.block;
  return Lookup::kReady;
}

BlockCache::Lookup BlockCache::Wait(uint64_t object, uint64_t index, Block* block) {
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{object, index};
  done_.wait(lock, [&] {
    auto it = entries_.find(key);
    return it == entries_.end() || !it->second.pending;
  });
  auto it = entries_.find(key);
  if (it == entries_.end()) return Lookup::kAbsent;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  *block = it->second.block;
  return Lookup::kReady;
}

void BlockCache::Fill(uint64_t object, uint64_t index, Block block) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Key key{object, index};
    Entry& e = entries_[key];
    e.pending = false;
    ready_bytes_ += block.length;
    e.block = std::move(block);
    lru_.push_front(key);
    e.lru = lru_.begin();
    EvictLocked(1);
  }
  done_.notify_all();
}

void BlockCache::FillRun(uint64_t object, uint64_t first, std::vector<Block> blocks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < blocks.size(); ++i) {
      const Key key{object, first + i};
      Entry& e = entries_[key];
      e.pending = false;
      ready_bytes_ += blocks[i].length;
      e.block = std::move(blocks[i]);
      lru_.push_front(key);
      e.lru = lru_.begin();
    }
    EvictLocked(blocks.size());
  }
  done_.notify_all();
}

void BlockCache::Fail(uint64_t object, uint64_t index) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.erase(Key{object, index});
  }
  done_.notify_all();
}

void BlockCache::EvictLocked(size_t keep) {
  // The blocks just filled are at the front and are never evicted by their own Fill, so a
  // cache smaller than one request still serves that request.
  while (ready_bytes_ > capacity_ && lru_.size() > keep) {
    const Key key = lru_.back();
    lru_.pop_back();
    auto it = entries_.find(key);
    ready_bytes_ -= it->second.block.length;
    entries_.erase(it);
  }
}

}  // namespace ckptfs
