// libFuzzer target: the whole OpenCatalog path on a torch.save file (zip directory, data.pkl
// pickle, tensor rebuild calls: src/format/torch/torch.cpp, torch_archive.*) from arbitrary bytes.
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
  // Only the torch reader: OpenCatalog picks it by the "PK\3\4" magic, so inputs that lost
  // it would exercise other readers (each has its own target).
  if (size < 4 || std::string_view(reinterpret_cast<const char*>(data), 4) != std::string_view("PK\3\4", 4)) return 0;
  std::shared_ptr<const Catalog> catalog;
  if (!ckptfs_fuzz::OpenInput(data, size, &catalog).ok()) return 0;
  // A zip holding constants.pkl or archive_format goes to the TorchScript or torch.export
  // reader: those run here too.
  FUZZ_CHECK(catalog->format == "torch-zip" || catalog->format == "torchscript" || catalog->format == "torch-export");
  ckptfs_fuzz::CheckCatalog(*catalog);
  std::set<std::string> keys;
  for (const TensorEntry& t : catalog->tensors) FUZZ_CHECK(keys.insert(t.key).second);
  (void)catalog->metadata.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
  return 0;
}
