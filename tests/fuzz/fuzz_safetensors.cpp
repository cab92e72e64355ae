// libFuzzer target: the safetensors reader (src/format/safetensors/safetensors.cpp, its header
// parser src/codec/safetensors_header.cpp) on arbitrary bytes. Invariants: catalog invariants
// (valid layouts, every box inside the file, boxes adding up to the tensor), and an accepted
// header's tensors tile the data buffer exactly.
#include <cstdint>
#include <string>

#include "format/readers.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckptfs_fuzz::MemFile& input = ckptfs_fuzz::MemFile::Get();
  const std::string& path = input.Write(data, size);
  Catalog catalog;
  catalog.files = std::make_shared<SourceFiles>(input.env());
  nlohmann::json metadata;
  Status st = ReadSafetensorsFile(path, &catalog, &metadata, ckptfs_fuzz::FuzzLimits());
  if (!st.ok()) {
    FUZZ_CHECK(!st.message().empty());
    return 0;
  }
  ckptfs_fuzz::CheckCatalog(catalog);
  FUZZ_CHECK(size >= 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | data[i];
  uint64_t covered = 0;
  for (const TensorEntry& t : catalog.tensors) {
    for (const Extent& e : ExtentsOf(t)) {
      FUZZ_CHECK(e.offset >= 8 + header_len);
      covered += e.length;
    }
  }
  FUZZ_CHECK(covered == size - 8 - header_len);
  FUZZ_CHECK(metadata.is_object());
  for (auto& [k, v] : metadata.items()) FUZZ_CHECK(v.is_string());
  return 0;
}
