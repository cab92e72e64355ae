// libFuzzer target: the torch.distributed.checkpoint reader (src/format/dcp/dcp_metadata.cpp
// and src/format/dcp/dcp.cpp) on a fuzzed `.metadata` pickle.
//
// The folder is the unit tests' sample (tests/data/dcp-sharded/: two rank files of
// torch.save chunks, see tests/data/make_dcp_sample.py) copied into a MemoryEnv; each
// input replaces its .metadata, so chunk offsets, lengths, paths and shapes the input
// names reach real archives. Invariants: catalog invariants (valid layouts, every box
// inside its file), unique keys.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "ckptfs/catalog.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;

namespace {

const std::string g_dir = "/fuzz/dcp";
std::shared_ptr<MemoryEnv> g_env;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_env = std::make_shared<MemoryEnv>();
  for (const auto& entry : std::filesystem::directory_iterator(CKPTFS_FUZZ_SAMPLE)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!g_env->WriteFile(g_dir + "/" + entry.path().filename().string(), bytes).ok()) std::abort();
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (!g_env->WriteFile(g_dir + "/.metadata", std::string(reinterpret_cast<const char*>(data), size)).ok())
    std::abort();
  SourceOptions options;
  options.env = g_env;
  options.limits = ckptfs_fuzz::FuzzLimits();
  std::shared_ptr<const Catalog> catalog;
  if (!OpenCatalog(g_dir, options, &catalog).ok()) return 0;
  ckptfs_fuzz::CheckCatalog(*catalog);
  std::set<std::string> keys;
  for (const TensorEntry& t : catalog->tensors) FUZZ_CHECK(keys.insert(t.key).second);
  return 0;
}
