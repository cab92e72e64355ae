// The safetensors reader on generated files: a valid one, and one file per header rule
// of the reference implementation (doc/FORMATS.md, "safetensors").
#define BOOST_TEST_MODULE safetensors_test
#include <boost/test/unit_test.hpp>

#include "ckptfs/catalog.hpp"
#include "codec/safetensors_header.hpp"
#include "format/readers.hpp"
#include "test_util.hpp"

using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::Status;
using json = nlohmann::json;
using namespace ckptfs_test;

namespace {

// Puts `bytes` in an in-memory file and reads it with ReadSafetensorsFile.
struct Read {
  MemorySource source;
  std::string path = "/mem/model.safetensors";
  Catalog catalog;
  json metadata;
  Status status;
  explicit Read(const std::string& bytes) {
    source.Write(path, bytes);
    source.Attach(&catalog);
    status = ckptfs::ReadSafetensorsFile(path, &catalog, &metadata);
  }
};

void CheckCorrupt(const std::string& bytes, std::string_view part) {
  Read r(bytes);
  BOOST_TEST(!r.status.ok());
  BOOST_TEST(static_cast<int>(r.status.code()) == static_cast<int>(Status::Code::kCorruption), r.status.message());
  BOOST_TEST(StartsWith(r.status.message(), r.path + ": safetensors: "), r.status.message());
  BOOST_TEST(Contains(r.status.message(), part), r.status.message());
  BOOST_TEST(r.catalog.tensors.empty());
}

// One header entry.
json Entry(const char* dtype, std::vector<uint64_t> shape, uint64_t begin, uint64_t end) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

std::string File(const json& header, size_t data_size) {
  return SafetensorsBytes(header.dump(), PatternBytes(data_size, 3));
}

}  // namespace

BOOST_AUTO_TEST_CASE(valid_file) {
  json h;
  h["__metadata__"] = {{"format", "pt"}, {"note", "hi"}};
  // Keys in JSON order differ from offset order; the catalog follows offsets.
  h["a.weight"] = Entry("F32", {2}, 12, 20);
  h["b"] = Entry("F16", {2, 3}, 0, 12);
  h["c.count"] = Entry("I64", {}, 20, 28);
  h["d.empty"] = Entry("BF16", {0, 4}, 28, 28);
  h["e.mask"] = Entry("BOOL", {3}, 28, 31);
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the reference writer's padding
  const std::string data = PatternBytes(31, 7);
  Read r(SafetensorsBytes(text, data));
  BOOST_REQUIRE_MESSAGE(r.status.ok(), r.status.message());
  BOOST_TEST(r.metadata == json({{"format", "pt"}, {"note", "hi"}}));
  const uint64_t base = 8 + text.size();
  const auto& ts = r.catalog.tensors;
  BOOST_REQUIRE_EQUAL(ts.size(), 5u);
  struct Want { const char* key; DType dtype; std::vector<uint64_t> shape; uint64_t begin, end; };
  const Want want[] = {{"b", DType::kF16, {2, 3}, 0, 12},
                       {"a.weight", DType::kF32, {2}, 12, 20},
                       {"c.count", DType::kI64, {}, 20, 28},
                       {"d.empty", DType::kBF16, {0, 4}, 28, 28},
                       {"e.mask", DType::kBool, {3}, 28, 31}};
  for (size_t i = 0; i < 5; ++i) {
    BOOST_TEST_CONTEXT("tensor " << want[i].key) {
      BOOST_TEST(ts[i].key == want[i].key);
      BOOST_TEST(ts[i].path.size() == 1u);
      BOOST_TEST((ts[i].dtype == want[i].dtype));
      BOOST_TEST(ts[i].shape == want[i].shape, boost::test_tools::per_element());
      BOOST_TEST(ckptfs::StoredAsExtents(ts[i]));
      BOOST_TEST(ts[i].nbytes() == want[i].end - want[i].begin);
      const std::vector<ckptfs::Extent> extents = ckptfs::ExtentsOf(ts[i]);
      if (want[i].end == want[i].begin) {
        BOOST_TEST(ts[i].boxes.empty());
      } else {
        BOOST_REQUIRE_EQUAL(extents.size(), 1u);
        BOOST_TEST(extents[0].offset == base + want[i].begin);
        BOOST_TEST(extents[0].length == want[i].end - want[i].begin);
        std::string got(extents[0].length, '\0');
        BOOST_REQUIRE(r.catalog.files->ReadExact(0, extents[0].offset, got.size(), got.data()).ok());
        BOOST_TEST(got == data.substr(want[i].begin, want[i].end - want[i].begin));
      }
    }
  }
}

// F4 headers count float4 values, two a byte; the catalog holds torch's float4_e2m1fn_x2 shape
// (bytes), so the last dimension is halved, and the byte span is checked against that.
BOOST_AUTO_TEST_CASE(f4_shapes_count_values) {
  json h;
  h["f4"] = Entry("F4", {3, 8}, 0, 12);
  h["e8"] = Entry("F8_E8M0", {4}, 12, 16);
  Read r(File(h, 16));
  BOOST_REQUIRE_MESSAGE(r.status.ok(), r.status.message());
  BOOST_REQUIRE_EQUAL(r.catalog.tensors.size(), 2u);
  const auto& f4 = r.catalog.tensors[0];
  BOOST_TEST((f4.dtype == DType::kF4x2));
  BOOST_TEST(f4.shape == std::vector<uint64_t>({3, 4}), boost::test_tools::per_element());
  BOOST_TEST(f4.nbytes() == 12u);
  BOOST_TEST((r.catalog.tensors[1].dtype == DType::kF8_E8M0));

  json odd;
  odd["f4"] = Entry("F4", {2, 3}, 0, 3);
  CheckCorrupt(File(odd, 3), "tensor 'f4' of dtype F4 needs an even last dimension");
  json scalar;
  scalar["f4"] = Entry("F4", {}, 0, 1);
  CheckCorrupt(File(scalar, 1), "tensor 'f4' of dtype F4 needs an even last dimension");
  json counted_as_bytes;  // a writer that put torch's shape in the header
  counted_as_bytes["f4"] = Entry("F4", {2, 4}, 0, 8);
  CheckCorrupt(File(counted_as_bytes, 8), "tensor 'f4' spans 8 bytes but its dtype and shape need 4");
}

BOOST_AUTO_TEST_CASE(open_catalog_detects_safetensors) {
  json h;
  h["x"] = Entry("U8", {4}, 0, 4);
  MemorySource source;
  const std::string path = source.Write("/mem/x.safetensors", File(h, 4));
  std::shared_ptr<const Catalog> c;
  Status s = source.OpenCatalog(path, &c);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(c->format == "safetensors");
  BOOST_TEST(c->tensors.at(0).key == "x");
  BOOST_TEST(c->metadata == json::object());  // no __metadata__
}

BOOST_AUTO_TEST_CASE(empty_header_and_no_tensors) {
  Read r(SafetensorsBytes("{}      ", ""));
  BOOST_REQUIRE_MESSAGE(r.status.ok(), r.status.message());
  BOOST_TEST(r.catalog.tensors.empty());
}

BOOST_AUTO_TEST_CASE(shorter_than_the_length_prefix) {
  CheckCorrupt("\x02\x00\x00", "shorter than its 8-byte header length");
}

BOOST_AUTO_TEST_CASE(header_length_above_the_limit) {
  // Past the limit the length is refused before anything is read or allocated.
  // safetensors' own limit is the default; a limit is a refusal that says how to raise it.
  for (uint64_t len : {uint64_t{100'000'001}, ~uint64_t{0}}) {
    Read r(LE64(len) + "{}");
    BOOST_TEST(static_cast<int>(r.status.code()) == static_cast<int>(Status::Code::kRefused), r.status.message());
    BOOST_TEST(Contains(r.status.message(), "header length " + std::to_string(len) +
                                                " exceeds the limit of 100000000 bytes"),
               r.status.message());
    BOOST_TEST(r.status.limit_option() == "max_header");
  }
  // A smaller limit applies to headers that would otherwise be fine.
  ckptfs::ReadLimits small;
  small.header_bytes = 8;
  MemorySource source;
  const std::string path = source.Write("/mem/small.safetensors", File(json{{"w", Entry("F32", {1}, 0, 4)}}, 4));
  Catalog catalog;
  source.Attach(&catalog);
  json metadata;
  Status s = ckptfs::ReadSafetensorsFile(path, &catalog, &metadata, small);
  BOOST_TEST(Contains(s.message(), "exceeds the limit of 8 bytes"), s.message());
}

BOOST_AUTO_TEST_CASE(header_length_past_eof) {
  CheckCorrupt(LE64(100) + "{\"a\":1}", "header length 100 runs past the end of the file");
  CheckCorrupt(LE64(100'000'000) + "{}", "runs past the end of the file");  // at the limit itself
}

BOOST_AUTO_TEST_CASE(header_not_json) {
  CheckCorrupt(SafetensorsBytes("{\"a\": [1, 2", ""), "header is not a JSON object");
  CheckCorrupt(SafetensorsBytes("[1, 2, 3]", ""), "header is not a JSON object");
  CheckCorrupt(SafetensorsBytes("\xff\xfe{}", ""), "header is not a JSON object");
}

// A repeated key anywhere (top level, inside a tensor's entry, inside __metadata__) is
// refused by name, and only once the whole text has been found to be JSON.
BOOST_AUTO_TEST_CASE(repeated_keys) {
  const std::string a = R"("a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})";
  CheckCorrupt(SafetensorsBytes("{" + a + ", " + a + "}", PatternBytes(4, 3)), "key 'a' appears twice in the header");
  CheckCorrupt(SafetensorsBytes(R"({"a": {"dtype": "F32", "dtype": "F64", "shape": [1], "data_offsets": [0, 4]}})",
                                PatternBytes(4, 3)),
               "key 'dtype' appears twice in the header");
  CheckCorrupt(SafetensorsBytes(R"({"__metadata__": {"k": "1", "k": "2"}, )" + a + "}", PatternBytes(4, 3)),
               "key 'k' appears twice in the header");
  // Inside a value of a repeated key, and in objects nested in arrays.
  CheckCorrupt(SafetensorsBytes(R"({"x": [{"y": 1}, {"z": {"w": 1, "w": 2}}], )" + a + "}", PatternBytes(4, 3)),
               "key 'w' appears twice in the header");
  CheckCorrupt(SafetensorsBytes(R"({"x": 1, "x": {"v": 1, "v": 2}})", ""), "key 'x' appears twice in the header");
  // The first repetition in the text is named, at whatever depth.
  CheckCorrupt(SafetensorsBytes(R"({"x": {"v": 1, "v": 2}, "x": 1})", ""), "key 'v' appears twice in the header");
  CheckCorrupt(SafetensorsBytes(R"({"b": 1, "a": 1, "b": 2, "a": 2, "a": 3})", ""), "key 'b' appears twice in the header");
  // Not JSON after the repeated key: that is what is reported.
  CheckCorrupt(SafetensorsBytes(R"({"x": 1, "x": 2, )", ""), "header is not a JSON object");
  CheckCorrupt(SafetensorsBytes(R"([{"x": 1, "x": 2}])", ""), "header is not a JSON object");
  // The same key in two objects is no repetition.
  Read r(SafetensorsBytes(R"({"__metadata__": {"dtype": "x"}, )" + a + "}", PatternBytes(4, 3)));
  BOOST_TEST(r.status.ok(), r.status.message());
  BOOST_TEST(r.catalog.tensors.size() == 1u);
}

BOOST_AUTO_TEST_CASE(unknown_dtype) {
  json h;
  h["a"] = Entry("F12", {1}, 0, 4);
  CheckCorrupt(File(h, 4), "tensor 'a' has an unknown dtype \"F12\"");
  h["a"] = Entry("float32", {1}, 0, 4);  // torch's name is not a safetensors name
  CheckCorrupt(File(h, 4), "unknown dtype");
}

BOOST_AUTO_TEST_CASE(malformed_entries) {
  json h;
  h["a"] = {{"dtype", "F32"}, {"shape", {1}}};
  CheckCorrupt(File(h, 4), "tensor 'a' lacks dtype, shape or data_offsets");
  h["a"] = Entry("F32", {1}, 0, 4);
  h["a"]["shape"] = {-1};
  CheckCorrupt(File(h, 4), "tensor 'a' has a malformed shape");
  h["a"] = Entry("F32", {1}, 4, 0);
  CheckCorrupt(File(h, 4), "tensor 'a' has malformed data_offsets");
  h["a"] = Entry("F32", {1}, 0, 4);
  h["a"]["data_offsets"] = {0, 4, 8};
  CheckCorrupt(File(h, 4), "tensor 'a' has malformed data_offsets");
  h["a"] = Entry("F32", {1ull << 40, 1ull << 40}, 0, 4);
  CheckCorrupt(File(h, 4), "tensor 'a' shape overflows");
}

BOOST_AUTO_TEST_CASE(overlapping_offsets) {
  json h;
  h["a"] = Entry("F32", {2}, 0, 8);
  h["b"] = Entry("F32", {2}, 4, 12);
  CheckCorrupt(File(h, 12), "tensor 'b' starts at 4, overlapping the previous tensor (expected 8)");
}

BOOST_AUTO_TEST_CASE(gap_between_tensors) {
  json h;
  h["a"] = Entry("F32", {2}, 0, 8);
  h["b"] = Entry("F32", {2}, 12, 20);
  CheckCorrupt(File(h, 20), "tensor 'b' starts at 12, leaving a gap after the previous tensor (expected 8)");
  json first;
  first["a"] = Entry("F32", {1}, 4, 8);
  CheckCorrupt(File(first, 8), "tensor 'a' starts at 4");
}

BOOST_AUTO_TEST_CASE(trailing_bytes_or_short_buffer) {
  json h;
  h["a"] = Entry("F32", {2}, 0, 8);
  CheckCorrupt(File(h, 9), "tensors cover 8 bytes but the data buffer holds 9");
  CheckCorrupt(File(h, 7), "tensors cover 8 bytes but the data buffer holds 7");
}

BOOST_AUTO_TEST_CASE(nbytes_mismatch) {
  json h;
  h["a"] = Entry("F32", {2, 2}, 0, 12);
  CheckCorrupt(File(h, 12), "tensor 'a' spans 12 bytes but its dtype and shape need 16");
}

BOOST_AUTO_TEST_CASE(metadata_values_must_be_strings) {
  json h;
  h["__metadata__"] = {{"format", "pt"}, {"step", 3}};
  h["a"] = Entry("F32", {1}, 0, 4);
  CheckCorrupt(File(h, 4), "__metadata__ value of 'step' is not a string");
  h["__metadata__"] = json::array({"pt"});
  CheckCorrupt(File(h, 4), "__metadata__ is not an object");
}

// A blob inside a larger file (DCP's safetensors serialization appends one to a .distcp after
// other bytes): parsed on its window, offsets are the file's, messages name the window.
BOOST_AUTO_TEST_CASE(blob_in_a_window) {
  json h;
  h["__metadata__"] = {{"format", "pt"}};
  h["x"] = Entry("F32", {2, 2}, 0, 16);
  h["y"] = Entry("I64", {1}, 16, 24);
  const std::string blob = File(h, 24);
  const std::string prefix(100, 'p');
  MemorySource source;
  const std::string path = source.Write("/mem/__0_0.distcp", prefix + blob);
  ckptfs::SourceFiles files(source.env());
  uint32_t file;
  BOOST_TEST_REQUIRE(files.Add(path, &file).ok());
  const ckptfs::FileWindow window{file, prefix.size(), blob.size()};
  BOOST_TEST(ckptfs::LooksLikeSafetensors(files, window));
  BOOST_TEST(!ckptfs::LooksLikeSafetensors(files, ckptfs::FileWindow{file, 0, prefix.size() + blob.size()}));
  ckptfs::SafetensorsHeader header;
  Status s = ckptfs::ParseSafetensorsHeader(files, window, ckptfs::ReadLimits{}, &header);
  BOOST_TEST_REQUIRE(s.ok(), s.message());
  BOOST_TEST_REQUIRE(header.tensors.size() == 2u);
  const uint64_t data_start = prefix.size() + blob.size() - 24;
  BOOST_TEST(header.tensors[0].key == "x");
  BOOST_TEST(header.tensors[0].data_offset == data_start);
  BOOST_TEST(header.tensors[0].nbytes == 16u);
  BOOST_TEST(header.tensors[1].key == "y");
  BOOST_TEST(header.tensors[1].data_offset == data_start + 16);
  BOOST_TEST(header.metadata["format"] == "pt");

  // One byte more in the window: trailing bytes after the tensors, named by the window.
  source.Write(path, prefix + blob + "z");
  ckptfs::SourceFiles files2(source.env());
  BOOST_TEST_REQUIRE(files2.Add(path, &file).ok());
  s = ckptfs::ParseSafetensorsHeader(files2, ckptfs::FileWindow{file, prefix.size(), blob.size() + 1},
                                     ckptfs::ReadLimits{}, &header);
  BOOST_TEST(!s.ok());
  BOOST_TEST(StartsWith(s.message(), path + " [bytes 100.."), s.message());
  BOOST_TEST(Contains(s.message(), "tensors cover 24 bytes but the data buffer holds 25"), s.message());
}
