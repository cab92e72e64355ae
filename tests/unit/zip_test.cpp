// ZipArchive on hand-built archives: stored entries, the torch quirks (local extra
// longer than the central one, zip64 end records on small files, data descriptors),
// and archives broken in each way the reader must reject.
#define BOOST_TEST_MODULE zip_test
#include <boost/test/unit_test.hpp>

#include "codec/zip.hpp"
#include "test_util.hpp"

using ckptfs::Status;
using ckptfs::ZipArchive;
using ckptfs::ZipEntry;
using namespace ckptfs_test;

namespace {

// Puts `bytes` in an in-memory file and opens it as a zip archive.
struct Opened {
  MemorySource source;
  std::string path = "/mem/archive.zip";
  ckptfs::SourceFiles files{source.env()};
  ZipArchive zip;
  Status status;

  explicit Opened(const std::string& bytes) {
    source.Write(path, bytes);
    uint32_t index = 0;
    Status added = files.Add(path, &index);
    BOOST_REQUIRE_MESSAGE(added.ok(), added.message());
    status = zip.Open(files, files.whole(index));
  }
};

void CheckCorruption(const Opened& o, std::string_view expected_part) {
  BOOST_TEST(!o.status.ok());
  BOOST_TEST(static_cast<int>(o.status.code()) == static_cast<int>(Status::Code::kCorruption));
  BOOST_TEST(StartsWith(o.status.message(), o.path + ": "), o.status.message());
  BOOST_TEST(Contains(o.status.message(), expected_part), o.status.message());
}

// Three stored records in a torch-like folder, the second with a 64-byte alignment block
// in its local header only.
std::string ThreeEntries(ZipLayout* layout, bool zip64_end = false, std::string_view comment = "") {
  ZipBuilder b;
  b.Add(ZipEntrySpec("arch/data.pkl", "hello pickle"));
  b.Add(ZipEntrySpec("arch/data/0", PatternBytes(100, 1)).LocalExtra(PaddingExtra(60)));
  b.Add(ZipEntrySpec("arch/empty", ""));
  return b.Build(zip64_end, comment, layout);
}

}  // namespace

BOOST_AUTO_TEST_CASE(stored_entries_are_listed_with_names_and_sizes) {
  ZipLayout lay;
  Opened o(ThreeEntries(&lay));
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());
  const auto& entries = o.zip.entries();
  BOOST_REQUIRE_EQUAL(entries.size(), 3u);
  BOOST_TEST(entries[0].name == "arch/data.pkl");
  BOOST_TEST(entries[1].name == "arch/data/0");
  BOOST_TEST(entries[2].name == "arch/empty");
  BOOST_TEST(entries[0].uncompressed_size == 12u);
  BOOST_TEST(entries[0].compressed_size == 12u);
  BOOST_TEST(entries[1].uncompressed_size == 100u);
  BOOST_TEST(entries[2].uncompressed_size == 0u);
  for (size_t i = 0; i < 3; ++i) {
    BOOST_TEST(entries[i].method == ZipArchive::kMethodStored);
    BOOST_TEST(entries[i].local_header_offset == lay.local_header_offsets[i]);
  }
  BOOST_TEST(o.zip.Find("arch/data/0") == &entries[1]);
  BOOST_TEST(o.zip.Find("arch/data") == nullptr);
  BOOST_TEST(o.zip.Find("ARCH/DATA.PKL") == nullptr);

  std::string pkl;
  Status s = o.zip.ReadStored(entries[0], 1 << 20, &pkl);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(pkl == "hello pickle");
  std::string empty = "x";
  BOOST_TEST(o.zip.ReadStored(entries[2], 16, &empty).ok());
  BOOST_TEST(empty.empty());
}

BOOST_AUTO_TEST_CASE(data_offset_uses_the_local_extra_field) {
  ZipLayout lay;
  Opened o(ThreeEntries(&lay));
  BOOST_REQUIRE(o.status.ok());
  const ZipEntry* e = o.zip.Find("arch/data/0");
  BOOST_REQUIRE(e);
  uint64_t offset = 0;
  Status s = o.zip.DataOffset(*e, &offset);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  // 30-byte header + 11-byte name + 64-byte local extra; the central entry has no extra.
  BOOST_TEST(offset == lay.local_header_offsets[1] + 30 + 11 + 64);
  BOOST_TEST(offset == lay.data_offsets[1]);
  std::string data;
  BOOST_REQUIRE(o.zip.ReadStored(*e, 100, &data).ok());
  BOOST_TEST(data == PatternBytes(100, 1));
}

BOOST_AUTO_TEST_CASE(read_stored_refuses_records_above_max_size) {
  ZipLayout lay;
  Opened o(ThreeEntries(&lay));
  BOOST_REQUIRE(o.status.ok());
  std::string data;
  Status s = o.zip.ReadStored(*o.zip.Find("arch/data/0"), 99, &data);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kCorruption));
  BOOST_TEST(Contains(s.message(), "implausibly large (100 bytes)"), s.message());
}

BOOST_AUTO_TEST_CASE(archive_comment_is_skipped) {
  ZipLayout lay;
  Opened o(ThreeEntries(&lay, false, "a comment with PK\x05\x06 inside it"));
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());
  BOOST_TEST(o.zip.entries().size() == 3u);
}

BOOST_AUTO_TEST_CASE(zip64_end_records_are_used) {
  // The classic EOCD is saturated (0xFFFF entries, 0xFFFFFFFF offset), so a parse that
  // ignored the zip64 record would fail or find garbage.
  ZipLayout lay;
  Opened o(ThreeEntries(&lay, true));
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());
  BOOST_REQUIRE_EQUAL(o.zip.entries().size(), 3u);
  BOOST_TEST(o.zip.entries()[1].name == "arch/data/0");
  BOOST_TEST(o.zip.entries()[1].uncompressed_size == 100u);
}

BOOST_AUTO_TEST_CASE(zip64_extra_fields_replace_saturated_central_values) {
  ZipBuilder b;
  b.Add(ZipEntrySpec("a/small", "abc"));
  b.Add(ZipEntrySpec("a/sizes", PatternBytes(40, 2)).Zip64Sizes());
  b.Add(ZipEntrySpec("a/offset", PatternBytes(24, 3)).Zip64Offset());
  // All three zip64 fields, plus an unrelated extra block after the zip64 one.
  b.Add(ZipEntrySpec("a/both", PatternBytes(8, 4)).CentralExtra(PaddingExtra(3)).Zip64Sizes().Zip64Offset());
  ZipLayout lay;
  Opened o(b.Build(true, "", &lay));
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());
  const auto& es = o.zip.entries();
  BOOST_REQUIRE_EQUAL(es.size(), 4u);
  BOOST_TEST(es[1].uncompressed_size == 40u);
  BOOST_TEST(es[1].compressed_size == 40u);
  BOOST_TEST(es[1].local_header_offset == lay.local_header_offsets[1]);
  BOOST_TEST(es[2].uncompressed_size == 24u);
  BOOST_TEST(es[2].local_header_offset == lay.local_header_offsets[2]);
  BOOST_TEST(es[3].uncompressed_size == 8u);
  BOOST_TEST(es[3].compressed_size == 8u);
  BOOST_TEST(es[3].local_header_offset == lay.local_header_offsets[3]);
  for (size_t i = 0; i < 4; ++i) {
    uint64_t off = 0;
    BOOST_REQUIRE(o.zip.DataOffset(es[i], &off).ok());
    BOOST_TEST(off == lay.data_offsets[i]);
  }
  std::string data;
  BOOST_REQUIRE(o.zip.ReadStored(es[3], 8, &data).ok());
  BOOST_TEST(data == PatternBytes(8, 4));
}

BOOST_AUTO_TEST_CASE(data_descriptor_entries_take_sizes_from_the_central_directory) {
  ZipBuilder b;
  b.Add(ZipEntrySpec("t/data.pkl", "pickle bytes").Flags(0x0800).LocalExtra(PaddingExtra(17)).DataDescriptor());
  b.Add(ZipEntrySpec("t/data/0", PatternBytes(64, 5)).Flags(0x0800).LocalExtra(PaddingExtra(0)).DataDescriptor());
  ZipLayout lay;
  Opened o(b.Build(true, "", &lay));
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());
  const auto& es = o.zip.entries();
  BOOST_REQUIRE_EQUAL(es.size(), 2u);
  BOOST_TEST(es[0].flags == 0x0808);
  BOOST_TEST(es[0].uncompressed_size == 12u);
  BOOST_TEST(es[1].compressed_size == 64u);
  std::string data;
  BOOST_REQUIRE(o.zip.ReadStored(es[1], 64, &data).ok());
  BOOST_TEST(data == PatternBytes(64, 5));
  uint64_t off = 0;
  BOOST_REQUIRE(o.zip.DataOffset(es[0], &off).ok());
  BOOST_TEST(off == lay.local_header_offsets[0] + 30 + 10 + 21);
}

BOOST_AUTO_TEST_CASE(reopening_with_another_archive_reads_its_own_headers) {
  // Open() resets the archive: offsets must come from the second file's local headers,
  // even after DataOffset read the first file's.
  ZipLayout lay_a, lay_b;
  const std::string a = ThreeEntries(&lay_a);
  ZipBuilder bb;
  bb.Add(ZipEntrySpec("b/x", "payload").LocalExtra(PaddingExtra(20)));
  const std::string b = bb.Build(false, "", &lay_b);
  MemorySource source;
  ckptfs::SourceFiles files(source.env());
  uint32_t ia = 0, ib = 0;
  BOOST_REQUIRE(files.Add(source.Write("/mem/a.zip", a), &ia).ok());
  BOOST_REQUIRE(files.Add(source.Write("/mem/b.zip", b), &ib).ok());
  ZipArchive zip;
  BOOST_REQUIRE(zip.Open(files, files.whole(ia)).ok());
  uint64_t off = 0;
  BOOST_REQUIRE(zip.DataOffset(zip.entries().at(0), &off).ok());
  BOOST_TEST(off == lay_a.data_offsets[0]);
  BOOST_REQUIRE(zip.Open(files, files.whole(ib)).ok());
  BOOST_REQUIRE_EQUAL(zip.entries().size(), 1u);
  BOOST_TEST(zip.Find("arch/data.pkl") == nullptr);
  BOOST_REQUIRE(zip.DataOffset(zip.entries()[0], &off).ok());
  BOOST_TEST(off == lay_b.data_offsets[0]);  // 30 + 3 + 24
  std::string data;
  BOOST_REQUIRE(zip.ReadStored(zip.entries()[0], 100, &data).ok());
  BOOST_TEST(data == "payload");
}

// ---- malformed archives ----------------------------------------------------------------

BOOST_AUTO_TEST_CASE(too_short_file) {
  Opened o(std::string(21, 'P'));
  CheckCorruption(o, "too short for an end-of-central-directory record");
  Opened empty("");
  CheckCorruption(empty, "too short");
}

BOOST_AUTO_TEST_CASE(no_end_of_central_directory) {
  Opened o(std::string(300, '\0'));
  CheckCorruption(o, "no end-of-central-directory record");

  // A real archive whose EOCD signature is damaged.
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  bytes[lay.eocd_offset + 3] = 0x07;
  Opened damaged(bytes);
  CheckCorruption(damaged, "no end-of-central-directory record");
}

BOOST_AUTO_TEST_CASE(central_directory_offset_past_eof) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  PatchLE(&bytes, lay.eocd_offset + 16, bytes.size() + 100, 4);
  Opened o(bytes);
  CheckCorruption(o, "central directory lies outside the file");

  // Same through the zip64 record, with an offset that overflows when the size is added.
  std::string b64 = ThreeEntries(&lay, true);
  PatchLE(&b64, lay.zip64_end_offset + 48, ~uint64_t{0} - 4, 8);
  Opened o64(b64);
  CheckCorruption(o64, "central directory lies outside the file");
}

BOOST_AUTO_TEST_CASE(zip64_locator_pointing_outside_the_file) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay, true);
  PatchLE(&bytes, lay.eocd_offset - 20 + 8, bytes.size(), 8);
  Opened o(bytes);
  CheckCorruption(o, "zip64 locator points outside the file");
}

BOOST_AUTO_TEST_CASE(zip64_end_record_with_bad_signature) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay, true);
  bytes[lay.zip64_end_offset] = 'X';
  Opened o(bytes);
  CheckCorruption(o, "zip64 end-of-central-directory record has a bad signature");
}

BOOST_AUTO_TEST_CASE(bad_central_signature) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  bytes[lay.central_offsets[1] + 2] = 0x03;  // PK\3\2
  Opened o(bytes);
  CheckCorruption(o, "central directory entry 1 has a bad signature");
}

BOOST_AUTO_TEST_CASE(entry_count_larger_than_the_directory) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  PatchLE(&bytes, lay.eocd_offset + 8, 4, 2);
  PatchLE(&bytes, lay.eocd_offset + 10, 4, 2);
  Opened o(bytes);
  // 3 entries of >= 46 bytes cannot hold a 4th; either check is an acceptable diagnosis.
  BOOST_TEST(!o.status.ok());
  BOOST_TEST(static_cast<int>(o.status.code()) == static_cast<int>(Status::Code::kCorruption));
  BOOST_TEST(StartsWith(o.status.message(), o.path + ": "));
}

BOOST_AUTO_TEST_CASE(entry_extending_past_eof) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  // Stored: both sizes must agree, so grow both to 1 MB.
  PatchLE(&bytes, lay.central_offsets[1] + 20, 1 << 20, 4);
  PatchLE(&bytes, lay.central_offsets[1] + 24, 1 << 20, 4);
  Opened o(bytes);
  CheckCorruption(o, "entry 'arch/data/0' extends past the end of the file");

  std::string b2 = ThreeEntries(&lay);
  // A header offset whose 30-byte header plus 12 data bytes would end past the EOF.
  PatchLE(&b2, lay.central_offsets[0] + 42, b2.size() - 41, 4);
  Opened o2(b2);
  CheckCorruption(o2, "extends past the end of the file");
}

BOOST_AUTO_TEST_CASE(stored_entry_with_differing_sizes) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  PatchLE(&bytes, lay.central_offsets[0] + 20, 5, 4);  // compressed size 5, uncompressed 12
  Opened o(bytes);
  CheckCorruption(o, "stored entry 'arch/data.pkl' has different compressed and uncompressed sizes");
}

BOOST_AUTO_TEST_CASE(duplicate_names) {
  ZipBuilder b;
  b.Add(ZipEntrySpec("x/a", "1"));
  b.Add(ZipEntrySpec("x/a", "2"));
  Opened o(b.Build());
  CheckCorruption(o, "duplicate entry name 'x/a'");
}

BOOST_AUTO_TEST_CASE(duplicate_names_in_a_hashed_directory) {
  // Past 16 entries names are found through a hash table, which must see duplicates too.
  ZipBuilder b;
  for (int i = 0; i < 40; ++i) b.Add(ZipEntrySpec("x/data/" + std::to_string(i), "1"));
  b.Add(ZipEntrySpec("x/data/17", "2"));
  Opened o(b.Build());
  CheckCorruption(o, "duplicate entry name 'x/data/17'");
}

BOOST_AUTO_TEST_CASE(directory_larger_than_a_read_window_is_read_whole) {
  // The central directory is read 1 MiB at a time: 30,000 entries (~1.8 MiB of directory)
  // have entries straddling window edges, and one 60,000-byte name needs a window of its own.
  ZipBuilder b;
  const int kEntries = 30000;
  const std::string long_name = "big/" + std::string(60000, 'n');
  for (int i = 0; i < kEntries; ++i) {
    b.Add(ZipEntrySpec("big/data/" + std::to_string(i), i % 7 == 0 ? "abc" : ""));
    if (i == kEntries / 2) b.Add(ZipEntrySpec(long_name, "long"));
  }
  ZipLayout lay;
  const std::string bytes = b.Build(true, "", &lay);
  BOOST_REQUIRE_GT(lay.cd_size, 1u << 20);
  Opened o(bytes);
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());
  // Moved, the archive's entries keep viewing valid names.
  ZipArchive zip = std::move(o.zip);
  const auto& entries = zip.entries();
  BOOST_REQUIRE_EQUAL(entries.size(), static_cast<size_t>(kEntries + 1));
  size_t k = 0;
  for (int i = 0; i < kEntries; ++i, ++k) {
    if (i == kEntries / 2 + 1) {
      BOOST_TEST(entries[k].name == long_name);
      BOOST_TEST(zip.Find(long_name) == &entries[k]);
      ++k;
    }
    const std::string name = "big/data/" + std::to_string(i);
    BOOST_REQUIRE(entries[k].name == name);
    BOOST_REQUIRE(zip.Find(name) == &entries[k]);
    BOOST_REQUIRE_EQUAL(entries[k].uncompressed_size, i % 7 == 0 ? 3u : 0u);
    BOOST_REQUIRE_EQUAL(entries[k].local_header_offset, lay.local_header_offsets[k]);
  }
  BOOST_TEST(zip.Find("big/data/30000") == nullptr);
  BOOST_TEST(zip.Find("big/data/") == nullptr);
  BOOST_TEST(zip.Find("") == nullptr);
}

BOOST_AUTO_TEST_CASE(directory_truncated_inside_a_later_window) {
  // The entry count promises more entries than the directory's bytes hold: the shortfall
  // is found in the last window read, not at the start.
  ZipBuilder b;
  for (int i = 0; i < 30000; ++i) b.Add(ZipEntrySpec("big/data/" + std::to_string(i), ""));
  ZipLayout lay;
  std::string bytes = b.Build(true, "", &lay);
  // Claim one entry fewer bytes of directory than there are: the last entry is cut.
  PatchLE(&bytes, lay.zip64_end_offset + 40, lay.cd_size - 10, 8);
  Opened o(bytes);
  CheckCorruption(o, "central directory entry 29999 is truncated");
}

BOOST_AUTO_TEST_CASE(truncated_extra_field_and_short_zip64_block) {
  ZipBuilder b;
  // An extra block header claiming 200 bytes of body, with 4 present.
  b.Add(ZipEntrySpec("x/a", "1").CentralExtra(LE16(0x7075) + LE16(200) + "abcd"));
  Opened o(b.Build());
  CheckCorruption(o, "entry 'x/a' has a truncated extra field");

  // Saturated sizes but a zip64 block holding only one of the two 8-byte values.
  ZipLayout lay;
  ZipBuilder b2;
  b2.Add(ZipEntrySpec("x/b", "12345678").CentralExtra(LE16(0x0001) + LE16(8) + LE64(8)));
  std::string bytes = b2.Build(false, "", &lay);
  PatchLE(&bytes, lay.central_offsets[0] + 20, 0xFFFFFFFF, 4);
  PatchLE(&bytes, lay.central_offsets[0] + 24, 0xFFFFFFFF, 4);
  Opened o2(bytes);
  CheckCorruption(o2, "entry 'x/b' has a short zip64 field");
}

BOOST_AUTO_TEST_CASE(local_header_with_bad_signature) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  bytes[lay.local_header_offsets[1]] = 'Q';
  Opened o(bytes);
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());  // only the central directory is read
  const ZipEntry* e = o.zip.Find("arch/data/0");
  BOOST_REQUIRE(e);
  uint64_t off = 0;
  Status s = o.zip.DataOffset(*e, &off);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kCorruption));
  BOOST_TEST(s.message() == o.path + ": local header of 'arch/data/0' has a bad signature");
  std::string data;
  BOOST_TEST(!o.zip.ReadStored(*e, 1000, &data).ok());
  // The other entries are unaffected.
  BOOST_TEST(o.zip.ReadStored(*o.zip.Find("arch/data.pkl"), 100, &data).ok());
}

BOOST_AUTO_TEST_CASE(local_extra_running_past_eof) {
  ZipLayout lay;
  std::string bytes = ThreeEntries(&lay);
  PatchLE(&bytes, lay.local_header_offsets[2] + 28, 0xFFFF, 2);  // local extra length
  Opened o(bytes);
  BOOST_REQUIRE(o.status.ok());
  uint64_t off = 0;
  Status s = o.zip.DataOffset(*o.zip.Find("arch/empty"), &off);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kCorruption));
  BOOST_TEST(Contains(s.message(), "data of 'arch/empty' extends past the end of the file"), s.message());
}

BOOST_AUTO_TEST_CASE(encrypted_entry_is_not_supported) {
  ZipBuilder b;
  b.Add(ZipEntrySpec("x/plain", "ok"));
  b.Add(ZipEntrySpec("x/secret", "0123456789ab").Flags(0x0001));
  Opened o(b.Build());
  BOOST_TEST(static_cast<int>(o.status.code()) == static_cast<int>(Status::Code::kNotSupported));
  BOOST_TEST(o.status.message() == o.path + ": entry 'x/secret' is encrypted");
}

BOOST_AUTO_TEST_CASE(read_stored_on_a_deflated_entry_is_not_supported) {
  ZipBuilder b;
  // The payload need not be real deflate data: the reader must refuse before inflating.
  b.Add(ZipEntrySpec("x/deflated", std::string("\x4b\x4c\x4a\x06\x00", 5)).Method(8, 3));
  Opened o(b.Build(true));
  BOOST_REQUIRE_MESSAGE(o.status.ok(), o.status.message());
  const ZipEntry& e = o.zip.entries().at(0);
  BOOST_TEST(e.method == 8);
  BOOST_TEST(e.compressed_size == 5u);
  BOOST_TEST(e.uncompressed_size == 3u);
  std::string data;
  Status s = o.zip.ReadStored(e, 1000, &data);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kNotSupported));
  BOOST_TEST(StartsWith(s.message(), o.path + ": record 'x/deflated' is compressed (method 8)"), s.message());
}

// ---- archives inside a larger file ----------------------------------------------------------

namespace {

// `n` bytes holding zip signatures, to mislead a reader that looks outside its window.
std::string Junk(size_t n) { return ("PK\x05\x06PK\x01\x02PK\x03\x04" + PatternBytes(n, 77)).substr(0, n); }

// `archive` at byte `base` of an in-memory file, with junk before and after it.
struct Embedded {
  MemorySource source;
  ckptfs::SourceFiles files{source.env()};
  ckptfs::FileWindow window;

  Embedded(const std::string& archive, uint64_t base, size_t junk_after = 333) {
    const std::string bytes = Junk(base) + archive + Junk(junk_after);
    uint32_t index = 0;
    BOOST_REQUIRE(files.Add(source.Write("/mem/big.bin", bytes), &index).ok());
    window = ckptfs::FileWindow{index, base, archive.size()};
  }
};

}  // namespace

BOOST_AUTO_TEST_CASE(archive_in_a_window_reports_offsets_in_the_file) {
  for (bool zip64 : {false, true}) {
    ZipLayout lay;
    const std::string archive = ThreeEntries(&lay, zip64);
    Embedded e(archive, 1001);
    ZipArchive zip;
    Status s = zip.Open(e.files, e.window);
    BOOST_TEST_CONTEXT("zip64 " << zip64) {
      BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
      BOOST_REQUIRE_EQUAL(zip.entries().size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        uint64_t off = 0;
        BOOST_REQUIRE(zip.DataOffset(zip.entries()[i], &off).ok());
        BOOST_TEST(off == 1001 + lay.data_offsets[i]);
      }
      std::string data;
      BOOST_REQUIRE(zip.ReadStored(*zip.Find("arch/data/0"), 1000, &data).ok());
      BOOST_TEST(data == PatternBytes(100, 1));
    }
  }
}

BOOST_AUTO_TEST_CASE(archive_claiming_bytes_past_its_window_is_refused) {
  // A record whose sizes claim the junk after the window: inside the file, outside the
  // archive.
  ZipLayout lay;
  std::string archive = ThreeEntries(&lay);
  PatchLE(&archive, lay.central_offsets[2] + 20, 4000, 4);  // compressed size of arch/empty
  PatchLE(&archive, lay.central_offsets[2] + 24, 4000, 4);  // uncompressed size
  Embedded e(archive, 77, 5000);
  ZipArchive zip;
  Status s = zip.Open(e.files, e.window);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kCorruption));
  const std::string where = "/mem/big.bin [bytes 77.." + std::to_string(77 + archive.size()) + ")";
  BOOST_TEST(s.message() == where + ": entry 'arch/empty' extends past the end of the file", s.message());
}

BOOST_AUTO_TEST_CASE(window_past_the_end_of_the_file_is_refused) {
  Embedded e(ThreeEntries(nullptr), 10, 0);
  ZipArchive zip;
  Status s = zip.Open(e.files, ckptfs::FileWindow{e.window.file, e.window.base, e.window.length + 1});
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kCorruption));
  BOOST_TEST(Contains(s.message(), "archive window extends past the end of the file"), s.message());
  s = zip.Open(e.files, ckptfs::FileWindow{e.window.file, UINT64_MAX, 2});
  BOOST_TEST(Contains(s.message(), "archive window extends past the end of the file"), s.message());
}
