// libFuzzer target: the whole OpenCatalog path on a legacy torch.save stream (the pickles
// before the storages, the walk over the storages' 8-byte element counts, tensor rebuild
// calls: src/format/torch/torch_legacy.cpp, torch_archive.*, pickle.*) from arbitrary bytes.
// Invariants: catalog invariants (ckptfs_fuzz::CheckCatalog: valid layouts, every element
// of every box inside the file, boxes adding up to the tensor), unique keys, and a
// metadata tree that serializes.
#include <cstdint>
#include <set>
#include <string>

#include "ckptfs/catalog.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Only the legacy reader: OpenCatalog picks it by the leading PROTO opcode (0x80); inputs
  // that lost it would exercise other readers (each has its own target).
  if (size < 1 || data[0] != 0x80) return 0;
  std::shared_ptr<const Catalog> catalog;
  if (!ckptfs_fuzz::OpenInput(data, size, &catalog).ok()) return 0;
  FUZZ_CHECK(catalog->format == "torch-legacy");
  ckptfs_fuzz::CheckCatalog(*catalog);
  std::set<std::string> keys;
  for (const TensorEntry& t : catalog->tensors) FUZZ_CHECK(keys.insert(t.key).second);
  (void)catalog->metadata.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
  return 0;
}
