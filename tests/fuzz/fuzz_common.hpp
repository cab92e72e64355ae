// Helpers shared by the libFuzzer targets: an in-memory file to hand the readers (they
// open sources by path through an Env), invariant checks that trap, and the catalog
// invariants every reader must keep whatever its input.
#ifndef CKPTFS_TESTS_FUZZ_FUZZ_COMMON_HPP_
#define CKPTFS_TESTS_FUZZ_FUZZ_COMMON_HPP_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "ckptfs/catalog.hpp"
#include "ckptfs/limits.hpp"
#include "io/memory_env.hpp"

// An invariant violation is a finding: print what broke, then trap so libFuzzer saves the input.
#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      __builtin_trap();                                                                   \
    }                                                                                     \
  } while (0)

namespace ckptfs_fuzz {

// Limits small enough that a lying input cannot push a run past libFuzzer's -rss_limit_mb,
// large enough for every seed. Hitting one is a clean kRefused, not a finding.
inline ckptfs::ReadLimits FuzzLimits() {
  ckptfs::ReadLimits l;
  l.pickle_bytes = 16u << 20;
  l.pickle_memory = 256u << 20;
  l.header_bytes = 16u << 20;
  l.tensors = 100'000;
  return l;
}

// One file in a MemoryEnv of its own, rewritten for every input; readers reach it through
// env() (SourceOptions::env, or a SourceFiles over it).
class MemFile {
 public:
  static MemFile& Get() {
    static MemFile f;
    return f;
  }
  // Replaces the content and returns the path to open.
  const std::string& Write(const uint8_t* data, size_t size) {
    if (!env_->WriteFile(path_, std::string(reinterpret_cast<const char*>(data), size)).ok()) std::abort();
    return path_;
  }
  const std::string& path() const { return path_; }
  const std::shared_ptr<ckptfs::MemoryEnv>& env() const { return env_; }

  MemFile() = default;
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

 private:
  std::shared_ptr<ckptfs::MemoryEnv> env_ = std::make_shared<ckptfs::MemoryEnv>();
  std::string path_ = "/fuzz/input";
};

// a * b, trapping on overflow (callers check values a reader accepted: it must have
// rejected overflowing shapes itself).
inline uint64_t MulOrTrap(uint64_t a, uint64_t b) {
  uint64_t r;
  FUZZ_CHECK(!__builtin_mul_overflow(a, b, &r));
  return r;
}
inline uint64_t AddOrTrap(uint64_t a, uint64_t b) {
  uint64_t r;
  FUZZ_CHECK(!__builtin_add_overflow(a, b, &r));
  return r;
}

// What every catalog a reader returned must satisfy: every tensor's bytes lie inside its
// source files, contiguous tensors' extents add up to exactly their bytes, strided ones
// reach no element past the end of their file.
inline void CheckCatalog(const ckptfs::Catalog& c) {
  const ckptfs::SourceFiles& files = *c.files;
  for (const ckptfs::TensorEntry& t : c.tensors) {
    uint64_t numel = 1;
    for (uint64_t d : t.shape) numel = MulOrTrap(numel, d);
    const uint64_t nbytes = MulOrTrap(numel, ckptfs::Info(t.dtype).itemsize);
    if (t.strided) {
      const ckptfs::StridedLayout& s = *t.strided;
      FUZZ_CHECK(s.file < files.count());
      FUZZ_CHECK(s.strides.size() == t.shape.size());
      FUZZ_CHECK(t.extents.empty());
      if (numel == 0) continue;
      uint64_t last = 0;  // element offset of the last element
      for (size_t d = 0; d < t.shape.size(); ++d) last = AddOrTrap(last, MulOrTrap(t.shape[d] - 1, s.strides[d]));
      const uint64_t end = AddOrTrap(s.base_offset, MulOrTrap(AddOrTrap(last, 1), ckptfs::Info(t.dtype).itemsize));
      FUZZ_CHECK(end <= files.size(s.file));
    } else {
      uint64_t total = 0;
      for (const ckptfs::Extent& e : t.extents) {
        FUZZ_CHECK(e.file < files.count());
        FUZZ_CHECK(AddOrTrap(e.offset, e.length) <= files.size(e.file));
        total = AddOrTrap(total, e.length);
      }
      FUZZ_CHECK(total == nbytes);
    }
  }
  for (uint32_t f : c.sibling_files) FUZZ_CHECK(f < files.count());
}

// A small deterministic generator for fuzz-chosen read patterns.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed ^ 0x9E3779B97F4A7C15ull) {}
  uint64_t Next() {  // splitmix64
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : Next() % n; }

 private:
  uint64_t s_;
};

}  // namespace ckptfs_fuzz

#endif  // CKPTFS_TESTS_FUZZ_FUZZ_COMMON_HPP_
