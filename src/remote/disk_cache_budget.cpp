#include "remote/disk_cache_budget.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "remote/disk_cache.hpp"

namespace ckptfs {
namespace {

namespace fmt = disk_cache_format;

constexpr const char kMapSuffix[] = ".map";
constexpr const char kDataSuffix[] = ".data";

// The bases ("<folder>/<hash>-<hash>") of the objects in `folder`: those with a map file.
std::vector<std::string> ObjectBases(const std::string& folder) {
  std::vector<std::string> bases;
  DIR* dir = ::opendir(folder.c_str());
  if (!dir) return bases;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    const size_t n = sizeof kMapSuffix - 1;
    if (name.size() > n && name.compare(name.size() - n, n, kMapSuffix) == 0)
      bases.push_back(folder + "/" + name.substr(0, name.size() - n));
  }
  ::closedir(dir);
  return bases;
}

uint64_t AllocatedBytes(int fd) {
  struct stat st;
  return ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
}

uint64_t AllocatedBytes(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
}

// One object's files, open for the pass.
struct Object {
  std::string base;
  int map_fd = -1, data_fd = -1;
  uint64_t block_bytes = 0;  // 0: not our layout (an older ckptfs), removed whole
  std::vector<uint64_t> entries;
  ~Object() {
    if (map_fd >= 0) ::close(map_fd);
    if (data_fd >= 0) ::close(data_fd);
  }
};

// Opens the files of `o` and reads its header (false: the files are gone or unreadable).
bool Load(Object* o) {
  o->map_fd = ::open((o->base + kMapSuffix).c_str(), O_RDWR | O_CLOEXEC);
  o->data_fd = ::open((o->base + kDataSuffix).c_str(), O_RDWR | O_CLOEXEC);
  if (o->map_fd < 0 || o->data_fd < 0) return false;
  struct stat st;
  if (::fstat(o->map_fd, &st) != 0) return false;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  char header[fmt::kHeaderBytes];
  if (size < fmt::kHeaderBytes || ::pread(o->map_fd, header, sizeof header, 0) != static_cast<ssize_t>(sizeof header) ||
      std::memcmp(header, fmt::kMagic, 8) != 0)
    return true;  // another layout
  std::memcpy(&o->block_bytes, header + 8, 8);
  return true;
}

// Reads the entries of `o`, without their locks: a stale value only makes a candidate that
// the eviction checks again under the lock.
void LoadEntries(Object* o) {
  struct stat st;
  if (o->block_bytes == 0 || ::fstat(o->map_fd, &st) != 0 || st.st_size < static_cast<off_t>(fmt::kHeaderBytes))
    return;
  o->entries.resize((static_cast<uint64_t>(st.st_size) - fmt::kHeaderBytes) / fmt::kEntryBytes);
  const size_t bytes = o->entries.size() * fmt::kEntryBytes;
  if (::pread(o->map_fd, o->entries.data(), bytes, fmt::kHeaderBytes) != static_cast<ssize_t>(bytes))
    o->entries.clear();
}

// Removes the files of `o` when no process has it open; true when removed.
bool RemoveIfUnused(const Object& o) {
  if (!LockRange(o.map_fd, fmt::kOpenLockOffset, 1, /*exclusive=*/true, /*wait=*/false)) return false;
  // Data first: an opener that finds either file unlinked opens both again.
  ::unlink((o.base + kDataSuffix).c_str());
  ::unlink((o.base + kMapSuffix).c_str());
  UnlockRange(o.map_fd, fmt::kOpenLockOffset, 1);
  return true;
}

}  // namespace

DiskCacheBudget::DiskCacheBudget(std::string folder, uint64_t max_bytes)
    : folder_(std::move(folder)), max_bytes_(max_bytes), check_every_(std::max<uint64_t>(max_bytes / 16, 1)) {}

DiskCacheBudget::~DiskCacheBudget() {
  // Writes since the last pass (smaller than check_every_ together) are measured too.
  if (max_bytes_ != 0 && since_check_.load() != 0) EvictNow();
}

void DiskCacheBudget::Wrote(uint64_t bytes) {
  if (max_bytes_ == 0) return;
  if (since_check_.fetch_add(bytes) + bytes < check_every_) return;
  // Even when another thread's pass is under way: it may have measured before this write.
  EvictNow();
}

uint64_t DiskCacheBudget::Measure(const std::string& folder) {
  uint64_t used = 0;
  for (const std::string& base : ObjectBases(folder))
    used += AllocatedBytes(base + kMapSuffix) + AllocatedBytes(base + kDataSuffix);
  return used;
}

uint64_t DiskCacheBudget::EvictNow() {
  std::lock_guard<std::mutex> in_process(pass_mu_);
  // Writes finished before this point are on disk and measured below; later ones count
  // towards the next pass, which their writer then runs.
  since_check_.store(0);
  const int lock_fd = ::open((folder_ + "/evict.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) return Measure(folder_);
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }  // also releases the flock
  } close_lock{lock_fd};
  // Waits for another process's pass (milliseconds): every write is then followed by a pass
  // that counts it, so the folder ends within the bound once writers stop.
  while (::flock(lock_fd, LOCK_EX) != 0)
    if (errno != EINTR) return Measure(folder_);

  std::vector<std::unique_ptr<Object>> objects;
  uint64_t used = 0;
  for (std::string& base : ObjectBases(folder_)) {
    auto o = std::make_unique<Object>();
    o->base = std::move(base);
    if (!Load(o.get())) continue;
    used += AllocatedBytes(o->map_fd) + AllocatedBytes(o->data_fd);
    objects.push_back(std::move(o));
  }
  if (max_bytes_ == 0 || used <= max_bytes_) return used;
  const uint64_t target = max_bytes_ - max_bytes_ / 4;

  // Files of another layout hold nothing this version serves: they go first.
  for (auto& o : objects) {
    if (o->block_bytes != 0 || used <= target) continue;
    const uint64_t size = AllocatedBytes(o->map_fd) + AllocatedBytes(o->data_fd);
    if (RemoveIfUnused(*o)) used -= std::min(used, size);
  }

  struct Candidate {
    uint64_t used_at;
    uint32_t object;
    uint64_t block;
  };
  std::vector<Candidate> candidates;
  for (auto& o : objects) LoadEntries(o.get());
  for (uint32_t i = 0; i < objects.size(); ++i)
    for (uint64_t b = 0; b < objects[i]->entries.size(); ++b)
      if (objects[i]->entries[b] != 0) candidates.push_back(Candidate{objects[i]->entries[b], i, b});
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) { return a.used_at < b.used_at; });

  std::vector<bool> touched(objects.size(), false);
  for (const Candidate& c : candidates) {
    if (used <= target) break;
    Object& o = *objects[c.object];
    const uint64_t at = fmt::EntryOffset(c.block);
    // A block someone reads or writes right now is not the least recently used one.
    if (!LockRange(o.map_fd, at, fmt::kEntryBytes, /*exclusive=*/true, /*wait=*/false)) continue;
    uint64_t now_entry = 0;
    bool evicted = false;
    if (::pread(o.map_fd, &now_entry, sizeof now_entry, static_cast<off_t>(at)) == sizeof now_entry &&
        now_entry == c.used_at) {
      const uint64_t zero = 0;
      // The entry first: from here on no reader takes the block, so the hole is never served.
      if (::pwrite(o.map_fd, &zero, sizeof zero, static_cast<off_t>(at)) == sizeof zero) {
        const uint64_t before = AllocatedBytes(o.data_fd);
        if (::fallocate(o.data_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(c.block * o.block_bytes), static_cast<off_t>(o.block_bytes)) == 0) {
          used -= std::min(used, before - std::min(before, AllocatedBytes(o.data_fd)));
          evicted = true;
        }
      }
    }
    UnlockRange(o.map_fd, at, fmt::kEntryBytes);
    if (evicted) {
      o.entries[c.block] = 0;
      touched[c.object] = true;
    } else if (now_entry == c.used_at) {
      break;  // the file system cannot punch holes: evicting more frees nothing either
    }
  }
  // Objects left without a block lose their files (map included) unless open somewhere.
  for (uint32_t i = 0; i < objects.size(); ++i) {
    Object& o = *objects[i];
    if (!touched[i] || std::any_of(o.entries.begin(), o.entries.end(), [](uint64_t e) { return e != 0; })) continue;
    const uint64_t size = AllocatedBytes(o.map_fd) + AllocatedBytes(o.data_fd);
    if (RemoveIfUnused(o)) used -= std::min(used, size);
  }
  return used;
}

}  // namespace ckptfs
