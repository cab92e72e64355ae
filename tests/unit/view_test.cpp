// The View: its tree, the safetensors files it synthesizes, and the read mapping. Every
// virtual file is read whole once, then thousands of random and boundary-crossing reads
// are checked against slices of that whole read; the tensor bytes themselves are checked
// against the source (contiguous extents) or against values computed here (strided).
#define BOOST_TEST_MODULE view_test
#include <boost/test/unit_test.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <atomic>
#include <random>
#include <thread>

#include "ckptfs/names.hpp"
#include "ckptfs/view.hpp"
#include "test_util.hpp"

using ckptfs::Box;
using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::Extent;
using ckptfs::Status;
using ckptfs::TensorEntry;
using ckptfs::View;
using json = nlohmann::json;
using namespace ckptfs_test;

namespace {

const std::string kSample = CKPTFS_TEST_DATA "/sample-mlp-training.pt";

std::unique_ptr<View> MustBuild(std::shared_ptr<const Catalog> catalog) {
  for (const TensorEntry& t : catalog->tensors) {
    Status valid = ckptfs::ValidateLayout(t, *catalog->files, catalog->source);
    BOOST_REQUIRE_MESSAGE(valid.ok(), valid.message());
  }
  std::unique_ptr<View> view;
  Status s = View::Build(std::move(catalog), ckptfs::ViewOptions{}, &view);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return view;
}

std::shared_ptr<const Catalog> MustOpen(const std::string& path) {
  std::shared_ptr<const Catalog> catalog;
  Status s = ckptfs::OpenCatalog(path, &catalog);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return catalog;
}

View::NodeId MustLookup(const View& view, std::string_view path) {
  auto id = view.Lookup(path);
  BOOST_REQUIRE_MESSAGE(id.has_value(), "no " << path);
  return *id;
}

// The whole file in one Read call of exactly its size.
std::string ReadWhole(const View& view, View::NodeId id) {
  const uint64_t size = view.node(id).size;
  std::string out(size, '\0');
  size_t nread = 12345;
  Status s = view.Read(id, 0, size, out.data(), &nread);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE_EQUAL(nread, size);
  return out;
}

// One read of [offset, offset + length), compared with the same slice of `whole`. Reads
// at or past the end return nothing; reads running past it are short.
void CheckRead(const View& view, View::NodeId id, const std::string& whole, uint64_t offset, size_t length) {
  const size_t canary = 7;
  std::string buf(length + canary, '\xA5');
  size_t nread = 0;
  Status s = view.Read(id, offset, length, buf.data(), &nread);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  const size_t expected = offset >= whole.size() ? 0 : std::min<uint64_t>(length, whole.size() - offset);
  BOOST_REQUIRE_MESSAGE(nread == expected, view.PathOf(id) << " read(" << offset << ", " << length << ") returned "
                                                           << nread << ", expected " << expected);
  BOOST_REQUIRE_MESSAGE(buf.compare(0, nread, whole, expected ? offset : 0, nread) == 0,
                        view.PathOf(id) << " read(" << offset << ", " << length << ") returned other bytes");
  // Nothing is written past what the read returned.
  BOOST_REQUIRE(buf.find_first_not_of('\xA5', nread) == std::string::npos);
}

// `count` random reads, plus reads straddling each of `boundaries` and the file's end.
void CheckReads(const View& view, View::NodeId id, const std::string& whole, std::mt19937_64& rng, int count,
                std::vector<uint64_t> boundaries = {}) {
  const uint64_t size = whole.size();
  boundaries.push_back(size);
  for (uint64_t b : boundaries) {
    for (uint64_t before : {0, 1, 3, 8}) {
      for (size_t len : {0, 1, 2, 5, 16, 64}) {
        if (b >= before) CheckRead(view, id, whole, b - before, len);
      }
    }
  }
  std::uniform_int_distribution<uint64_t> off(0, size + 16);
  for (int i = 0; i < count; ++i) {
    const uint64_t o = off(rng);
    // Mostly small reads (FUSE-sized and smaller), sometimes up to the whole file.
    const uint64_t max_len = (i % 10 == 0) ? size + 32 : std::min<uint64_t>(size + 32, 300);
    const size_t len = std::uniform_int_distribution<uint64_t>(0, max_len)(rng);
    CheckRead(view, id, whole, o, len);
  }
}

// The header of a safetensors file: its length N and JSON.
struct Header {
  uint64_t n = 0;
  json doc;
};

Header ParseHeader(const std::string& file) {
  Header h;
  BOOST_REQUIRE_GE(file.size(), 8u);
  for (int i = 7; i >= 0; --i) h.n = (h.n << 8) | static_cast<uint8_t>(file[i]);
  BOOST_REQUIRE_LE(8 + h.n, file.size());
  h.doc = json::parse(file.substr(8, h.n), nullptr, /*allow_exceptions=*/false);
  BOOST_REQUIRE(h.doc.is_object());
  return h;
}

// The bytes of a contiguous tensor, read straight from its source extents.
std::string SourceBytes(const Catalog& c, const TensorEntry& t) {
  std::string out;
  for (const Extent& e : ckptfs::ExtentsOf(t)) {
    std::string part(e.length, '\0');
    Status s = c.files->ReadExact(e.file, e.offset, e.length, part.data());
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    out += part;
  }
  return out;
}

std::vector<View::NodeId> FileNodes(const View& view) {
  std::vector<View::NodeId> files;
  for (View::NodeId id = 0; id < view.node_count(); ++id)
    if (!view.node(id).is_dir) files.push_back(id);
  return files;
}

std::vector<std::string> ChildNames(const View& view, View::NodeId dir) {
  std::vector<std::string> names;
  for (size_t k = 0; k < view.ChildCount(dir); ++k) names.push_back(view.NameOf(view.ChildAt(dir, k)));
  return names;
}

// The safetensors dtype a tensor is served as. Complex types without a safetensors name
// are served as their real view: component floats and a trailing dimension of 2.
std::string ServedName(DType dtype, std::vector<uint64_t>* shape) {
  if (dtype == DType::kC128 || dtype == DType::kC32) shape->push_back(2);
  if (dtype == DType::kC128) return "F64";
  if (dtype == DType::kC32) return "F16";
  return std::string(ckptfs::Info(dtype).safetensors_name);
}

// Checks model.safetensors against the catalog: header rules, data layout, and that each
// tensor's bytes equal `expected(i)`. Returns the file's header.
template <typename ExpectedBytes>
Header CheckModelFile(const View& view, const std::string& whole, ExpectedBytes expected) {
  const ckptfs::ServedTensors& c = view.served();  // as stored: no view options
  Header h = ParseHeader(whole);
  BOOST_TEST(h.n % 8 == 0u);
  BOOST_TEST(h.doc["__metadata__"] == json({{"format", "pt"}}));
  BOOST_REQUIRE_EQUAL(h.doc.size(), c.size() + 1);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (size_t i = 0; i < c.size(); ++i) {
    const TensorEntry& t = ckptfs_test::StoredEntry(c[i]);
    BOOST_TEST_CONTEXT("tensor " << t.key) {
      BOOST_REQUIRE(h.doc.contains(t.key));
      const json& e = h.doc[t.key];
      std::vector<uint64_t> shape = t.shape;
      const std::string dtype = ServedName(t.dtype, &shape);
      BOOST_TEST(e["dtype"].get<std::string>() == dtype);
      BOOST_TEST(e["shape"].get<std::vector<uint64_t>>() == shape, boost::test_tools::per_element());
      const uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
      BOOST_TEST(end - begin == t.nbytes());
      // The reference writer's alignment: each tensor starts at a multiple of its item size.
      const uint64_t itemsize = ckptfs::Info(ckptfs::ServedAs(t.dtype).dtype).itemsize;
      BOOST_TEST(begin % itemsize == 0u);
      ranges.push_back({begin, end});
      const std::string got = whole.substr(8 + h.n + begin, end - begin);
      BOOST_TEST((got == expected(i)), "bytes of " << t.key << " differ");
    }
  }
  // Data offsets tile the buffer from 0 to the end of the file, in order.
  std::sort(ranges.begin(), ranges.end());
  uint64_t pos = 0;
  for (const auto& [b, e] : ranges) {
    BOOST_TEST(b == pos);
    pos = e;
  }
  BOOST_TEST(8 + h.n + pos == whole.size());
  return h;
}

// Boundaries inside model.safetensors: header end and the start of each tensor.
std::vector<uint64_t> ModelBoundaries(const Header& h) {
  std::vector<uint64_t> b = {8, 8 + h.n};
  for (const auto& [key, e] : h.doc.items())
    if (key != "__metadata__") b.push_back(8 + h.n + e["data_offsets"][0].get<uint64_t>());
  return b;
}

// Checks every per-tensor file: a one-entry header and the tensor's bytes.
template <typename ExpectedBytes>
void CheckTensorFiles(const View& view, std::mt19937_64& rng, int reads, ExpectedBytes expected) {
  const ckptfs::ServedTensors& c = view.served();  // as stored: no view options
  for (size_t i = 0; i < c.size(); ++i) {
    const TensorEntry& t = ckptfs_test::StoredEntry(c[i]);
    BOOST_TEST_CONTEXT("tensor file of " << t.key) {
      BOOST_TEST(view.TensorFilePath(i) == "tensors/" + ckptfs::TensorFileName(t.key));
      View::NodeId id = MustLookup(view, view.TensorFilePath(i));
      BOOST_TEST(view.node(id).tensor == static_cast<int64_t>(i));
      const std::string whole = ReadWhole(view, id);
      Header h = ParseHeader(whole);
      BOOST_TEST(h.n % 8 == 0u);
      BOOST_TEST(h.doc.size() == 2u);
      BOOST_TEST(h.doc[t.key]["data_offsets"] == json({0, t.nbytes()}));
      BOOST_TEST(whole.size() == 8 + h.n + t.nbytes());
      BOOST_TEST((whole.substr(8 + h.n) == expected(i)), "bytes of " << t.key << " differ");
      CheckReads(view, id, whole, rng, reads, {8 + h.n});
    }
  }
}

}  // namespace

// ---- the sample torch checkpoint --------------------------------------------------------------

BOOST_AUTO_TEST_CASE(sample_tree) {
  auto view = MustBuild(MustOpen(kSample));
  const View::Node& root = view->node(View::kRoot);
  BOOST_TEST(root.is_dir);
  BOOST_TEST(ChildNames(*view, View::kRoot) ==
                 std::vector<std::string>({"manifest.json", "metadata.json", "model.safetensors", "tensors"}),
             boost::test_tools::per_element());
  View::NodeId tensors = MustLookup(*view, "tensors");
  BOOST_TEST(view->node(tensors).is_dir);
  const auto names = ChildNames(*view, tensors);
  BOOST_TEST(names.size() == 24u);
  BOOST_TEST(std::is_sorted(names.begin(), names.end()));
  BOOST_TEST(view->Lookup("tensors/model.0.weight.safetensors").has_value());
  BOOST_TEST(view->PathOf(MustLookup(*view, "tensors/model.0.weight.safetensors")) ==
             "tensors/model.0.weight.safetensors");
  BOOST_TEST(!view->Lookup("tensors/model.0.weight").has_value());
  BOOST_TEST(!view->Lookup("nope").has_value());
  BOOST_TEST(!view->Child(MustLookup(*view, "model.safetensors"), "x").has_value());
  BOOST_TEST(MustLookup(*view, "") == View::kRoot);
  BOOST_TEST(FileNodes(*view).size() == 3u + 24u);  // every file is read by the tests below

  char buf[4];
  size_t nread = 99;
  Status s = view->Read(tensors, 0, sizeof buf, buf, &nread);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kInvalidArgument));
  BOOST_TEST(nread == 0u);
}

BOOST_AUTO_TEST_CASE(sample_model_file) {
  auto catalog = MustOpen(kSample);
  auto view = MustBuild(catalog);
  View::NodeId id = MustLookup(*view, "model.safetensors");
  const std::string whole = ReadWhole(*view, id);
  Header h = CheckModelFile(*view, whole, [&](size_t i) { return SourceBytes(*catalog, catalog->tensors[i]); });
  BOOST_TEST(whole.size() == 8 + h.n + 8904);
  // All F32: the data keeps catalog order.
  uint64_t pos = 0;
  for (const TensorEntry& t : catalog->tensors) {
    BOOST_TEST(h.doc[t.key]["data_offsets"][0].get<uint64_t>() == pos);
    pos += t.nbytes();
  }
  std::mt19937_64 rng(1);
  CheckReads(*view, id, whole, rng, 4000, ModelBoundaries(h));
}

BOOST_AUTO_TEST_CASE(sample_tensor_files) {
  auto catalog = MustOpen(kSample);
  auto view = MustBuild(catalog);
  std::mt19937_64 rng(2);
  CheckTensorFiles(*view, rng, 150, [&](size_t i) { return SourceBytes(*catalog, catalog->tensors[i]); });
}

BOOST_AUTO_TEST_CASE(sample_json_files) {
  auto catalog = MustOpen(kSample);
  auto view = MustBuild(catalog);
  std::mt19937_64 rng(3);
  const std::string meta = ReadWhole(*view, MustLookup(*view, "metadata.json"));
  BOOST_TEST(json::parse(meta) == catalog->metadata);
  CheckReads(*view, MustLookup(*view, "metadata.json"), meta, rng, 300);

  const View::NodeId mid = MustLookup(*view, "manifest.json");
  const std::string text = ReadWhole(*view, mid);
  CheckReads(*view, mid, text, rng, 300);
  const json m = json::parse(text);
  const Header h = ParseHeader(ReadWhole(*view, MustLookup(*view, "model.safetensors")));
  BOOST_TEST(m["model_file"] == "model.safetensors");
  BOOST_TEST(m["source"]["format"] == "torch-zip");
  BOOST_TEST(m["source"]["files"].at(0)["size"] == 16963);
  BOOST_REQUIRE_EQUAL(m["tensors"].size(), 24u);
  for (size_t i = 0; i < 24; ++i) {
    const json& e = m["tensors"][i];
    const TensorEntry& t = catalog->tensors[i];
    BOOST_TEST(e["key"] == t.key);
    BOOST_TEST(e["nbytes"] == t.nbytes());
    BOOST_TEST(e["file"] == view->TensorFilePath(i));
    const json& offs = h.doc[t.key]["data_offsets"];
    BOOST_TEST(e["model_offsets"] == json({8 + h.n + offs[0].get<uint64_t>(), 8 + h.n + offs[1].get<uint64_t>()}));
    BOOST_TEST(!e.contains("shared_storage"));  // every tensor has its own storage
    BOOST_TEST(!e.contains("file_name_shortened"));
  }
}

// ---- a generated safetensors source --------------------------------------------------------

namespace {

// A safetensors file with mixed item sizes in an order the model file must rearrange.
std::string MixedSafetensors() {
  struct T { const char* key; const char* dtype; std::vector<uint64_t> shape; size_t itemsize; };
  const T ts[] = {{"emb/tokens", "I8", {5}, 1},    {"ln.w", "F16", {7}, 2},    {"proj.w", "F64", {3, 2}, 8},
                  {"mask", "BOOL", {3}, 1},        {"empty", "F32", {0}, 4},   {"bf", "BF16", {2, 2}, 2},
                  {"ids", "I32", {4}, 4},          {"z", "C64", {2}, 8},       {"big", "F32", {257, 3}, 4}};
  json h;
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t pos = 0;
  for (const T& t : ts) {
    uint64_t n = t.itemsize;
    for (uint64_t d : t.shape) n *= d;
    h[t.key] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {pos, pos + n}}};
    pos += n;
  }
  return SafetensorsBytes(h.dump(), PatternBytes(pos, 11));
}

}  // namespace

BOOST_AUTO_TEST_CASE(safetensors_source_view) {
  TempDir dir;
  const std::string path = dir.File("mixed.safetensors");
  WriteFile(path, MixedSafetensors());
  auto catalog = MustOpen(path);
  auto view = MustBuild(catalog);
  auto expected = [&](size_t i) { return SourceBytes(*catalog, catalog->tensors[i]); };
  View::NodeId id = MustLookup(*view, "model.safetensors");
  const std::string whole = ReadWhole(*view, id);
  Header h = CheckModelFile(*view, whole, expected);
  // Descending item size: the 8-byte tensors come first, the 1-byte ones last.
  BOOST_TEST(h.doc["proj.w"]["data_offsets"][0] == 0);
  BOOST_TEST(h.doc["z"]["data_offsets"][0] == 48);
  BOOST_TEST(h.doc["z"]["dtype"] == "C64");
  BOOST_TEST(h.doc["mask"]["data_offsets"][1].get<uint64_t>() == whole.size() - 8 - h.n);
  BOOST_TEST(h.doc["empty"]["data_offsets"][0] == h.doc["empty"]["data_offsets"][1]);
  std::mt19937_64 rng(4);
  CheckReads(*view, id, whole, rng, 3000, ModelBoundaries(h));
  CheckTensorFiles(*view, rng, 100, expected);
  // The escaped name of a key with '/'.
  BOOST_TEST(view->Lookup("tensors/emb%2Ftokens.safetensors").has_value());
}

// ---- hand-built catalogs: strided and multi-range tensors -------------------------------------

namespace {

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

struct HandBuilt {
  TempDir dir;
  std::string path = dir.File("source.bin");
  std::shared_ptr<Catalog> catalog = std::make_shared<Catalog>();
  uint32_t file = 0;

  explicit HandBuilt(const std::string& bytes) {
    WriteFile(path, bytes);
    catalog->format = "test";
    catalog->source = path;
    Status s = catalog->files->Add(path, &file);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  }
  TensorEntry& Add(std::string key, DType dtype, std::vector<uint64_t> shape) {
    TensorEntry t;
    t.path = {key};
    t.key = std::move(key);
    t.dtype = dtype;
    t.shape = std::move(shape);
    catalog->tensors.push_back(std::move(t));
    return catalog->tensors.back();
  }
};

constexpr uint64_t kBig = 600;  // kBig * kBig elements exceed one gather chunk (2^18)

}  // namespace

BOOST_AUTO_TEST_CASE(strided_and_multi_range_tensors) {
  // Source layout: 16 junk bytes, 12 floats 0..11, 12 int16 100..111, 6 complex128
  // (12 doubles), then a kBig x kBig float matrix with value r * kBig + c at (r, c).
  std::vector<float> f12(12);
  for (int i = 0; i < 12; ++i) f12[i] = static_cast<float>(i);
  std::vector<int16_t> i12(12);
  for (int i = 0; i < 12; ++i) i12[i] = static_cast<int16_t>(100 + i);
  std::vector<double> d12(12);
  for (int i = 0; i < 12; ++i) d12[i] = 0.5 * i;
  std::vector<float> big(kBig * kBig);
  for (uint64_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i);
  const uint64_t f_off = 16, i_off = f_off + 48, d_off = i_off + 24, big_off = d_off + 96;
  HandBuilt hb(std::string(16, 'J') + Bytes(f12) + Bytes(i12) + Bytes(d12) + Bytes(big));

  // t = (3x4 row-major matrix of f12).T: shape (4, 3), element (i, j) = f12[i + 4 j].
  hb.Add("t", DType::kF32, {4, 3}).boxes = {Box::Strided(hb.file, f_off, {4, 3}, {1, 4})};
  // u = i12 viewed as (2, 2, 3) then permuted to (3, 2, 2): element (i, j, k) = A[j][k][i].
  hb.Add("u", DType::kI16, {3, 2, 2}).boxes = {Box::Strided(hb.file, i_off, {3, 2, 2}, {1, 6, 3})};
  // c = f12[0:3] ++ f12[6:9] as two ranges.
  hb.Add("c", DType::kF32, {6}).boxes = {Box::Range(hb.file, f_off, 0, 3), Box::Range(hb.file, f_off + 24, 3, 3)};
  // z: complex128 served as float64 with a trailing 2.
  hb.Add("z", DType::kC128, {6}).boxes = {Box::Range(hb.file, d_off, 0, 6)};
  // A row of a strided tensor with a zero-length dimension, and a 0-d strided tensor.
  hb.Add("none", DType::kF32, {0, 3}).boxes = {Box::Strided(hb.file, f_off, {0, 3}, {1, 4})};
  hb.Add("scalar", DType::kF32, {}).boxes = {Box::Strided(hb.file, f_off + 20, {}, {})};
  // The big matrix transposed: gathered in several chunks.
  hb.Add("big.T", DType::kF32, {kBig, kBig}).boxes = {Box::Strided(hb.file, big_off, {kBig, kBig}, {1, kBig})};

  std::map<std::string, std::string> expected;
  {
    std::vector<float> t;
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 3; ++j) t.push_back(static_cast<float>(i + 4 * j));
    expected["t"] = Bytes(t);
    std::vector<int16_t> u;
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 2; ++j)
        for (int k = 0; k < 2; ++k) u.push_back(static_cast<int16_t>(100 + j * 6 + k * 3 + i));
    expected["u"] = Bytes(u);
    expected["c"] = Bytes(std::vector<float>{0, 1, 2, 6, 7, 8});
    expected["z"] = Bytes(d12);
    expected["none"] = "";
    expected["scalar"] = Bytes(std::vector<float>{5});
    std::vector<float> bt;
    for (uint64_t i = 0; i < kBig; ++i)
      for (uint64_t j = 0; j < kBig; ++j) bt.push_back(static_cast<float>(j * kBig + i));
    expected["big.T"] = Bytes(bt);
  }
  auto view = MustBuild(hb.catalog);
  auto want = [&](size_t i) { return expected.at(hb.catalog->tensors[i].key); };
  View::NodeId id = MustLookup(*view, "model.safetensors");
  const std::string whole = ReadWhole(*view, id);
  Header h = CheckModelFile(*view, whole, want);
  BOOST_TEST(h.doc["z"]["dtype"] == "F64");
  BOOST_TEST(h.doc["z"]["shape"] == json({6, 2}));
  std::mt19937_64 rng(5);
  CheckReads(*view, id, whole, rng, 2000, ModelBoundaries(h));
  CheckTensorFiles(*view, rng, 200, want);
  // Reads that start and end inside elements of the gathered matrix, across chunk edges.
  const View::NodeId bid = MustLookup(*view, view->TensorFilePath(6));
  const std::string bwhole = ReadWhole(*view, bid);
  const uint64_t data = bwhole.size() - kBig * kBig * 4;
  const uint64_t chunk = (uint64_t{1} << 18) * 4;
  for (uint64_t at : {data + 1, data + chunk - 3, data + chunk + 2, data + 2 * chunk - 1, data + 1000003})
    for (size_t len : {1, 2, 5, 4099, 1 << 20}) CheckRead(*view, bid, bwhole, at, len);
}

BOOST_AUTO_TEST_CASE(strided_gather_over_a_wide_span) {
  // Rows 80 MB apart: the gather cannot read the covering span in one pread and must
  // fall back to one read per contiguous run. A sparse file keeps the test cheap.
  TempDir dir;
  const std::string path = dir.File("sparse.bin");
  const uint64_t row = 20'000'000;  // elements between rows
  {
    int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
    BOOST_REQUIRE(fd >= 0);
    const float r0[3] = {1.5f, 2.5f, 3.5f}, r1[3] = {-1, -2, -3};
    BOOST_REQUIRE(::pwrite(fd, r0, sizeof r0, 64) == static_cast<ssize_t>(sizeof r0));
    BOOST_REQUIRE(::pwrite(fd, r1, sizeof r1, 64 + row * 4) == static_cast<ssize_t>(sizeof r1));
    BOOST_REQUIRE(::ftruncate(fd, 64 + row * 4 + 4096) == 0);
    ::close(fd);
  }
  auto catalog = std::make_shared<Catalog>();
  catalog->source = path;
  uint32_t file = 0;
  BOOST_REQUIRE(catalog->files->Add(path, &file).ok());
  TensorEntry t;
  t.key = "rows";
  t.path = {t.key};
  t.dtype = DType::kF32;
  t.shape = {2, 3};
  t.boxes = {Box::Strided(file, 64, t.shape, {row, 1})};
  catalog->tensors.push_back(t);
  auto view = MustBuild(catalog);
  const View::NodeId id = MustLookup(*view, "tensors/rows.safetensors");
  const std::string whole = ReadWhole(*view, id);
  const Header h = ParseHeader(whole);
  BOOST_TEST((whole.substr(8 + h.n) == Bytes(std::vector<float>{1.5f, 2.5f, 3.5f, -1, -2, -3})));
  std::mt19937_64 rng(6);
  CheckReads(*view, id, whole, rng, 300, {8 + h.n, 8 + h.n + 12});
}

// ---- sources that change under the view ---------------------------------------------------------

namespace {

void SetMTime(const std::string& path, time_t sec) {
  struct timespec times[2] = {{sec, 0}, {sec, 0}};
  BOOST_REQUIRE(::utimensat(AT_FDCWD, path.c_str(), times, 0) == 0);
}

void CheckChanged(const View& view, View::NodeId id, uint64_t offset, const std::string& path) {
  std::string buf(64, '\0');
  size_t nread = 0;
  Status s = view.Read(id, offset, buf.size(), buf.data(), &nread);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kSourceChanged), s.message());
  BOOST_TEST(StartsWith(s.message(), path + ": "), s.message());
}

}  // namespace

BOOST_AUTO_TEST_CASE(changed_sources_fail_reads) {
  // Each kind of change on a fresh source and view: once a source changed, its identity
  // (which includes the ctime) never matches again, so the cases cannot share one view.
  enum class Change { kMTime, kSize, kRewriteKeepingMTime, kReplace };
  for (Change change : {Change::kMTime, Change::kSize, Change::kRewriteKeepingMTime, Change::kReplace}) {
    BOOST_TEST_CONTEXT("change " << static_cast<int>(change)) {
      TempDir dir;
      const std::string path = dir.File("m.safetensors");
      const std::string bytes = MixedSafetensors();
      WriteFile(path, bytes);
      SetMTime(path, 1'600'000'000);
      auto view = MustBuild(MustOpen(path));
      const View::NodeId model = MustLookup(*view, "model.safetensors");
      const View::NodeId first = MustLookup(*view, view->TensorFilePath(0));
      const uint64_t data = view->node(model).size - 64;  // inside the tensor data
      std::string buf(64, '\0');
      size_t nread = 0;
      BOOST_REQUIRE(view->Read(model, data, 64, buf.data(), &nread).ok());
      switch (change) {
        case Change::kMTime:  // same bytes, new mtime
          SetMTime(path, 1'600'000'100);
          break;
        case Change::kSize:  // rewritten in place, one byte longer, old mtime put back
          WriteFile(path, bytes + "x");
          SetMTime(path, 1'600'000'000);
          break;
        case Change::kRewriteKeepingMTime: {  // same size and mtime, other tensor bytes
          std::string other = bytes;
          other.back() ^= 0x55;
          WriteFile(path, other);
          SetMTime(path, 1'600'000'000);
          break;
        }
        case Change::kReplace: {  // another file of identical bytes and mtime renamed over it
          const std::string other = dir.File("other");
          WriteFile(other, bytes);
          SetMTime(other, 1'600'000'000);
          BOOST_REQUIRE(::rename(other.c_str(), path.c_str()) == 0);
          break;
        }
      }
      CheckChanged(*view, model, data, path);
      CheckChanged(*view, first, view->node(first).size - 1, path);
    }
  }
}

BOOST_AUTO_TEST_CASE(changed_source_fails_strided_reads) {
  std::vector<float> f(12);
  for (int i = 0; i < 12; ++i) f[i] = static_cast<float>(i);
  HandBuilt hb(Bytes(f));
  SetMTime(hb.path, 1'600'000'000);
  // The identity recorded at Add predates the SetMTime above: re-add in a fresh catalog.
  auto catalog = std::make_shared<Catalog>();
  uint32_t file = 0;
  BOOST_REQUIRE(catalog->files->Add(hb.path, &file).ok());
  TensorEntry t;
  t.key = "t";
  t.path = {t.key};
  t.shape = {4, 3};
  t.boxes = {Box::Strided(file, 0, t.shape, {1, 4})};
  catalog->tensors.push_back(t);
  auto view = MustBuild(catalog);
  const View::NodeId id = MustLookup(*view, "tensors/t.safetensors");
  const uint64_t last = view->node(id).size - 8;
  char buf[8];
  size_t nread = 0;
  BOOST_REQUIRE(view->Read(id, last, 8, buf, &nread).ok());
  SetMTime(hb.path, 1'700'000'000);
  CheckChanged(*view, id, last, hb.path);
}

// ---- manifest entries for shortened names ---------------------------------------------------

BOOST_AUTO_TEST_CASE(manifest_flags_exactly_the_shortened_names) {
  auto catalog = std::make_shared<Catalog>();
  auto add = [&](std::string key) {
    TensorEntry t;
    t.path = {key};
    t.key = std::move(key);
    t.shape = {0};  // no bytes needed
    catalog->tensors.push_back(std::move(t));
  };
  add(std::string(400, 'a'));                            // shortened to 255 bytes
  std::string accented = "b";                            // shortened, but the cut falls inside
  while (accented.size() < 400) accented += "\xc3\xa9";  // a 2-byte character: 254 bytes
  add(accented);
  add(std::string(120, 'c') + "~" + std::string(122, 'c'));  // 255 bytes with '~', not shortened
  add("short~name");
  auto view = MustBuild(catalog);
  const json m = json::parse(ReadWhole(*view, MustLookup(*view, "manifest.json")));
  BOOST_REQUIRE_EQUAL(m["tensors"].size(), 4u);
  const bool shortened[] = {true, true, false, false};
  for (size_t i = 0; i < 4; ++i) {
    const std::string name = ckptfs::TensorFileName(catalog->tensors[i].key);
    BOOST_TEST_CONTEXT("tensor " << i << ", file name of " << name.size() << " bytes") {
      BOOST_TEST(m["tensors"][i].value("file_name_shortened", false) == shortened[i]);
      BOOST_TEST(m["tensors"][i]["key"] == catalog->tensors[i].key);
    }
  }
}

// ---- files made from the catalog on first need, under concurrency ---------------------------

namespace {

// `count` tensors of mixed item sizes over one source file, keys in an order that is not
// their file names' order ("t.10" before "t.9").
std::shared_ptr<HandBuilt> ManySmallTensors(size_t count) {
  std::string bytes;
  for (size_t i = 0; i < count * 16; ++i) bytes.push_back(static_cast<char>(i * 131 + 7));
  auto built = std::make_shared<HandBuilt>(bytes);
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kI64, DType::kU8};
  for (size_t i = 0; i < count; ++i) {
    const DType dtype = dtypes[i % 4];
    const uint64_t itemsize = ckptfs::Info(dtype).itemsize;
    TensorEntry& t = built->Add("layer%/" + std::to_string(count - i) + ".w", dtype, {16 / itemsize});
    t.boxes.push_back(Box::Range(built->file, i * 16, 0, 16 / itemsize));
    if (i % 7 == 0) t.storage_id = std::to_string(i / 14);  // some tied pairs
  }
  return built;
}

}  // namespace

BOOST_AUTO_TEST_CASE(tensor_folder_is_in_file_name_order) {
  auto built = ManySmallTensors(3000);
  auto view = MustBuild(built->catalog);
  const View::NodeId dir = MustLookup(*view, "tensors");
  BOOST_REQUIRE_EQUAL(view->ChildCount(dir), 3000u);
  std::vector<std::string> expected;
  for (const TensorEntry& t : built->catalog->tensors) expected.push_back(ckptfs::TensorFileName(t.key));
  std::sort(expected.begin(), expected.end());
  for (size_t k = 0; k < expected.size(); ++k) {
    const View::NodeId c = view->ChildAt(dir, k);
    BOOST_REQUIRE_EQUAL(view->NameOf(c), expected[k]);
    BOOST_REQUIRE(view->Child(dir, expected[k]) == c);
    const View::Node n = view->node(c);
    BOOST_REQUIRE_EQUAL(n.parent, dir);
    BOOST_REQUIRE(n.tensor >= 0 && view->TensorFile(static_cast<size_t>(n.tensor)) == c);
    BOOST_REQUIRE_EQUAL(view->PathOf(c), "tensors/" + expected[k]);
  }
  BOOST_TEST(!view->Child(dir, "layer%25%2F0.w.safetensors").has_value());
  BOOST_TEST(!view->Child(dir, "zzz").has_value());
  BOOST_TEST(!view->Child(dir, "").has_value());
}

BOOST_AUTO_TEST_CASE(files_laid_out_on_first_need_are_the_same_under_concurrent_first_use) {
  auto built = ManySmallTensors(5000);
  // The reference: one thread, every file read whole.
  auto reference = MustBuild(built->catalog);
  const std::vector<std::string> names = {"model.safetensors", "manifest.json", "metadata.json"};
  std::map<std::string, std::string> whole;
  for (const auto& name : names) whole[name] = ReadWhole(*reference, MustLookup(*reference, name));
  {
    const json m = json::parse(whole["manifest.json"]);
    BOOST_REQUIRE_EQUAL(m["tensors"].size(), 5000u);
    uint64_t header = 0;
    std::memcpy(&header, whole["model.safetensors"].data(), 8);
    const json h = json::parse(whole["model.safetensors"].substr(8, header));
    BOOST_REQUIRE_EQUAL(h.size(), 5001u);  // and __metadata__
    // Each entry's model_offsets hold its data as the tensor file does.
    std::mt19937_64 rng(3);
    for (int n = 0; n < 200; ++n) {
      const json& e = m["tensors"][rng() % 5000];
      const uint64_t begin = e["model_offsets"][0], end = e["model_offsets"][1];
      const std::string file = ReadWhole(*reference, MustLookup(*reference, e["file"].get<std::string>()));
      BOOST_REQUIRE_EQUAL(whole["model.safetensors"].substr(begin, end - begin), file.substr(file.size() - (end - begin)));
    }
  }
  // Fresh views, so that the layouts are made by whichever thread comes first: threads start
  // together and each asks for sizes and reads at random places.
  for (int round = 0; round < 4; ++round) {
    auto view = MustBuild(built->catalog);
    std::atomic<int> ready{0};
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(round * 100 + t);
        ready.fetch_add(1);
        while (ready.load() < 8) {
        }
        for (int n = 0; n < 300; ++n) {
          const std::string& name = names[(t + n) % names.size()];
          const View::NodeId id = *view->Lookup(name);
          const std::string& expect = whole[name];
          if (view->node(id).size != expect.size()) failures.fetch_add(1);
          const uint64_t offset = rng() % expect.size();
          const size_t length = 1 + rng() % 70000;
          std::string buf(length, '\0');
          size_t nread = 0;
          if (!view->Read(id, offset, length, buf.data(), &nread).ok() ||
              buf.substr(0, nread) != expect.substr(offset, length))
            failures.fetch_add(1);
        }
      });
    }
    for (auto& th : threads) th.join();
    BOOST_TEST(failures.load() == 0);
  }
}

// A catalog large enough that tensors/ is sorted in parts on several threads and merged:
// keys in shuffled order, some escaped ('/' and '%'), some sharing long prefixes and
// differing only past the 8 bytes the sort compares first. The folder lists every tensor
// once, in strictly increasing name order, and each name finds its tensor.
BOOST_AUTO_TEST_CASE(large_tensor_folder_is_sorted_across_parts) {
  const size_t n = 200'003;
  auto catalog = std::make_shared<Catalog>();
  catalog->source = "generated";
  std::vector<std::string> keys;
  for (size_t i = 0; i < n; ++i) {
    if (i % 5 == 0) keys.push_back("block." + std::to_string(i % 977) + ".same_long_prefix_" + std::to_string(i));
    else if (i % 11 == 0) keys.push_back("odd/" + std::to_string(i) + "%x");
    else keys.push_back("layers." + std::to_string(i) + ".weight");
  }
  std::shuffle(keys.begin(), keys.end(), std::mt19937(11));
  for (std::string& key : keys) {
    TensorEntry t;
    t.key = std::move(key);
    t.shape = {0};  // no elements, no boxes
    catalog->tensors.push_back(std::move(t));
  }
  std::unique_ptr<View> view = MustBuild(catalog);
  const View::NodeId dir = MustLookup(*view, "tensors");
  BOOST_REQUIRE_EQUAL(view->ChildCount(dir), n);
  std::vector<bool> seen(n, false);
  std::string previous;
  for (size_t k = 0; k < n; ++k) {
    const View::NodeId id = view->ChildAt(dir, k);
    const std::string name = view->NameOf(id);
    if (k > 0) BOOST_REQUIRE_MESSAGE(previous < name, previous << " before " << name);
    const View::Node node = view->node(id);
    BOOST_REQUIRE(node.tensor >= 0);
    BOOST_REQUIRE(!seen[node.tensor]);
    seen[node.tensor] = true;
    BOOST_REQUIRE_EQUAL(name, ckptfs::TensorFileName(catalog->tensors[node.tensor].key));
    if (k % 997 == 0) BOOST_REQUIRE_EQUAL(MustLookup(*view, "tensors/" + name), id);
    previous = name;
  }
}

// Two keys naming one file, far apart in the catalog (so in different parts of the sort):
// the View refuses them, as it does two neighbours.
BOOST_AUTO_TEST_CASE(repeated_file_name_found_across_parts) {
  auto catalog = std::make_shared<Catalog>();
  catalog->source = "generated";
  for (size_t i = 0; i < 150'000; ++i) {
    TensorEntry t;
    t.key = i == 149'990 ? "layers.7.weight" : "layers." + std::to_string(i) + ".weight";
    t.shape = {0};
    catalog->tensors.push_back(std::move(t));
  }
  std::unique_ptr<View> view;
  Status s = View::Build(catalog, ckptfs::ViewOptions{}, &view);
  BOOST_REQUIRE(!s.ok());
  BOOST_TEST(Contains(s.message(), "two tensor keys map to the file name 'layers.7.weight.safetensors'"), s.message());
}
