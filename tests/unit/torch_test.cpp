// The torch.save reader: the real sample checkpoint (tests/data/make_sample.py, written by
// torch.save), corrupted copies of it, and small torch-style archives built by hand for
// the cases the sample lacks (strided tensors, storage offsets, refused globals).
#define BOOST_TEST_MODULE torch_test
#include <boost/test/unit_test.hpp>

#include <cstring>
#include <functional>
#include <random>
#include <set>

#include "ckptfs/catalog.hpp"
#include "format/readers.hpp"
#include "format/torch/rank_shards.hpp"
#include "test_util.hpp"

using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::PathElement;
using ckptfs::Status;
using namespace ckptfs_test;

namespace {

const std::string kSample = CKPTFS_TEST_DATA "/sample-mlp-training.pt";
constexpr uint64_t kSampleSize = 16963;

struct Expected {
  const char* key;
  std::vector<uint64_t> shape;
  uint64_t data_offset;  // of record data/<n> in the sample (Python zipfile + local header)
  const char* storage;   // record key
};

// Catalog order is pickle order: the state_dict, then Adam's state per parameter.
const std::vector<Expected>& SampleTensors() {
  static const std::vector<Expected> kTensors = {
      {"model.0.weight", {32, 16}, 2560, "0"},
      {"model.0.bias", {32}, 4736, "1"},
      {"model.1.weight", {32}, 4992, "2"},
      {"model.1.bias", {32}, 5248, "3"},
      {"model.2.weight", {4, 32}, 5504, "4"},
      {"model.2.bias", {4}, 6144, "5"},
      {"optimizer.state.0.step", {}, 6272, "6"},
      {"optimizer.state.0.exp_avg", {32, 16}, 6400, "7"},
      {"optimizer.state.0.exp_avg_sq", {32, 16}, 8576, "8"},
      {"optimizer.state.1.step", {}, 10752, "9"},
      {"optimizer.state.1.exp_avg", {32}, 10880, "10"},
      {"optimizer.state.1.exp_avg_sq", {32}, 11136, "11"},
      {"optimizer.state.2.step", {}, 11392, "12"},
      {"optimizer.state.2.exp_avg", {32}, 11520, "13"},
      {"optimizer.state.2.exp_avg_sq", {32}, 11776, "14"},
      {"optimizer.state.3.step", {}, 12032, "15"},
      {"optimizer.state.3.exp_avg", {32}, 12160, "16"},
      {"optimizer.state.3.exp_avg_sq", {32}, 12416, "17"},
      {"optimizer.state.4.step", {}, 12672, "18"},
      {"optimizer.state.4.exp_avg", {4, 32}, 12800, "19"},
      {"optimizer.state.4.exp_avg_sq", {4, 32}, 13440, "20"},
      {"optimizer.state.5.step", {}, 14080, "21"},
      {"optimizer.state.5.exp_avg", {4}, 14208, "22"},
      {"optimizer.state.5.exp_avg_sq", {4}, 14336, "23"},
  };
  return kTensors;
}

std::shared_ptr<const Catalog> MustOpen(const std::string& path) {
  std::shared_ptr<const Catalog> catalog;
  Status s = ckptfs::OpenCatalog(path, &catalog);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return catalog;
}

void CheckError(const Status& s, const std::string& path, Status::Code code, std::string_view part) {
  BOOST_TEST(!s.ok());
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(code), s.message());
  BOOST_TEST(StartsWith(s.message(), path + ": "), s.message());
  BOOST_TEST(Contains(s.message(), part), s.message());
}

float ReadF32(const Catalog& c, uint64_t offset) {
  float f = 0;
  Status s = c.files->ReadExact(0, offset, sizeof f, &f);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return f;
}

}  // namespace

BOOST_AUTO_TEST_CASE(sample_tensors_keys_dtypes_shapes_extents) {
  auto c = MustOpen(kSample);
  BOOST_TEST(c->format == "torch-zip");
  BOOST_TEST(c->source == kSample);
  BOOST_REQUIRE_EQUAL(c->files->count(), 1u);
  BOOST_TEST(c->files->size(0) == kSampleSize);
  BOOST_TEST(c->sibling_files.empty());
  const auto& expected = SampleTensors();
  BOOST_REQUIRE_EQUAL(c->tensors.size(), expected.size());
  uint64_t total = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& t = c->tensors[i];
    const Expected& e = expected[i];
    BOOST_TEST_CONTEXT("tensor " << e.key) {
      BOOST_TEST(t.key == e.key);
      BOOST_TEST((t.dtype == DType::kF32));
      BOOST_TEST(t.shape == e.shape, boost::test_tools::per_element());
      BOOST_TEST(ckptfs::StoredAsExtents(t));
      const std::vector<ckptfs::Extent> extents = ckptfs::ExtentsOf(t);
      BOOST_REQUIRE_EQUAL(extents.size(), 1u);
      BOOST_TEST(extents[0].file == 0u);
      BOOST_TEST(extents[0].offset == e.data_offset);
      BOOST_TEST(extents[0].length == t.nbytes());
      BOOST_TEST(t.storage_id == std::string("0:0:") + e.storage);
      total += t.nbytes();
    }
  }
  BOOST_TEST(total == 8904u);
  BOOST_TEST(c->tensors[0].nbytes() == 2048u);
  BOOST_TEST(c->tensors[6].numel() == 1u);  // a 0-d tensor has one element
}

BOOST_AUTO_TEST_CASE(sample_tensor_paths_keep_key_types) {
  auto c = MustOpen(kSample);
  // state_dict keys are strings with dots; Adam's state is keyed by int parameter ids.
  const std::vector<PathElement> model0 = {std::string("model"), std::string("0.weight")};
  BOOST_TEST((c->tensors[0].path == model0));
  const std::vector<PathElement> exp_avg = {std::string("optimizer"), std::string("state"), int64_t{0},
                                            std::string("exp_avg")};
  BOOST_TEST((c->tensors[7].path == exp_avg));
  BOOST_TEST(ckptfs::FlattenKey(exp_avg) == "optimizer.state.0.exp_avg");
}

BOOST_AUTO_TEST_CASE(sample_tensor_bytes_are_the_saved_values) {
  auto c = MustOpen(kSample);
  // Values printed by torch.load of the sample (first element, little-endian hex).
  uint32_t bits = 0;
  float w = ReadF32(*c, c->tensors[0].boxes[0].base_offset);
  std::memcpy(&bits, &w, 4);
  BOOST_TEST(bits == 0xbb7a3998u);  // model.0.weight[0, 0]
  // LayerNorm weight after two Adam steps from 1.0, and Adam's step counter 2.0.
  float ln = ReadF32(*c, c->tensors[2].boxes[0].base_offset);
  std::memcpy(&bits, &ln, 4);
  BOOST_TEST(bits == 0x3f801194u);
  for (size_t i : {6, 9, 12, 15, 18, 21}) BOOST_TEST(ReadF32(*c, c->tensors[i].boxes[0].base_offset) == 2.0f);
}

BOOST_AUTO_TEST_CASE(sample_metadata) {
  auto c = MustOpen(kSample);
  const nlohmann::json& m = c->metadata;
  BOOST_TEST(m["epoch"] == 3);
  BOOST_TEST(m["step"] == 200);
  BOOST_TEST(m["config"]["name"] == "demo");
  BOOST_TEST(m["config"]["lr"].get<double>() == 1e-3);
  // Containers that held only tensors are left out of the metadata.
  BOOST_TEST(!m.contains("model"));
  BOOST_TEST(!m["optimizer"].contains("state"));
  const nlohmann::json& group = m["optimizer"]["param_groups"].at(0);
  BOOST_TEST(group["params"] == nlohmann::json({0, 1, 2, 3, 4, 5}));
  BOOST_TEST(group["betas"] == nlohmann::json({0.9, 0.999}));
  BOOST_TEST(group["eps"].get<double>() == 1e-8);
  BOOST_TEST(group["amsgrad"] == false);
  BOOST_TEST(group["foreach"].is_null());
  BOOST_TEST(group["weight_decay"] == 0);
  BOOST_TEST(m.size() == 4u);  // config, epoch, optimizer, step
}

// ---- corrupted copies of the sample -------------------------------------------------------

BOOST_AUTO_TEST_CASE(truncated_copies_fail_with_the_path) {
  const std::string full = ReadFile(kSample);
  BOOST_REQUIRE_EQUAL(full.size(), kSampleSize);
  MemorySource source;
  std::vector<size_t> lengths = {0, 1, 3, 4, 8, 9, 21, 22, 30, 64, 65, 100, 2046, 2560, 8000,
                                 full.size() - 98, full.size() - 42, full.size() - 23, full.size() - 22,
                                 full.size() - 21, full.size() - 1};
  for (size_t n = 7; n < full.size(); n += 211) lengths.push_back(n);
  for (size_t n : lengths) {
    const std::string path = source.Write("/mem/cut-" + std::to_string(n) + ".pt", std::string_view(full).substr(0, n));
    std::shared_ptr<const Catalog> c;
    Status s = source.OpenCatalog(path, &c);
    BOOST_TEST_CONTEXT("truncated to " << n) {
      BOOST_TEST(!s.ok());
      BOOST_TEST(StartsWith(s.message(), path + ": "), s.message());
      BOOST_TEST(c == nullptr);
    }
  }
}

BOOST_AUTO_TEST_CASE(flipped_eocd_signature) {
  std::string bytes = ReadFile(kSample);
  bytes[bytes.size() - 22] ^= 0xff;  // 'P' of PK\5\6
  MemorySource source;
  const std::string path = source.Write("/mem/eocd.pt", bytes);
  std::shared_ptr<const Catalog> c;
  CheckError(source.OpenCatalog(path, &c), path, Status::Code::kCorruption, "no end-of-central-directory record");
}

BOOST_AUTO_TEST_CASE(data_pkl_with_an_unknown_opcode) {
  std::string bytes = ReadFile(kSample);
  // data.pkl is the first record; its data starts at byte 64 with PROTO 2.
  BOOST_REQUIRE_EQUAL(static_cast<uint8_t>(bytes[64]), 0x80);
  MemorySource source;
  {
    std::string b = bytes;
    b[64] = '\xff';
    const std::string path = source.Write("/mem/op0.pt", b);
    std::shared_ptr<const Catalog> c;
    Status s = source.OpenCatalog(path, &c);
    CheckError(s, path, Status::Code::kCorruption, "unknown opcode 0xff at byte 0");
    BOOST_TEST(Contains(s.message(), "data.pkl"), s.message());
  }
  {
    std::string b = bytes;
    b[64 + 5] = '\xff';  // the MARK after `}q\0`
    const std::string path = source.Write("/mem/op5.pt", b);
    std::shared_ptr<const Catalog> c;
    CheckError(source.OpenCatalog(path, &c), path, Status::Code::kCorruption, "unknown opcode 0xff at byte 5");
  }
}

BOOST_AUTO_TEST_CASE(random_byte_changes_fail_cleanly_or_parse) {
  // Damage in the pickle or the zip directories must end in a Status naming the file,
  // never a crash (run under sanitizers to catch memory errors too).
  const std::string full = ReadFile(kSample);
  const size_t cd_start = 14632;  // after the last record; the central directory follows
  MemorySource source;
  std::mt19937 rng(7);
  for (int i = 0; i < 400; ++i) {
    std::string b = full;
    const size_t pos = i % 2 ? std::uniform_int_distribution<size_t>(64, 64 + 1981)(rng)
                             : std::uniform_int_distribution<size_t>(cd_start, full.size() - 1)(rng);
    b[pos] = static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng));
    const std::string path = source.Write("/mem/flip.pt", b);
    std::shared_ptr<const Catalog> c;
    Status s = source.OpenCatalog(path, &c);
    BOOST_TEST_CONTEXT("byte " << pos << " set to " << int(static_cast<uint8_t>(b[pos]))) {
      if (s.ok()) BOOST_TEST(c != nullptr);
      else BOOST_TEST(StartsWith(s.message(), path + ": "), s.message());
    }
  }
}

BOOST_AUTO_TEST_CASE(missing_file) {
  std::shared_ptr<const Catalog> c;
  const std::string path = CKPTFS_TEST_DATA "/no-such-file.pt";
  CheckError(ckptfs::OpenCatalog(path, &c), path, Status::Code::kNotFound, "cannot access");
}

// ---- hand-built torch archives -------------------------------------------------------------

namespace {

// A torch.save-shaped archive: "arch/data.pkl", "arch/byteorder", then data records,
// stored with FB padding to 64 bytes, data descriptors, and zip64 end records.
std::string TorchZip(const std::string& pickle, const std::vector<std::pair<std::string, std::string>>& records,
                     const std::string& byteorder = "little") {
  ZipBuilder b;
  std::vector<std::pair<std::string, std::string>> all = {{"arch/data.pkl", pickle}, {"arch/byteorder", byteorder}};
  for (const auto& [k, v] : records) all.push_back({"arch/data/" + k, v});
  uint64_t pos = 0;
  for (const auto& [name, data] : all) {
    const uint64_t start = pos + 30 + name.size() + 4;
    const uint16_t pad = static_cast<uint16_t>((64 - start % 64) % 64);
    b.Add(ZipEntrySpec(name, data).Flags(0x0808).LocalExtra(PaddingExtra(pad)).DataDescriptor());
    pos = start + pad + data.size() + 16;
  }
  return b.Build(true);
}

// {"w": <tensor>} as torch pickles a one-entry dict.
std::string OneTensorPickle(std::string_view storage_class, uint32_t numel, uint32_t offset,
                            const std::vector<uint32_t>& size, const std::vector<uint32_t>& stride) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().BinUnicode("w");
  PickleTensor(&p, storage_class, "0", numel, offset, size, stride);
  p.SetItem().Stop();
  return p.bytes();
}

struct Built : BuiltCatalog {
  explicit Built(const std::string& bytes) : BuiltCatalog(bytes, "/mem/built.pt") {}
};

}  // namespace

BOOST_AUTO_TEST_CASE(transposed_tensor_is_strided) {
  const std::string data = PatternBytes(24, 9);
  Built b(TorchZip(OneTensorPickle("FloatStorage", 6, 0, {3, 2}, {1, 3}), {{"0", data}}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 1u);
  const auto& t = b.catalog->tensors[0];
  BOOST_TEST(t.key == "w");
  BOOST_TEST(t.shape == std::vector<uint64_t>({3, 2}), boost::test_tools::per_element());
  BOOST_TEST(!ckptfs::StoredAsExtents(t));
  // One box over the whole shape, with the view's strides.
  BOOST_REQUIRE_EQUAL(t.boxes.size(), 1u);
  const ckptfs::Box& box = t.boxes[0];
  BOOST_TEST(box.offset == std::vector<uint64_t>({0, 0}), boost::test_tools::per_element());
  BOOST_TEST(box.extent == t.shape, boost::test_tools::per_element());
  BOOST_TEST(box.strides == std::vector<uint64_t>({1, 3}), boost::test_tools::per_element());
  // The record's data offset: the bytes there are the record.
  std::string got(24, '\0');
  BOOST_REQUIRE(b.catalog->files->ReadExact(0, box.base_offset, 24, got.data()).ok());
  BOOST_TEST(got == data);
  BOOST_TEST(box.base_offset % 64 == 0u);
}

BOOST_AUTO_TEST_CASE(storage_offset_and_views_of_one_storage) {
  // w = storage[2:6] as 2x2 (contiguous), sharing storage "0" of 8 halfs.
  const std::string data = PatternBytes(16, 4);
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().BinUnicode("a");
  PickleTensor(&p, "HalfStorage", "0", 8, 2, {2, 2}, {2, 1});
  p.BinUnicode("b");
  PickleTensor(&p, "HalfStorage", "0", 8, 0, {8}, {1});
  p.BinUnicode("n").BinInt1(5).SetItems().Stop();
  Built b(TorchZip(p.bytes(), {{"0", data}}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 2u);
  const auto& a = b.catalog->tensors[0];
  const auto& full = b.catalog->tensors[1];
  BOOST_TEST((a.dtype == DType::kF16));
  const std::vector<ckptfs::Extent> a_bytes = ckptfs::ExtentsOf(a), full_bytes = ckptfs::ExtentsOf(full);
  BOOST_REQUIRE_EQUAL(a_bytes.size(), 1u);
  BOOST_REQUIRE_EQUAL(full_bytes.size(), 1u);
  BOOST_TEST(a_bytes[0].offset == full_bytes[0].offset + 4);
  BOOST_TEST(a_bytes[0].length == 8u);
  BOOST_TEST(full_bytes[0].length == 16u);
  BOOST_TEST(a.storage_id == full.storage_id);
  BOOST_TEST(b.catalog->metadata == nlohmann::json({{"n", 5}}));
}

BOOST_AUTO_TEST_CASE(record_size_must_match_the_storage) {
  Built b(TorchZip(OneTensorPickle("FloatStorage", 6, 0, {6}, {1}), {{"0", PatternBytes(20, 1)}}));
  CheckError(b.status, b.path, Status::Code::kCorruption, "record arch/data/0 holds 20 bytes but the pickle says 24");
}

BOOST_AUTO_TEST_CASE(tensor_past_the_end_of_its_storage) {
  Built b(TorchZip(OneTensorPickle("FloatStorage", 6, 1, {3, 2}, {1, 3}), {{"0", PatternBytes(24, 1)}}));
  CheckError(b.status, b.path, Status::Code::kCorruption, "tensor reads past the end of storage '0' (24 bytes)");
}

BOOST_AUTO_TEST_CASE(missing_storage_record) {
  Built b(TorchZip(OneTensorPickle("FloatStorage", 6, 0, {6}, {1}), {}));
  CheckError(b.status, b.path, Status::Code::kCorruption, "no record arch/data/0");
}

BOOST_AUTO_TEST_CASE(big_endian_checkpoint_is_not_supported) {
  Built b(TorchZip(OneTensorPickle("FloatStorage", 1, 0, {1}, {1}), {{"0", "abcd"}}, "big"));
  CheckError(b.status, b.path, Status::Code::kNotSupported, "big-endian");
}

BOOST_AUTO_TEST_CASE(code_running_pickle_is_refused) {
  PickleBuilder p;
  p.Proto(2).Global("os", "system").Mark().BinUnicode("touch /tmp/pwned").Tuple().Reduce().Stop();
  Built b(TorchZip(p.bytes(), {}));
  CheckError(b.status, b.path, Status::Code::kRefused, "os.system");
}

BOOST_AUTO_TEST_CASE(keys_that_flatten_alike_are_not_supported) {
  // {"a.b": t, "a": {"b": t}}: both tensors would be served as "a.b".
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().BinUnicode("a.b");
  PickleTensor(&p, "FloatStorage", "0", 1, 0, {1}, {1});
  p.BinUnicode("a").EmptyDict().BinUnicode("b");
  PickleTensor(&p, "FloatStorage", "0", 1, 0, {1}, {1});
  p.SetItem().SetItems().Stop();
  Built b(TorchZip(p.bytes(), {{"0", "abcd"}}));
  CheckError(b.status, b.path, Status::Code::kNotSupported, "two tensors flatten to the same key 'a.b'");
}

BOOST_AUTO_TEST_CASE(one_storage_referenced_with_two_sizes) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().BinUnicode("x");
  PickleTensor(&p, "FloatStorage", "0", 2, 0, {2}, {1});
  p.BinUnicode("y");
  PickleTensor(&p, "FloatStorage", "0", 1, 0, {1}, {1});
  p.SetItems().Stop();
  Built b(TorchZip(p.bytes(), {{"0", "abcdefgh"}}));
  CheckError(b.status, b.path, Status::Code::kCorruption, "storage '0' is referenced with two different sizes");
}

BOOST_AUTO_TEST_CASE(opaque_objects_with_appended_and_set_items) {
  // {"o": mod.Cls() with APPENDS [1, 2] and SETITEMS {"k": 3},
  //  "p": mod.Other({("\xff",): 4})}. Found by tests/fuzz (fuzz_torch): an object's appended
  // items were pushed into a JSON object and a non-UTF-8 tuple key was dumped without a
  // replacement, both throwing out of the reader.
  PickleBuilder p;
  p.Proto(2).EmptyDict();
  p.BinUnicode("o").Global("mod", "Cls").EmptyTuple().Reduce();
  p.Mark().BinInt1(1).BinInt1(2).Op('e');
  p.Mark().BinUnicode("k").BinInt1(3).SetItems();
  p.SetItem();
  p.BinUnicode("p").Global("mod", "Other").Mark().EmptyDict().BinUnicode("\xff").Op(0x85).BinInt1(4).SetItem();
  p.Tuple().Reduce().SetItem().Stop();
  Built b(TorchZip(p.bytes(), {}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  const nlohmann::json& m = b.catalog->metadata;
  BOOST_TEST(m["o"]["$class"] == "mod.Cls");
  BOOST_TEST(m["o"]["appended"] == nlohmann::json({1, 2}));
  BOOST_TEST(m["o"]["items"]["k"] == 3);
  BOOST_TEST(m["p"]["args"].at(0).size() == 1u);
}

// ---- resource limits ------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(shared_lists_cannot_blow_up_the_walk) {
  // L0 = [], L(k+1) = [Lk, Lk] through the memo: 60 levels are 2^60 paths to walk.
  PickleBuilder p;
  p.Proto(2).EmptyList().BinPut(0).Op('0');
  for (uint8_t k = 1; k <= 60; ++k) {
    p.EmptyList().Mark().BinGet(k - 1).BinGet(k - 1).Op('e').BinPut(k);
    if (k < 60) p.Op('0');  // POP: only the last list stays on the stack
  }
  p.Stop();
  Built b(TorchZip(p.bytes(), {}));
  CheckError(b.status, b.path, Status::Code::kRefused, "would visit more than");
}

BOOST_AUTO_TEST_CASE(tensor_and_pickle_limits_are_options) {
  ckptfs::SourceOptions options;
  std::shared_ptr<const Catalog> catalog;
  options.limits.tensors = 5;
  Status s = ckptfs::OpenCatalog(kSample, options, &catalog);
  CheckError(s, kSample, Status::Code::kRefused, "more than 5 tensors");
  BOOST_TEST(s.limit_option() == "max_tensors");
  options = {};
  options.limits.pickle_bytes = 1000;
  s = ckptfs::OpenCatalog(kSample, options, &catalog);
  CheckError(s, kSample, Status::Code::kRefused, "over the limit of 1000");
  BOOST_TEST(s.limit_option() == "max_pickle");
  options = {};
  options.limits.pickle_memory = 4096;
  s = ckptfs::OpenCatalog(kSample, options, &catalog);
  CheckError(s, kSample, Status::Code::kRefused, "bytes of memory");
  BOOST_TEST(s.limit_option() == "max_pickle_memory");
  options = {};
  BOOST_TEST(ckptfs::OpenCatalog(kSample, options, &catalog).ok());
}

// ---- archives inside a larger file ----------------------------------------------------------

namespace {

// Reads the torch.save archive at [base, base+length) of in-memory file `path` into `catalog`.
Status ReadWindow(const std::string& path, uint64_t base, uint64_t length,
                  Catalog* catalog, nlohmann::json* metadata) {
  uint32_t file = 0;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  return ckptfs::ReadTorchZip(ckptfs::FileWindow{file, base, length}, catalog, metadata);
}

}  // namespace

BOOST_AUTO_TEST_CASE(sample_inside_a_larger_file_reads_the_same_tensors_at_shifted_offsets) {
  const std::string sample = ReadFile(kSample);
  constexpr uint64_t kBase = 4099;  // odd: no alignment of the archive can be assumed
  MemorySource source;
  const std::string path = source.Write("/mem/chunks.bin", PatternBytes(kBase, 3) + sample + PatternBytes(777, 4));
  Catalog catalog;
  source.Attach(&catalog);
  nlohmann::json metadata;
  Status s = ReadWindow(path, kBase, sample.size(), &catalog, &metadata);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(metadata == MustOpen(kSample)->metadata);
  const auto& expected = SampleTensors();
  BOOST_REQUIRE_EQUAL(catalog.tensors.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& t = catalog.tensors[i];
    const Expected& e = expected[i];
    BOOST_TEST_CONTEXT("tensor " << e.key) {
      BOOST_TEST(t.key == e.key);
      BOOST_TEST(t.shape == e.shape, boost::test_tools::per_element());
      const std::vector<ckptfs::Extent> extents = ckptfs::ExtentsOf(t);
      BOOST_REQUIRE_EQUAL(extents.size(), 1u);
      BOOST_TEST(extents[0].offset == kBase + e.data_offset);
      BOOST_TEST(extents[0].length == t.nbytes());
      BOOST_TEST(t.storage_id == "0:" + std::to_string(kBase) + ":" + e.storage);
      std::string got(t.nbytes(), '\0');
      BOOST_REQUIRE(catalog.files->ReadExact(0, extents[0].offset, got.size(), got.data()).ok());
      BOOST_TEST((got == sample.substr(e.data_offset, got.size())));
    }
  }
}

BOOST_AUTO_TEST_CASE(two_archives_in_one_file_have_distinct_storage_ids) {
  const std::string sample = ReadFile(kSample);
  const uint64_t second = sample.size() + 13;
  MemorySource source;
  const std::string path = source.Write("/mem/two.bin", sample + PatternBytes(13, 5) + sample);
  Catalog catalog;
  source.Attach(&catalog);
  nlohmann::json metadata;
  BOOST_REQUIRE(ReadWindow(path, 0, sample.size(), &catalog, &metadata).ok());
  BOOST_REQUIRE(ReadWindow(path, second, sample.size(), &catalog, &metadata).ok());
  const size_t n = SampleTensors().size();
  BOOST_REQUIRE_EQUAL(catalog.tensors.size(), 2 * n);
  std::set<std::string> ids;
  for (const auto& t : catalog.tensors) ids.insert(t.storage_id);
  BOOST_TEST(ids.size() == 2 * n);
  for (size_t i = 0; i < n; ++i)
    BOOST_TEST(ckptfs::ExtentsOf(catalog.tensors[n + i]).at(0).offset == ckptfs::ExtentsOf(catalog.tensors[i]).at(0).offset + second);
}

BOOST_AUTO_TEST_CASE(errors_inside_a_window_name_its_byte_range) {
  // The window's archive lost its end record; a whole one follows it in the file, and
  // must not be found.
  std::string broken = ReadFile(kSample);
  broken[broken.size() - 22] ^= 0xff;
  MemorySource source;
  const std::string path = source.Write("/mem/chunks.bin", "x" + broken + ReadFile(kSample));
  Catalog catalog;
  source.Attach(&catalog);
  nlohmann::json metadata;
  Status s = ReadWindow(path, 1, broken.size(), &catalog, &metadata);
  const std::string where = path + " [bytes 1.." + std::to_string(1 + broken.size()) + ")";
  CheckError(s, where, Status::Code::kCorruption, "no end-of-central-directory record");
}

// ---- streamed parses ------------------------------------------------------------------------
// data.pkl is parsed streamed: tensors become catalog entries as the parse makes them, and
// the walk puts them in its order. Pickles that break what streaming assumes are read again
// without it; either way the catalog is the one a plain parse gives.

namespace {

// A tensor as torch pickles one, every value memoized from index `memo` on (the call's
// result at memo + 6): `size` as a tuple, or as a list when `size_list`.
void MemoTensor(PickleBuilder* p, std::string_view key, uint32_t numel, const std::vector<uint32_t>& size,
                const std::vector<uint32_t>& stride, uint8_t memo, bool size_list = false) {
  p->Global("torch._utils", "_rebuild_tensor_v2").Mark();
  p->Mark().BinUnicode("storage").BinPut(memo).Global("torch", "FloatStorage").BinUnicode(key).BinPut(memo + 1);
  p->BinUnicode("cpu").BinInt(static_cast<int32_t>(numel)).Tuple().BinPut(memo + 2).BinPersId().BinInt(0);
  p->Mark();
  for (uint32_t d : size) p->BinInt(static_cast<int32_t>(d));
  if (size_list) p->Op('l');  // LIST
  else p->Tuple();
  p->BinPut(memo + 3).Mark();
  for (uint32_t d : stride) p->BinInt(static_cast<int32_t>(d));
  p->Tuple().BinPut(memo + 4).NewFalse().Global("collections", "OrderedDict").EmptyTuple().Reduce();
  p->Tuple().BinPut(memo + 5).Reduce().BinPut(memo + 6);
}

}  // namespace

BOOST_AUTO_TEST_CASE(streamed_tensors_take_the_walk_order_and_unreached_ones_are_dropped) {
  // t2 and t3 are made first and popped; {"a": t1, "b": t2, "c": t1} (t1 twice through the
  // memo); t3 is never reached.
  PickleBuilder p;
  p.Proto(2);
  MemoTensor(&p, "1", 2, {2}, {1}, 10);
  p.Op('0');
  MemoTensor(&p, "2", 1, {1}, {1}, 20);
  p.Op('0');
  p.EmptyDict().Mark().BinUnicode("a");
  MemoTensor(&p, "0", 1, {1}, {1}, 30);
  p.BinUnicode("b").BinGet(16).BinUnicode("c").BinGet(36).SetItems().Stop();
  Built b(TorchZip(p.bytes(), {{"0", "abcd"}, {"1", "efghijkl"}, {"2", "mnop"}}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  const auto& ts = b.catalog->tensors;
  BOOST_REQUIRE_EQUAL(ts.size(), 3u);
  BOOST_TEST(ts[0].key == "a");
  BOOST_TEST(ts[1].key == "b");
  BOOST_TEST(ts[2].key == "c");
  BOOST_TEST(ts[1].shape == std::vector<uint64_t>({2}), boost::test_tools::per_element());
  BOOST_TEST(ts[0].storage_id == ts[2].storage_id);
  BOOST_TEST(ts[0].storage_id != ts[1].storage_id);
  BOOST_TEST((std::vector<ckptfs::PathElement>(ts[2].path) == std::vector<ckptfs::PathElement>{std::string("c")}));
  std::string got(8, '\0');
  BOOST_REQUIRE(b.catalog->files->ReadExact(0, ckptfs::ExtentsOf(ts[1])[0].offset, 8, got.data()).ok());
  BOOST_TEST(got == "efghijkl");
}

BOOST_AUTO_TEST_CASE(pickle_reading_a_dropped_memo_entry_is_read_again_without_streaming) {
  // {"w": t, "pid": <t's persistent-id tuple, read again from the memo>}: streaming dropped
  // that tuple with the call's arguments, so the archive is parsed again whole.
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().BinUnicode("w");
  MemoTensor(&p, "0", 1, {1}, {1}, 10);
  p.BinUnicode("pid").BinGet(12).SetItems().Stop();
  Built b(TorchZip(p.bytes(), {{"0", "abcd"}}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 1u);
  BOOST_TEST(b.catalog->tensors[0].key == "w");
  BOOST_TEST(b.catalog->metadata["pid"] ==
             nlohmann::json::parse(R"(["storage", {"$global": "torch.FloatStorage"}, "0", "cpu", 1])"));
}

BOOST_AUTO_TEST_CASE(size_list_appended_to_after_the_call_gives_the_final_shape) {
  // The size is a list that the pickle appends to after the rebuild call: a plain parse
  // reads the final list ([3, 2]), and so must the streamed read.
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().BinUnicode("w");
  MemoTensor(&p, "0", 6, {3}, {2, 1}, 10, /*size_list=*/true);
  p.SetItems().BinGet(13).BinInt1(2).Op('a').Op('0').Stop();
  Built b(TorchZip(p.bytes(), {{"0", PatternBytes(24, 3)}}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 1u);
  BOOST_TEST(b.catalog->tensors[0].shape == std::vector<uint64_t>({3, 2}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(errors_found_while_streaming_are_those_of_a_plain_read) {
  // A tensor past its storage that the walk never reaches: the streamed read resolves it
  // and fails, the plain read never looks at it and succeeds.
  PickleBuilder p;
  p.Proto(2);
  MemoTensor(&p, "1", 1, {9}, {1}, 10);
  p.Op('0').EmptyDict().Mark().BinUnicode("a");
  MemoTensor(&p, "0", 1, {1}, {1}, 30);
  p.SetItems().Stop();
  Built b(TorchZip(p.bytes(), {{"0", "abcd"}, {"1", "efgh"}}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 1u);
  BOOST_TEST(b.catalog->tensors[0].key == "a");
}

// ---- objects that hold tensors: served as a documented form, or refused ------------------

namespace {

// {"w": <what `body` pickles>} with record 0 (12 float32) in the archive.
Built WithObject(const std::function<void(PickleBuilder*)>& body) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().BinUnicode("w");
  body(&p);
  p.SetItem().Stop();
  return Built(TorchZip(p.bytes(), {{"0", PatternBytes(48, 3)}}));
}
void Tensor12(PickleBuilder* p) { PickleTensor(p, "FloatStorage", "0", 12, 0, {12}, {1}); }

}  // namespace

BOOST_AUTO_TEST_CASE(tensor_subclasses_without_a_plain_storage_are_refused) {
  // A wrapper subclass (DTensor's form: _rebuild_from_type_v2(_rebuild_wrapper_subclass,
  // <class>, (...), state holding the inner tensors)) of a class ckptfs does not know.
  auto Wrapper = [](const char* module, const char* name) {
    return WithObject([module, name](PickleBuilder* p) {
      p->Global("torch._tensor", "_rebuild_from_type_v2").Mark().Global("torch._utils", "_rebuild_wrapper_subclass");
      p->Global(module, name).Mark().Global("torch", "float32").Tuple();
      p->EmptyDict().BinUnicode("_local_tensor");
      Tensor12(p);
      p->SetItem().Tuple().Reduce();
    });
  };
  Built quantized = Wrapper("torchao.dtypes.affine_quantized_tensor", "AffineQuantizedTensor");
  CheckError(quantized.status, quantized.path, Status::Code::kNotSupported,
             "'w': a tensor of class torchao.dtypes.affine_quantized_tensor.AffineQuantizedTensor rebuilt by "
             "torch._utils._rebuild_wrapper_subclass; ckptfs does not know how to serve it");
  // A DTensor is recognised (format/torch/torch_distributed.hpp), and refused when its form is not
  // the one it knows.
  Built dtensor = Wrapper("torch.distributed.tensor", "DTensor");
  CheckError(dtensor.status, dtensor.path, Status::Code::kNotSupported, "'w': DTensor with malformed wrapper arguments");
  // A tensor kind ckptfs does not rebuild, even one without storage (meta).
  Built meta = WithObject([](PickleBuilder* p) {
    p->Global("torch._utils", "_rebuild_meta_tensor_no_storage").Mark().Global("torch", "float32");
    p->Mark().BinInt1(3).Tuple().Mark().BinInt1(1).Tuple().NewFalse().Tuple().Reduce();
  });
  CheckError(meta.status, meta.path, Status::Code::kNotSupported,
             "'w': a tensor rebuilt by torch._utils._rebuild_meta_tensor_no_storage");
}

BOOST_AUTO_TEST_CASE(a_subclass_over_a_plain_storage_is_served_unless_its_attributes_hold_tensors) {
  // as_subclass: _rebuild_from_type_v2(_rebuild_tensor_v2, MyT, (...), state).
  auto Subclass = [](bool tensor_in_state) {
    return WithObject([tensor_in_state](PickleBuilder* p) {
      p->Global("torch._tensor", "_rebuild_from_type_v2").Mark().Global("torch._utils", "_rebuild_tensor_v2");
      p->Global("mod", "MyT").Mark();
      p->Mark().BinUnicode("storage").Global("torch", "FloatStorage").BinUnicode("0").BinUnicode("cpu").BinInt(12);
      p->Tuple().BinPersId().BinInt(0).Mark().BinInt(12).Tuple().Mark().BinInt(1).Tuple().NewFalse();
      p->Global("collections", "OrderedDict").EmptyTuple().Reduce().Tuple();
      p->EmptyDict();
      if (tensor_in_state) {
        p->BinUnicode("scale");
        Tensor12(p);
        p->SetItem();
      }
      p->Tuple().Reduce();
    });
  };
  Built plain = Subclass(false);
  BOOST_REQUIRE_MESSAGE(plain.status.ok(), plain.status.message());
  BOOST_REQUIRE_EQUAL(plain.catalog->tensors.size(), 1u);
  BOOST_TEST(plain.catalog->tensors[0].key == "w");
  Built with_tensor = Subclass(true);
  CheckError(with_tensor.status, with_tensor.path, Status::Code::kNotSupported,
             "'w': tensors among the Python attributes of a tensor");
}

BOOST_AUTO_TEST_CASE(objects_holding_tensors_are_served_only_as_attribute_objects) {
  // A plain object (cls() + BUILD of a dict): its attributes are served.
  Built attrs = WithObject([](PickleBuilder* p) {
    p->Global("argparse", "Namespace").EmptyTuple().Op(0x81).EmptyDict().BinUnicode("scale");
    Tensor12(p);
    p->SetItem().Op('b');
  });
  BOOST_REQUIRE_MESSAGE(attrs.status.ok(), attrs.status.message());
  BOOST_REQUIRE_EQUAL(attrs.catalog->tensors.size(), 1u);
  BOOST_TEST(attrs.catalog->tensors[0].key == "w.scale");
  // Protocol 0-1's form of the same: copy_reg._reconstructor(cls, object, None).
  Built reconstructed = WithObject([](PickleBuilder* p) {
    p->Global("copy_reg", "_reconstructor").Mark().Global("mod", "State").Global("__builtin__", "object").None();
    p->Tuple().Reduce().EmptyDict().BinUnicode("scale");
    Tensor12(p);
    p->SetItem().Op('b');
  });
  BOOST_REQUIRE_MESSAGE(reconstructed.status.ok(), reconstructed.status.message());
  BOOST_TEST(reconstructed.catalog->tensors.at(0).key == "w.scale");
  // A class called with a tensor among its arguments (a namedtuple, a custom reduce).
  Built args = WithObject([](PickleBuilder* p) {
    p->Global("mod", "Pair").Mark();
    Tensor12(p);
    p->BinInt1(1).Tuple().Reduce();
  });
  CheckError(args.status, args.path, Status::Code::kNotSupported,
             "'w': an object of class mod.Pair holding tensors; ckptfs does not know how to serve it");
  // A torch.distributed class is never an attribute object.
  Built mesh = WithObject([](PickleBuilder* p) {
    p->Global("torch.distributed.device_mesh", "DeviceMesh").EmptyTuple().Op(0x81).EmptyDict().BinUnicode("_rank_map");
    Tensor12(p);
    p->SetItem().Op('b');
  });
  CheckError(mesh.status, mesh.path, Status::Code::kNotSupported,
             "an object of class torch.distributed.device_mesh.DeviceMesh holding tensors");
  // Tensors set as items of an attribute object (a dict subclass) are not its attributes.
  Built items = WithObject([](PickleBuilder* p) {
    p->Global("mod", "MyDict").EmptyTuple().Op(0x81).BinUnicode("k");
    Tensor12(p);
    p->SetItem();
  });
  CheckError(items.status, items.path, Status::Code::kNotSupported, "'w': a tensor where ckptfs serves none");
  // An object that holds no tensor stays metadata.
  PickleBuilder p;
  p.Proto(2).EmptyDict().BinUnicode("w").Global("mod", "Pair").Mark().BinInt1(1).Tuple().Reduce().SetItem();
  p.BinUnicode("t");
  Tensor12(&p);
  p.SetItem().Stop();
  Built none(TorchZip(p.bytes(), {{"0", PatternBytes(48, 3)}}));
  BOOST_REQUIRE_MESSAGE(none.status.ok(), none.status.message());
  BOOST_TEST(none.catalog->metadata["w"]["$class"] == "mod.Pair");
}

BOOST_AUTO_TEST_CASE(mappings_serve_their_items_and_refuse_tensors_elsewhere) {
  // defaultdict(list) with SETITEMS: its items.
  Built dd = WithObject([](PickleBuilder* p) {
    p->Global("collections", "defaultdict").Mark().Global("__builtin__", "list").Tuple().Reduce().BinUnicode("k");
    Tensor12(p);
    p->SetItem();
  });
  BOOST_REQUIRE_MESSAGE(dd.status.ok(), dd.status.message());
  BOOST_TEST(dd.catalog->tensors.at(0).key == "w.k");
  // Python 2's OrderedDict: the pairs it was called with.
  Built od = WithObject([](PickleBuilder* p) {
    p->Global("collections", "OrderedDict").EmptyList().Mark().EmptyList().Mark().Op('U').Op(1).Raw("k");
    Tensor12(p);
    p->Op('e').Op('e').Op(0x85).Reduce();
  });
  BOOST_REQUIRE_MESSAGE(od.status.ok(), od.status.message());
  BOOST_TEST(od.catalog->tensors.at(0).key == "w.k");
  // A tensor among a dict's attributes (BUILD on it) would be dropped: refused.
  Built attr = WithObject([](PickleBuilder* p) {
    p->Global("collections", "OrderedDict").EmptyTuple().Reduce().EmptyDict().BinUnicode("_extra");
    Tensor12(p);
    p->SetItem().Op('b');
  });
  CheckError(attr.status, attr.path, Status::Code::kNotSupported,
             "'w': tensors in a mapping's attributes or arguments, not among its items");
  // A tensor as a dict key.
  Built key = WithObject([](PickleBuilder* p) {
    p->EmptyDict();
    Tensor12(p);
    p->BinInt1(1).SetItem();
  });
  CheckError(key.status, key.path, Status::Code::kNotSupported, "'w': a tensor where ckptfs serves none (a dict key");
  // A storage on its own (torch.save of tensor.untyped_storage()).
  Built storage = WithObject([](PickleBuilder* p) {
    p->Mark().BinUnicode("storage").Global("torch", "FloatStorage").BinUnicode("0").BinUnicode("cpu").BinInt(12);
    p->Tuple().BinPersId();
  });
  CheckError(storage.status, storage.path, Status::Code::kNotSupported, "'w': a storage outside any tensor");
}

BOOST_AUTO_TEST_CASE(an_archive_with_storage_records_that_serves_no_tensor_is_refused) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().BinUnicode("epoch").BinInt1(3).SetItem().Stop();
  Built b(TorchZip(p.bytes(), {{"0", PatternBytes(48, 3)}}));
  CheckError(b.status, b.path, Status::Code::kNotSupported,
             "holds 1 storage records but no tensor ckptfs can serve");
  // Without records, a checkpoint of no tensor is served as what it is.
  Built empty(TorchZip(p.bytes(), {}));
  BOOST_REQUIRE_MESSAGE(empty.status.ok(), empty.status.message());
  BOOST_TEST(empty.catalog->tensors.empty());
}

// ---- DTensor / ShardedTensor (format/torch/torch_distributed.hpp, format/torch/rank_shards.hpp) ----

namespace {

void Tuple(PickleBuilder* p, const std::vector<uint32_t>& v) {
  p->Mark();
  for (uint32_t x : v) p->BinInt(static_cast<int32_t>(x));
  p->Tuple();
}

// cls() then BUILD with {name: <value written by each field>}.
void Object(PickleBuilder* p, std::string_view module, std::string_view name,
            const std::vector<std::pair<std::string, std::function<void()>>>& fields) {
  p->Global(module, name).EmptyTuple().Op(0x81).EmptyDict();
  if (!fields.empty()) {
    p->Mark();
    for (const auto& [key, write] : fields) {
      p->BinUnicode(key);
      write();
    }
    p->SetItems();
  }
  p->Op('b');
}

// A DTensor as torch.save pickles it: global `shape`, `placements` ("S0", "S1", "R", "P")
// on `mesh` at `coordinate`, its local tensor the float storage `key` of `local` shape.
void PickleDTensor(PickleBuilder* p, std::string_view key, const std::vector<uint32_t>& shape,
                   const std::vector<uint32_t>& local, const std::vector<std::string>& placements,
                   const std::vector<uint32_t>& mesh, const std::vector<uint32_t>& coordinate, uint32_t rank) {
  uint32_t numel = 1;
  for (uint32_t d : local) numel *= d;
  std::vector<uint32_t> stride(local.size(), 1);
  for (size_t d = local.size(); d-- > 1;) stride[d - 1] = stride[d] * local[d];
  p->Global("torch._tensor", "_rebuild_from_type_v2").Mark();
  p->Global("torch._utils", "_rebuild_wrapper_subclass").Global("torch.distributed.tensor", "DTensor");
  p->Mark().Global("torch.distributed.tensor", "DTensor").Global("torch", "float32");
  Tuple(p, shape);
  Tuple(p, std::vector<uint32_t>(shape.size(), 1));
  p->BinInt1(0).None().None().NewFalse().Tuple();
  p->None().EmptyDict().Mark().BinUnicode("_local_tensor");
  PickleTensor(p, "FloatStorage", key, numel, 0, local, stride);
  p->BinUnicode("_spec");
  Object(p, "torch.distributed.tensor._dtensor_spec", "DTensorSpec",
         {{"mesh",
           [&] {
             Object(p, "torch.distributed.device_mesh", "DeviceMesh",
                    {{"_layout",
                      [&] {
                        Object(p, "torch.distributed._mesh_layout", "_MeshLayout",
                               {{"axes", [&] {
                                   p->Mark();
                                   for (uint32_t n : mesh)
                                     Object(p, "torch.distributed._mesh_layout", "_FlatLayout",
                                            {{"shape", [&] { Tuple(p, {n}); }}, {"stride", [&] { Tuple(p, {1}); }}});
                                   p->Tuple();
                                 }}});
                      }},
                     {"_coordinate_on_dim", [&] { Tuple(p, coordinate); }},
                     {"_rank", [&] { p->BinInt(static_cast<int32_t>(rank)); }}});
           }},
          {"placements", [&] {
             p->Mark();
             for (const std::string& pl : placements) {
               const char* mod = "torch.distributed.tensor.placement_types";
               if (pl[0] == 'S') Object(p, mod, "Shard", {{"dim", [&] { p->BinInt1(static_cast<uint8_t>(pl[1] - '0')); }}});
               else if (pl == "R") Object(p, mod, "Replicate", {});
               else if (pl == "P") Object(p, mod, "Partial", {{"reduce_op", [&] { p->BinUnicode("sum"); }}});
               else Object(p, mod, "Mystery", {});
             }
             p->Tuple();
           }}});
  p->SetItems().Tuple2().Tuple().Reduce();
}

std::string DTensorFile(const std::vector<uint32_t>& shape, const std::vector<uint32_t>& local,
                        const std::vector<std::string>& placements, const std::vector<uint32_t>& mesh,
                        const std::vector<uint32_t>& coordinate, uint32_t rank, uint32_t seed = 1) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().BinUnicode("w");
  PickleDTensor(&p, "0", shape, local, placements, mesh, coordinate, rank);
  p.BinUnicode("step").BinInt1(3).SetItems().Stop();
  uint32_t numel = 1;
  for (uint32_t d : local) numel *= d;
  return TorchZip(p.bytes(), {{"0", PatternBytes(4 * numel, seed)}});
}

}  // namespace

BOOST_AUTO_TEST_CASE(dtensor_rank_file_serves_its_local_shard_under_its_own_name) {
  // Rows of 5 over 2 ranks (torch.chunk: 3 and 2): rank 1 holds rows 3-4.
  Built b(DTensorFile({5, 3}, {2, 3}, {"S0"}, {2}, {1}, 1));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 1u);
  const auto& t = b.catalog->tensors[0];
  BOOST_TEST(t.key == "w.local_shards.0");
  BOOST_TEST(t.shape == std::vector<uint64_t>({2, 3}), boost::test_tools::per_element());
  const nlohmann::json& d = b.catalog->metadata["w"]["$distributed_tensor"];
  BOOST_TEST(d["class"] == "DTensor");
  BOOST_TEST(d["shape"] == nlohmann::json({5, 3}));
  BOOST_TEST(d["placements"] == nlohmann::json({"Shard(0)"}));
  BOOST_TEST(d["local_shards"][0]["offsets"] == nlohmann::json({3, 0}));
  BOOST_TEST(d["local_shards"][0]["key"] == "w.local_shards.0");
  BOOST_TEST(b.catalog->metadata["step"] == 3);
}

BOOST_AUTO_TEST_CASE(dtensor_whose_local_shape_is_not_its_block_is_refused) {
  Built b(DTensorFile({5, 3}, {3, 3}, {"S0"}, {2}, {1}, 1));
  CheckError(b.status, b.path, Status::Code::kNotSupported, "key 'w': DTensor whose local tensor's shape [3, 3] is not the block [2, 3]");
  Built c(DTensorFile({5, 3}, {2, 3}, {"Q"}, {2}, {1}, 1));
  CheckError(c.status, c.path, Status::Code::kNotSupported, "placement of unknown class Mystery");
  Built e(DTensorFile({5, 3}, {2, 3}, {"S0"}, {2}, {2}, 1));
  CheckError(e.status, e.path, Status::Code::kNotSupported, "coordinate [2] is outside its mesh [2]");
}

namespace {

// The rank files `files` written to a memory env and consolidated.
struct Consolidated {
  MemorySource source;
  Catalog catalog;
  nlohmann::json metadata;
  Status status;
  std::vector<std::string> paths;
  explicit Consolidated(const std::vector<std::string>& files) {
    source.Attach(&catalog);
    ckptfs::RankFileSet set;
    for (size_t r = 0; r < files.size(); ++r)
      set.files.push_back(source.Write("/mem/rank" + std::to_string(r) + ".pt", files[r]));
    paths = set.files;
    status = ckptfs::ConsolidateRankFiles(set, ckptfs::ReadLimits{}, &catalog, &metadata);
  }
};

}  // namespace

BOOST_AUTO_TEST_CASE(dtensor_rank_set_is_one_tensor_of_boxes_in_the_rank_files) {
  // Shard(1) of 5 columns over 3 ranks: 2, 2, 1.
  Consolidated c({DTensorFile({4, 5}, {4, 2}, {"S1"}, {3}, {0}, 0, 1), DTensorFile({4, 5}, {4, 2}, {"S1"}, {3}, {1}, 1, 2),
                  DTensorFile({4, 5}, {4, 1}, {"S1"}, {3}, {2}, 2, 3)});
  BOOST_REQUIRE_MESSAGE(c.status.ok(), c.status.message());
  BOOST_REQUIRE_EQUAL(c.catalog.tensors.size(), 1u);
  const auto& t = c.catalog.tensors[0];
  BOOST_TEST(t.key == "w");
  BOOST_TEST(t.shape == std::vector<uint64_t>({4, 5}), boost::test_tools::per_element());
  BOOST_REQUIRE_EQUAL(t.boxes.size(), 3u);
  for (uint32_t r = 0; r < 3; ++r) {
    BOOST_TEST(c.catalog.files->path(t.boxes[r].file) == c.paths[r]);
    BOOST_TEST(t.boxes[r].offset == std::vector<uint64_t>({0, 2 * r}), boost::test_tools::per_element());
  }
  BOOST_TEST(ckptfs::ValidateLayout(t, *c.catalog.files, "x").ok());
  BOOST_TEST(c.metadata["step"] == 3);
}

BOOST_AUTO_TEST_CASE(dtensor_replicate_is_served_from_one_rank_and_empty_shards_add_nothing) {
  // (Replicate, Shard(0)) on a (2, 1) mesh: both ranks hold the whole tensor.
  Consolidated c({DTensorFile({2, 3}, {2, 3}, {"R", "S0"}, {2, 1}, {0, 0}, 0), DTensorFile({2, 3}, {2, 3}, {"R", "S0"}, {2, 1}, {1, 0}, 1)});
  BOOST_REQUIRE_MESSAGE(c.status.ok(), c.status.message());
  BOOST_REQUIRE_EQUAL(c.catalog.tensors[0].boxes.size(), 1u);
  BOOST_TEST(c.catalog.files->path(c.catalog.tensors[0].boxes[0].file) == c.paths[0]);
  BOOST_TEST(ckptfs::StoredAsExtents(c.catalog.tensors[0]));
  // 2 rows over 3 ranks: 1, 1, 0.
  Consolidated e({DTensorFile({2}, {1}, {"S0"}, {3}, {0}, 0), DTensorFile({2}, {1}, {"S0"}, {3}, {1}, 1),
                  DTensorFile({2}, {0}, {"S0"}, {3}, {2}, 2)});
  BOOST_REQUIRE_MESSAGE(e.status.ok(), e.status.message());
  BOOST_TEST(e.catalog.tensors[0].boxes.size() == 2u);
}

BOOST_AUTO_TEST_CASE(dtensor_rank_set_refusals_name_the_file) {
  Consolidated missing({DTensorFile({5, 3}, {3, 3}, {"S0"}, {2}, {0}, 0)});
  CheckError(missing.status, "/mem/rank0.pt", Status::Code::kNotSupported, "the files of ranks 1..1 are missing");
  Consolidated swapped({DTensorFile({5, 3}, {3, 3}, {"S0"}, {2}, {0}, 0), DTensorFile({5, 3}, {3, 3}, {"S0"}, {2}, {0}, 0)});
  CheckError(swapped.status, "/mem/rank1.pt", Status::Code::kNotSupported, "saved by rank 0");
  Consolidated partial({DTensorFile({2, 3}, {2, 3}, {"P"}, {2}, {0}, 0), DTensorFile({2, 3}, {2, 3}, {"P"}, {2}, {1}, 1)});
  CheckError(partial.status, "/mem/rank0.pt", Status::Code::kNotSupported, "Partial(sum)");
  Consolidated layouts({DTensorFile({4, 4}, {2, 4}, {"S0"}, {2}, {0}, 0), DTensorFile({4, 4}, {4, 2}, {"S1"}, {2}, {1}, 1)});
  CheckError(layouts.status, "/mem/rank1.pt", Status::Code::kNotSupported, "placements (Shard(1))");
}

BOOST_AUTO_TEST_CASE(rank_file_names) {
  ckptfs::RankFileName n;
  BOOST_REQUIRE(ckptfs::ParseRankFileName("model_world_size_4_rank_3.pt", &n));
  BOOST_TEST(n.rank == 3u);
  BOOST_TEST(n.group == "model_world_size_4_rank_{rank}.pt");
  BOOST_TEST(n.world_size.value_or(0) == 4u);
  BOOST_REQUIRE(ckptfs::ParseRankFileName("rank12.pt", &n));
  BOOST_TEST(n.rank == 12u);
  BOOST_TEST(!n.world_size.has_value());
  BOOST_REQUIRE(ckptfs::ParseRankFileName("shard-rank-1_of_8.bin", &n));
  BOOST_TEST(n.world_size.value_or(0) == 8u);
  BOOST_TEST(!ckptfs::ParseRankFileName("pytorch_model.bin", &n));
  BOOST_TEST(!ckptfs::ParseRankFileName("rank1_rank2.pt", &n));
  BOOST_TEST(!ckptfs::ParseRankFileName("rank99999999999999999999.pt", &n));
}
