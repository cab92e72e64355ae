#include "remote/block_cache.hpp"

namespace ckptfs {

void BlockCache::TouchLocked(Entry& e) {
  // A consumed block stays consumed when read again: the kernel delivers a sequential
  // reader's requests out of order, so the read of a block's start often comes after the
  // read that finished it, and making it an ordinary block again would leave it pinning
  // its request's whole buffer until the cache is full.
  std::list<Key>& list = e.consumed ? consumed_ : lru_;
  list.splice(list.begin(), list, e.lru);
}

void BlockCache::EraseLocked(std::map<Key, Entry>::iterator it) {
  Entry& e = it->second;
  if (!e.pending) {
    (e.consumed ? consumed_ : lru_).erase(e.lru);
    ready_bytes_ -= e.block.length;
    if (e.consumed) consumed_bytes_ -= e.block.length;
  }
  entries_.erase(it);
}

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
  TouchLocked(it->second);
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
  TouchLocked(it->second);
  *block = it->second.block;
  return Lookup::kReady;
}

void BlockCache::Fill(uint64_t object, uint64_t index, Block block) {
  std::vector<Block> one;
  one.push_back(std::move(block));
  FillRun(object, index, std::move(one));
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
    auto it = entries_.find(Key{object, index});
    if (it != entries_.end()) EraseLocked(it);
  }
  done_.notify_all();
}

void BlockCache::Consumed(uint64_t object, uint64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(Key{object, index});
  if (it == entries_.end() || it->second.pending || it->second.consumed) return;
  Entry& e = it->second;
  consumed_.splice(consumed_.begin(), lru_, e.lru);
  e.consumed = true;
  consumed_bytes_ += e.block.length;
  while (consumed_bytes_ > consumed_keep_) EraseLocked(entries_.find(consumed_.back()));
}

void BlockCache::EvictLocked(size_t keep) {
  // Consumed blocks go first. The blocks just filled are at the front of lru_ and are never
  // evicted by their own Fill, so a cache smaller than one request still serves that request.
  while (ready_bytes_ > capacity_ && !consumed_.empty()) EraseLocked(entries_.find(consumed_.back()));
  while (ready_bytes_ > capacity_ && lru_.size() > keep) EraseLocked(entries_.find(lru_.back()));
}

}  // namespace ckptfs
