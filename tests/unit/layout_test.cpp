// Tensors as boxes (include/ckptfs/catalog.hpp): tensors assembled from boxes in several
// files — tiled along dim 0 and dim 1, 2-D and 3-D grids with uneven last boxes, transposed
// and permuted boxes, ZeRO-like flattened ranges — read through a View (per-tensor files,
// model.safetensors, ReadTensorData) at random offsets and lengths, partial elements
// included, and compared with the tensor assembled here element by element; then the same
// with dtype conversion. ValidateLayout refuses gaps, overlaps, boxes outside the shape or
// past their file, overflowing strides and mixed ranks, naming the tensor.
#define BOOST_TEST_MODULE layout_test
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <numeric>
#include <random>

#include "ckptfs/view.hpp"
#include "test_util.hpp"
#include "view/convert.hpp"

using ckptfs::Box;
using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::ReadRoute;
using ckptfs::Status;
using ckptfs::TensorEntry;
using ckptfs::View;
using json = nlohmann::json;
using namespace ckptfs_test;

namespace {

// A catalog whose source files live in an in-memory Env (these tests are about the layout,
// not the disk).
class Sources {
 public:
  Sources() {
    memory_.Attach(catalog.get());
    catalog->format = "test";
    catalog->source = "/mem";
  }

  // A new source file holding `bytes`; returns its index in catalog->files.
  uint32_t AddFile(std::string bytes) {
    const std::string path = memory_.Write("/mem/file" + std::to_string(catalog->files->count()), bytes);
    uint32_t index = 0;
    Status s = catalog->files->Add(path, &index);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    return index;
  }

  // Replaces file `index` by its old bytes followed by `tail`, as a writer would.
  void Rewrite(uint32_t index, const std::string& tail) {
    const ckptfs::SourceFiles& files = *catalog->files;
    std::string bytes(files.size(index), '\0');
    Status s = files.ReadExact(index, 0, bytes.size(), bytes.data());
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    memory_.Write(files.path(index), bytes + tail);
  }

  std::shared_ptr<Catalog> catalog = std::make_shared<Catalog>();

 private:
  MemorySource memory_;
};

// A tensor's elements in row-major order, as the test knows them.
struct Reference {
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  std::string bytes;

  uint64_t itemsize() const { return ckptfs::Info(dtype).itemsize; }
  uint64_t numel() const { return bytes.size() / itemsize(); }
  // The bytes of the element at multi-index `index`.
  std::string_view Element(const std::vector<uint64_t>& index) const {
    uint64_t position = 0;
    for (size_t d = 0; d < shape.size(); ++d) position = position * shape[d] + index[d];
    return std::string_view(bytes).substr(position * itemsize(), itemsize());
  }
};

Reference RandomReference(DType dtype, std::vector<uint64_t> shape, std::mt19937_64& rng) {
  Reference ref;
  ref.dtype = dtype;
  ref.shape = std::move(shape);
  const uint64_t n = std::accumulate(ref.shape.begin(), ref.shape.end(), uint64_t{1}, std::multiplies<>());
  ref.bytes.resize(n * ref.itemsize());
  for (char& c : ref.bytes) c = static_cast<char>(rng());
  return ref;
}

// Builds source files box by box: each box's elements are appended to a file's bytes,
// behind a few junk bytes so that no box starts where the previous one ended.
class Layouts {
 public:
  explicit Layouts(size_t files) : files_(files) {}

  // The elements of `ref` in the box [offset, offset + extent), stored in file `file` with
  // its dimensions nested in `order` (outermost first; empty: row-major).
  Box Put(size_t file, const Reference& ref, std::vector<uint64_t> offset, std::vector<uint64_t> extent,
          std::vector<size_t> order = {}) {
    const size_t rank = extent.size();
    if (order.empty()) {
      order.resize(rank);
      std::iota(order.begin(), order.end(), size_t{0});
    }
    Box box;
    box.file = static_cast<uint32_t>(file);
    box.strides.assign(rank, 0);
    uint64_t stride = 1;
    for (size_t k = rank; k-- > 0;) {
      box.strides[order[k]] = stride;
      stride *= extent[order[k]];
    }
    std::string& bytes = files_[file];
    bytes += std::string(3 * ref.itemsize() + 5, 'J');
    box.base_offset = bytes.size();
    // Walk the box in storage order, copying each element from the reference.
    std::vector<uint64_t> at(rank, 0), index(rank);
    for (uint64_t k = 0; k < stride; ++k) {
      for (size_t d = 0; d < rank; ++d) index[d] = offset[d] + at[d];
      bytes += ref.Element(index);
      for (size_t j = rank; j-- > 0;)
        if (++at[order[j]] < extent[order[j]]) break;
        else at[order[j]] = 0;
    }
    box.offset = std::move(offset);
    box.extent = std::move(extent);
    return box;
  }

  // Elements [first, first + count) of `ref` flattened, `spacing` elements apart in file
  // `file` (1: a plain byte range).
  Box PutRange(size_t file, const Reference& ref, uint64_t first, uint64_t count, uint64_t spacing = 1) {
    std::string& bytes = files_[file];
    bytes += std::string(2 * ref.itemsize() + 1, 'K');
    Box box = Box::Range(static_cast<uint32_t>(file), bytes.size(), first, count);
    box.strides = {spacing};
    for (uint64_t k = 0; k < count; ++k) {
      bytes += std::string_view(ref.bytes).substr((first + k) * ref.itemsize(), ref.itemsize());
      if (k + 1 < count) bytes += std::string((spacing - 1) * ref.itemsize(), 'S');
    }
    return box;
  }

  // Writes the files into `sources` (their indices must be the ones the boxes name).
  void Write(Sources* sources) {
    for (size_t f = 0; f < files_.size(); ++f) {
      files_[f] += "tail";
      BOOST_REQUIRE_EQUAL(sources->AddFile(files_[f]), f);
    }
  }

 private:
  std::vector<std::string> files_;
};

// Tensors of every layout the boxes can express, with their reference bytes.
struct Tiled {
  Sources sources;
  std::vector<Reference> refs;

  explicit Tiled(uint64_t seed) {
    std::mt19937_64 rng(seed);
    Layouts l(4);
    auto add = [&](std::string key, Reference ref, std::vector<Box> boxes) {
      TensorEntry t;
      t.path = {key};
      t.key = std::move(key);
      t.dtype = ref.dtype;
      t.shape = ref.shape;
      t.boxes = std::move(boxes);
      sources.catalog->tensors.push_back(std::move(t));
      refs.push_back(std::move(ref));
    };
    // FSDP-style: rows split over files, each block row-major.
    Reference dim0 = RandomReference(DType::kF32, {10, 7}, rng);
    add("dim0", dim0,
        {l.Put(0, dim0, {0, 0}, {3, 7}), l.Put(1, dim0, {3, 0}, {4, 7}), l.Put(0, dim0, {7, 0}, {3, 7})});
    // Tensor-parallel Shard(1): column blocks, listed out of order.
    Reference dim1 = RandomReference(DType::kF32, {6, 9}, rng);
    add("dim1", dim1, {l.Put(2, dim1, {0, 4}, {6, 5}), l.Put(1, dim1, {0, 0}, {6, 4})});
    // A 2-D mesh with uneven last blocks along both dimensions, some stored transposed.
    Reference grid = RandomReference(DType::kF32, {7, 10}, rng);
    std::vector<Box> grid_boxes;
    const uint64_t rows[] = {0, 3, 6, 7}, cols[] = {0, 4, 8, 10};
    for (size_t i = 0; i < 3; ++i)
      for (size_t j = 0; j < 3; ++j)
        grid_boxes.push_back(l.Put((i + j) % 4, grid, {rows[i], cols[j]}, {rows[i + 1] - rows[i], cols[j + 1] - cols[j]},
                                   (i + j) % 2 ? std::vector<size_t>{1, 0} : std::vector<size_t>{}));
    add("grid", grid, grid_boxes);
    // One transposed box over the whole shape (a strided view of one storage).
    Reference transposed = RandomReference(DType::kF32, {50, 40}, rng);
    add("transposed", transposed, {l.Put(3, transposed, {0, 0}, {50, 40}, {1, 0})});
    // ZeRO-style flattened ranges of uneven lengths over every file.
    Reference flat = RandomReference(DType::kF32, {9, 11}, rng);
    add("flat", flat,
        {l.PutRange(2, flat, 0, 25), l.PutRange(0, flat, 25, 25), l.PutRange(3, flat, 50, 40), l.PutRange(1, flat, 90, 9)});
    // Flattened, one range spaced out in its file: gathered.
    Reference spaced = RandomReference(DType::kI16, {4, 5}, rng);
    add("flat.spaced", spaced, {l.PutRange(0, spaced, 0, 7), l.PutRange(1, spaced, 7, 13, 3)});
    // 3-D, cut along dims 1 and 2, blocks stored with permuted dimensions.
    Reference cube = RandomReference(DType::kF16, {4, 6, 5}, rng);
    add("cube", cube,
        {l.Put(0, cube, {0, 0, 0}, {4, 2, 5}, {2, 0, 1}), l.Put(1, cube, {0, 2, 0}, {4, 4, 3}, {1, 2, 0}),
         l.Put(2, cube, {0, 2, 3}, {4, 4, 2})});
    // Larger than one gather step (2^18 elements): Shard(1) with one transposed block.
    Reference wide = RandomReference(DType::kF32, {600, 900}, rng);
    add("wide", wide,
        {l.Put(0, wide, {0, 0}, {600, 300}), l.Put(1, wide, {0, 300}, {600, 500}, {1, 0}),
         l.Put(2, wide, {0, 800}, {600, 100})});
    // Integers are served as stored under a dtype conversion.
    Reference ints = RandomReference(DType::kI64, {5, 6}, rng);
    add("ints", ints, {l.Put(3, ints, {0, 3}, {5, 3}), l.Put(2, ints, {0, 0}, {5, 3}, {1, 0})});
    // A 0-d tensor in a rank-0 box, and a tensor without elements (no boxes).
    Reference scalar = RandomReference(DType::kF64, {}, rng);
    add("scalar", scalar, {l.Put(1, scalar, {}, {})});
    add("empty", RandomReference(DType::kF32, {0, 3}, rng), {});
    l.Write(&sources);
  }
};

std::unique_ptr<View> MustBuild(std::shared_ptr<const Catalog> catalog, ckptfs::ViewOptions options = {}) {
  for (const TensorEntry& t : catalog->tensors) {
    Status valid = ckptfs::ValidateLayout(t, *catalog->files, catalog->source);
    BOOST_REQUIRE_MESSAGE(valid.ok(), valid.message());
  }
  std::unique_ptr<View> view;
  Status s = View::Build(std::move(catalog), options, &view);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return view;
}

std::string ReadRange(const View& view, View::NodeId id, uint64_t offset, size_t length) {
  std::string out(length, '\0');
  size_t nread = 0;
  Status s = view.Read(id, offset, length, out.data(), &nread);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  out.resize(nread);
  return out;
}

// `reads` random reads of file `id` (offsets anywhere, lengths from one byte to the whole
// file) against `whole`.
void CheckRandomReads(const View& view, View::NodeId id, const std::string& whole, std::mt19937_64& rng, int reads) {
  for (int i = 0; i < reads; ++i) {
    const uint64_t offset = std::uniform_int_distribution<uint64_t>(0, whole.size())(rng);
    const uint64_t max_len = i % 8 == 0 ? whole.size() : std::min<uint64_t>(whole.size(), 777);
    const size_t length = std::uniform_int_distribution<uint64_t>(1, std::max<uint64_t>(1, max_len))(rng);
    const std::string got = ReadRange(view, id, offset, length);
    BOOST_REQUIRE_MESSAGE(got == whole.substr(std::min<uint64_t>(offset, whole.size()), length),
                          view.PathOf(id) << " read(" << offset << ", " << length << ") differs");
  }
}

// The data offsets of `key` in a safetensors file's header.
std::pair<uint64_t, uint64_t> DataRange(const std::string& file, const std::string& key) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);
  const json header = json::parse(file.substr(8, n));
  const json& offsets = header.at(key).at("data_offsets");
  return {8 + n + offsets[0].get<uint64_t>(), 8 + n + offsets[1].get<uint64_t>()};
}

// The tensor as served under `options`: the reference, converted where the view converts.
std::string Served(const Reference& ref, const ckptfs::ViewOptions& options) {
  if (!options.dtype || !ckptfs::ConvertsTo(ref.dtype, *options.dtype)) return ref.bytes;
  std::string out(ref.numel() * ckptfs::Info(*options.dtype).itemsize, '\0');
  ckptfs::ConvertElements(ref.dtype, *options.dtype, ref.bytes.data(), ref.numel(), out.data());
  return out;
}

void CheckServed(const Tiled& tiled, const ckptfs::ViewOptions& options, uint64_t seed) {
  auto view = MustBuild(tiled.sources.catalog, options);
  std::mt19937_64 rng(seed);
  const View::NodeId model = *view->Lookup("model.safetensors");
  const std::string model_bytes = ReadRange(*view, model, 0, view->node(model).size);
  for (size_t i = 0; i < tiled.refs.size(); ++i) {
    const ckptfs::ServedTensor t = view->served()[i];
    const std::string expected = Served(tiled.refs[i], options);
    BOOST_TEST_CONTEXT("tensor " << t.key()) {
      BOOST_REQUIRE_EQUAL(t.nbytes(), expected.size());
      // Its own file: the data after the header, then random reads of any part of it.
      const View::NodeId id = view->TensorFile(i);
      const std::string whole = ReadRange(*view, id, 0, view->node(id).size);
      BOOST_REQUIRE(whole.size() >= expected.size());
      BOOST_TEST((whole.substr(whole.size() - expected.size()) == expected));
      CheckRandomReads(*view, id, whole, rng, 200);
      // Its place in model.safetensors.
      const auto [begin, end] = DataRange(model_bytes, std::string(t.key()));
      BOOST_TEST((model_bytes.substr(begin, end - begin) == expected));
      // The device loader's reads: any range, partial elements included.
      for (int k = 0; k < 100 && !expected.empty(); ++k) {
        const uint64_t offset = std::uniform_int_distribution<uint64_t>(0, expected.size() - 1)(rng);
        const uint64_t length = std::uniform_int_distribution<uint64_t>(0, expected.size() - offset)(rng);
        std::string got(length, '\0');
        Status s = view->ReadTensorData(i, offset, length, got.data());
        BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
        BOOST_REQUIRE_MESSAGE(got == expected.substr(offset, length), "ReadTensorData(" << offset << ", " << length << ")");
      }
    }
  }
  CheckRandomReads(*view, model, model_bytes, rng, 1000);
}

}  // namespace

BOOST_AUTO_TEST_CASE(routes_of_the_layouts) {
  Tiled tiled(1);
  const auto& tensors = tiled.sources.catalog->tensors;
  const ckptfs::ServedTensors served(tiled.sources.catalog);
  auto route = [&](const std::string& key) {
    for (size_t i = 0; i < served.size(); ++i)
      if (served[i].key() == key) return ckptfs::RouteOf(served[i]);
    BOOST_FAIL("no tensor " << key);
    return ReadRoute::kConvert;
  };
  // Row blocks and byte ranges concatenate; anything else is gathered.
  for (const char* key : {"dim0", "flat", "scalar", "empty"}) BOOST_TEST((route(key) == ReadRoute::kExtents), key);
  for (const char* key : {"dim1", "grid", "transposed", "flat.spaced", "cube", "wide", "ints"})
    BOOST_TEST((route(key) == ReadRoute::kGather), key);
  BOOST_REQUIRE(tensors[0].dtype != DType::kBF16);
  const ckptfs::ServedTensor converted(served, 0, DType::kBF16);
  BOOST_TEST((ckptfs::RouteOf(converted) == ReadRoute::kConvert));
  BOOST_TEST(ckptfs::StoredAsExtents(ckptfs_test::StoredEntry(converted)));
}

BOOST_AUTO_TEST_CASE(extents_follow_the_tensor_order_and_merge) {
  Sources sources;
  const uint32_t a = sources.AddFile(std::string(100, 'a')), b = sources.AddFile(std::string(100, 'b'));
  TensorEntry t;
  t.key = "t";
  t.shape = {4, 5};
  // Listed out of order: rows 2-3 in b, row 0 and row 1 adjacent in a.
  t.boxes = {Box::Range(b, 40, 10, 10), Box::Range(a, 20, 5, 5), Box::Range(a, 0, 0, 5)};
  BOOST_REQUIRE(ckptfs::ValidateLayout(t, *sources.catalog->files, "src").ok());
  const std::vector<ckptfs::Extent> extents = ckptfs::ExtentsOf(t);
  BOOST_REQUIRE_EQUAL(extents.size(), 2u);
  BOOST_TEST((extents[0].file == a && extents[0].offset == 0u && extents[0].length == 40u));
  BOOST_TEST((extents[1].file == b && extents[1].offset == 40u && extents[1].length == 40u));
}

BOOST_AUTO_TEST_CASE(tiled_tensors_read_back) {
  Tiled tiled(2);
  CheckServed(tiled, {}, 3);
}

BOOST_AUTO_TEST_CASE(tiled_tensors_read_back_converted) {
  Tiled tiled(4);
  ckptfs::ViewOptions options;
  options.dtype = DType::kBF16;
  CheckServed(tiled, options, 5);
}

BOOST_AUTO_TEST_CASE(tiled_tensors_read_back_sharded) {
  // Shards of the model file: tensors land in several model files, read the same.
  Tiled tiled(6);
  ckptfs::ViewOptions options;
  options.shard_size = 4096;
  auto view = MustBuild(tiled.sources.catalog, options);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < tiled.refs.size(); ++i) {
    const View::NodeId id = view->TensorFile(i);
    const std::string whole = ReadRange(*view, id, 0, view->node(id).size);
    BOOST_TEST((whole.substr(whole.size() - tiled.refs[i].bytes.size()) == tiled.refs[i].bytes));
  }
}

BOOST_AUTO_TEST_CASE(gathers_across_read_windows) {
  // A transposed block spanning 4.8 MB of its file: a gather reads it in several windows.
  Sources sources;
  std::mt19937_64 rng(9);
  Layouts l(2);
  const Reference ref = RandomReference(DType::kF32, {1200, 1100}, rng);
  TensorEntry t;
  t.key = "big";
  t.path = {t.key};
  t.shape = ref.shape;
  t.boxes = {l.Put(1, ref, {0, 1000}, {1200, 100}), l.Put(0, ref, {0, 0}, {1200, 1000}, {1, 0})};
  l.Write(&sources);
  sources.catalog->tensors.push_back(t);
  auto view = MustBuild(sources.catalog);
  std::string whole(ref.bytes.size(), '\0');
  Status s = view->ReadTensorData(0, 0, whole.size(), whole.data());
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE(whole == ref.bytes);
  for (int k = 0; k < 200; ++k) {
    const uint64_t offset = std::uniform_int_distribution<uint64_t>(0, whole.size() - 1)(rng);
    const uint64_t length = std::uniform_int_distribution<uint64_t>(0, std::min<uint64_t>(whole.size() - offset, 3 << 20))(rng);
    std::string got(length, '\0');
    BOOST_REQUIRE(view->ReadTensorData(0, offset, length, got.data()).ok());
    BOOST_REQUIRE_MESSAGE(got == whole.substr(offset, length), "ReadTensorData(" << offset << ", " << length << ")");
  }
}

BOOST_AUTO_TEST_CASE(changed_file_fails_a_gather) {
  Tiled tiled(8);
  auto view = MustBuild(tiled.sources.catalog);
  const View::NodeId id = view->TensorFile(2);  // grid: boxes in every file
  std::string buf(view->node(id).size, '\0');
  size_t nread = 0;
  BOOST_REQUIRE(view->Read(id, 0, buf.size(), buf.data(), &nread).ok());
  // Rewrite one of the files under the view.
  tiled.sources.Rewrite(1, "x");
  Status s = view->Read(id, 0, buf.size(), buf.data(), &nread);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kSourceChanged), s.message());
}

// ---- refusals ---------------------------------------------------------------------------

namespace {

// A 4 x 4 float tensor "w" over a 1000-byte file, with the given boxes.
struct Refusal {
  Sources sources;
  uint32_t file = sources.AddFile(std::string(1000, 'x'));

  Status Check(std::vector<Box> boxes, std::vector<uint64_t> shape = {4, 4}) {
    TensorEntry t;
    t.key = "w";
    t.shape = std::move(shape);
    t.boxes = std::move(boxes);
    return ckptfs::ValidateLayout(t, *sources.catalog->files, "ckpt");
  }
  Box Rows(uint64_t first, uint64_t count, uint64_t base = 0) {
    return Box{file, base, {first, 0}, {count, 4}, {4, 1}};
  }
};

void CheckRefused(const Status& s, const std::string& what, Status::Code code = Status::Code::kCorruption) {
  BOOST_TEST(!s.ok());
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(code));
  BOOST_TEST(StartsWith(s.message(), "ckpt: tensor 'w': "), s.message());
  BOOST_TEST(Contains(s.message(), what), s.message());
}

}  // namespace

BOOST_AUTO_TEST_CASE(valid_layouts_pass) {
  Refusal r;
  BOOST_TEST(r.Check({r.Rows(0, 2), r.Rows(2, 2, 100)}).ok());
  BOOST_TEST(r.Check({Box::Range(r.file, 0, 8, 8), Box::Range(r.file, 500, 0, 8)}).ok());
  BOOST_TEST(r.Check({}, {4, 0}).ok());
  BOOST_TEST(r.Check({Box{r.file, 0, {0, 0}, {0, 4}, {4, 1}}}, {0, 4}).ok());  // an empty box
}

BOOST_AUTO_TEST_CASE(gaps_are_refused) {
  Refusal r;
  CheckRefused(r.Check({r.Rows(0, 2), r.Rows(3, 1)}), "elements [2:3, 0:4] are not covered");
  CheckRefused(r.Check({Box::Range(r.file, 0, 0, 7), Box::Range(r.file, 100, 8, 8)}), "elements [7:8] are not covered");
  CheckRefused(r.Check({}), "elements [0:4, 0:4] are not covered");
  CheckRefused(r.Check({}, {}), "not covered");
}

BOOST_AUTO_TEST_CASE(overlaps_are_refused) {
  Refusal r;
  CheckRefused(r.Check({r.Rows(0, 3), r.Rows(2, 2)}), "boxes 0 and 1 overlap");
  // Volumes that add up to the tensor's do not hide an overlap (row 1 twice, row 3 never).
  CheckRefused(r.Check({r.Rows(0, 2), r.Rows(1, 2)}), "boxes 0 and 1 overlap");
  CheckRefused(r.Check({Box::Range(r.file, 0, 0, 10), Box::Range(r.file, 100, 9, 7)}), "boxes 0 and 1 overlap");
}

BOOST_AUTO_TEST_CASE(boxes_outside_the_shape_are_refused) {
  Refusal r;
  CheckRefused(r.Check({r.Rows(0, 3), r.Rows(3, 2)}), "box 1 lies outside the shape");
  CheckRefused(r.Check({Box::Range(r.file, 0, 0, 17)}), "box 0 lies outside the shape");
  CheckRefused(r.Check({Box{r.file, 0, {0, UINT64_MAX}, {4, 2}, {4, 1}}}), "box 0 lies outside the shape");
}

BOOST_AUTO_TEST_CASE(overflowing_strides_are_refused) {
  Refusal r;
  CheckRefused(r.Check({Box{r.file, 0, {0, 0}, {4, 4}, {UINT64_MAX / 2, 1}}}), "box 0: strides overflow");
  CheckRefused(r.Check({Box{r.file, UINT64_MAX - 8, {0, 0}, {4, 4}, {4, 1}}}), "box 0: strides overflow");
}

BOOST_AUTO_TEST_CASE(boxes_past_the_end_of_their_file_are_refused) {
  Refusal r;
  const std::string path = r.sources.catalog->files->path(r.file);
  CheckRefused(r.Check({r.Rows(0, 2), r.Rows(2, 2, 969)}), "box 1 reads past the end of " + path + " (1000 bytes)");
  CheckRefused(r.Check({Box{r.file, 0, {0, 0}, {4, 4}, {1, 100}}}), "box 0 reads past the end of " + path);
  CheckRefused(r.Check({Box{7, 0, {0, 0}, {4, 4}, {4, 1}}}), "box 0 names source file 7 of 1");
}

BOOST_AUTO_TEST_CASE(mixed_and_wrong_ranks_are_refused) {
  Refusal r;
  CheckRefused(r.Check({r.Rows(0, 2), Box::Range(r.file, 100, 8, 8)}), "boxes have mixed ranks (box 0: 2, box 1: 1)");
  CheckRefused(r.Check({Box::Range(r.file, 100, 0, 8), r.Rows(2, 2)}), "boxes have mixed ranks (box 0: 1, box 1: 2)");
  CheckRefused(r.Check({Box{r.file, 0, {0, 0, 0}, {1, 4, 4}, {16, 4, 1}}}), "box 0 has rank 3");
  CheckRefused(r.Check({Box{r.file, 0, {0, 0}, {4, 4}, {1}}}), "box 0 has 2 offsets, 2 extents and 1 strides");
}

BOOST_AUTO_TEST_CASE(tilings_too_fine_to_check_are_not_supported) {
  // Every row cut at its own column: about 9 million grid cells. Zero strides keep the
  // 6000 boxes inside a small file.
  Refusal r;
  const uint64_t n = 3000;
  std::vector<Box> boxes;
  for (uint64_t i = 0; i < n; ++i) {
    boxes.push_back(Box{r.file, 0, {i, 0}, {1, i + 1}, {0, 0}});
    if (i + 1 < n) boxes.push_back(Box{r.file, 0, {i, i + 1}, {1, n - i - 1}, {0, 0}});
  }
  CheckRefused(r.Check(boxes, {n, n}), "too many to check", Status::Code::kNotSupported);
}

BOOST_AUTO_TEST_CASE(many_shards_validate_quickly) {
  // ZeRO-3 at 256 ranks over a thousand tensors, and a 16 x 16 mesh of blocks.
  Refusal r;
  for (int k = 0; k < 1000; ++k) {
    std::vector<Box> boxes;
    for (uint64_t rank = 0; rank < 256; ++rank) {
      boxes.push_back(Box::Range(r.file, 0, rank * 1024, 1024));
      boxes.back().strides = {0};  // every element at byte 0: a small file holds them all
    }
    BOOST_REQUIRE(r.Check(boxes, {512, 512}).ok());
  }
  std::vector<Box> mesh;
  for (uint64_t i = 0; i < 16; ++i)
    for (uint64_t j = 0; j < 16; ++j) mesh.push_back(Box{r.file, 0, {i * 8, j * 8}, {8, 8}, {0, 0}});
  BOOST_TEST(r.Check(mesh, {128, 128}).ok());
}
