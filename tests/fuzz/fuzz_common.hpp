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
#include "ckptfs/open.hpp"
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

// Opens `data` as the one input file with the fuzzing limits. A refusal must say why.
inline ckptfs::Status OpenInput(const uint8_t* data, size_t size, std::shared_ptr<const ckptfs::Catalog>* out) {
  MemFile& input = MemFile::Get();
  const std::string& path = input.Write(data, size);
  ckptfs::SourceOptions options;
  options.limits = FuzzLimits();
  options.env = input.env();
  ckptfs::Status st = ckptfs::OpenCatalog(path, options, out);
  if (!st.ok() && st.message().empty()) std::abort();
  return st;
}

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

// What every catalog a reader returned must satisfy: ValidateLayout accepts every tensor,
// and, checked here on their own, every box's elements lie inside its file and the boxes'
// elements add up to exactly the tensor's.
inline void CheckCatalog(const ckptfs::Catalog& c) {
  const ckptfs::SourceFiles& files = *c.files;
  for (const ckptfs::TensorEntry& t : c.tensors) {
    const ckptfs::Status valid = ckptfs::ValidateLayout(t, files, c.source);
    if (!valid.ok()) std::fprintf(stderr, "%s\n", valid.message().c_str());
    FUZZ_CHECK(valid.ok());
    uint64_t numel = 1;
    for (uint64_t d : t.shape) numel = MulOrTrap(numel, d);
    const uint64_t itemsize = ckptfs::Info(t.dtype).itemsize;
    uint64_t covered = 0;
    for (const ckptfs::Box& b : t.boxes) {
      FUZZ_CHECK(b.file < files.count());
      FUZZ_CHECK(b.offset.size() == b.rank() && b.strides.size() == b.rank());
      uint64_t elements = 1, last = 0;  // element offset of the box's last element
      for (size_t d = 0; d < b.rank(); ++d) elements = MulOrTrap(elements, b.extent[d]);
      covered = AddOrTrap(covered, elements);
      if (elements == 0) continue;
      for (size_t d = 0; d < b.rank(); ++d) last = AddOrTrap(last, MulOrTrap(b.extent[d] - 1, b.strides[d]));
      FUZZ_CHECK(AddOrTrap(b.base_offset, MulOrTrap(AddOrTrap(last, 1), itemsize)) <= files.size(b.file));
    }
    FUZZ_CHECK(covered == numel);
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
