// libFuzzer target: the zip central-directory reader (src/codec/zip.*) on arbitrary bytes.
// Invariants: every entry Open() accepts is findable by name and lies inside the file;
// a DataOffset() it grants leaves the whole record inside the file; ReadStored() returns
// exactly the record's size.
#include <cstdint>
#include <string>

#include "codec/zip.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckptfs_fuzz::MemFile& input = ckptfs_fuzz::MemFile::Get();
  const std::string& path = input.Write(data, size);
  SourceFiles files(input.env());
  uint32_t file;
  if (!files.Add(path, &file).ok()) __builtin_trap();
  FUZZ_CHECK(files.size(file) == size);
  ZipArchive zip;
  if (!zip.Open(files, files.whole(file), 100'000).ok()) return 0;
  for (const ZipEntry& e : zip.entries()) {
    const ZipEntry* found = zip.Find(e.name);
    FUZZ_CHECK(found != nullptr && found->name == e.name);
    FUZZ_CHECK(ckptfs_fuzz::AddOrTrap(ckptfs_fuzz::AddOrTrap(e.local_header_offset, 30), e.compressed_size) <= size);
    if (e.method == ZipArchive::kMethodStored) FUZZ_CHECK(e.compressed_size == e.uncompressed_size);
    uint64_t offset;
    if (zip.DataOffset(e, &offset).ok()) {
      FUZZ_CHECK(offset >= e.local_header_offset + 30);
      FUZZ_CHECK(ckptfs_fuzz::AddOrTrap(offset, e.compressed_size) <= size);
      std::string bytes;
      if (zip.ReadStored(e, 1u << 20, &bytes).ok()) {
        FUZZ_CHECK(bytes.size() == e.uncompressed_size);
        FUZZ_CHECK(std::string_view(bytes) == std::string_view(reinterpret_cast<const char*>(data) + offset, bytes.size()));
      }
    }
  }
  return 0;
}
