// Key maps (src/map/key_map.cpp and its parts, served by src/view/transform_map.cpp): the box
// operations read back through a View against an independent computation from the source
// boxes (tensor-parallel chunks, a group straddling two chunks, row-major ranges cut into
// blocks), the invariant's view check, the expression language, the map file's refusals, and
// every shipped map parsing.
#define BOOST_TEST_MODULE key_map_test
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "ckptfs/view.hpp"
#include "test_util.hpp"
#include "map/key_map_ops.hpp"
#include "map/map_expr.hpp"
#include "map/map_spec.hpp"
#include "map/shipped_maps.hpp"
#include "view/transform.hpp"

using ckptfs::Box;
using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::Expr;
using ckptfs::Status;
using ckptfs::TensorEntry;
using ckptfs::View;
using ckptfs::ViewOptions;
using json = nlohmann::json;

BOOST_TEST_DONT_PRINT_LOG_VALUE(ckptfs::ReadRoute)
BOOST_TEST_DONT_PRINT_LOG_VALUE(ckptfs::Shape)

namespace {

Box MakeBox(uint32_t file, uint64_t base_offset, ckptfs::BoxDims offset, ckptfs::BoxDims extent, ckptfs::BoxDims strides) {
  Box box;
  box.file = file;
  box.base_offset = base_offset;
  box.offset = std::move(offset);
  box.extent = std::move(extent);
  box.strides = std::move(strides);
  return box;
}

// A file of `n` float32 values: element k holds k + 1000 * file.
std::string Floats(size_t n, uint32_t file) {
  std::string bytes(n * 4, '\0');
  for (size_t k = 0; k < n; ++k) {
    const float v = static_cast<float>(k + 1000 * file);
    std::memcpy(&bytes[k * 4], &v, 4);
  }
  return bytes;
}

// The value at `index` of a tensor, found from its boxes (the test's own reading of them).
float At(const TensorEntry& t, const std::vector<uint64_t>& index) {
  for (const Box& box : t.boxes) {
    bool inside = true;
    uint64_t element = 0;
    for (size_t d = 0; d < index.size(); ++d) {
      inside = inside && index[d] >= box.offset[d] && index[d] < box.offset[d] + box.extent[d];
      element += (index[d] - box.offset[d]) * box.strides[d];
    }
    if (inside) return static_cast<float>(box.base_offset / 4 + element + 1000 * box.file);
  }
  BOOST_FAIL("no box holds the element");
  return 0;
}

std::string WriteMap(const json& map) {
  const std::string path = (std::filesystem::temp_directory_path() / ("ckptfs-key-map-test-" + std::to_string(getpid()) + ".json")).string();
  std::ofstream(path) << map.dump();
  return path;
}

// The view of `catalog` through `map` (written to a file), under `root` when given.
Status BuildMapped(std::shared_ptr<const Catalog> catalog, const json& map, std::unique_ptr<View>* view,
                   const std::string& root = "") {
  ViewOptions options;
  options.root = root;
  options.map = WriteMap(map);
  Status s = View::Build(std::move(catalog), options, view);
  std::remove(options.map.c_str());
  return s;
}

// A catalog of tensors in one in-memory file of `bytes`.
struct OneFile {
  OneFile(const std::string& name, const std::string& bytes) {
    source.Attach(catalog.get());
    catalog->format = "test";
    catalog->source = "/mem/" + name;
    BOOST_REQUIRE(catalog->files->Add(source.Write("/mem/" + name + ".bin", bytes), &file).ok());
  }
  void Add(const std::string& key, ckptfs::Shape shape, uint64_t first_element) {
    TensorEntry t;
    t.key = key;
    t.path = {t.key};
    t.dtype = DType::kF32;
    t.shape = std::move(shape);
    t.boxes = {Box::Range(file, first_element * 4, 0, t.numel())};
    catalog->tensors.push_back(std::move(t));
  }
  ckptfs_test::MemorySource source;
  std::shared_ptr<Catalog> catalog = std::make_shared<Catalog>();
  uint32_t file = 0;
};

// A stacked fused QKV of L layers [L, NG*(P+2)*D, H] split over TP ranks along dim 1, each
// rank's chunk of a layer a contiguous block of that rank's file; and a [L, H, 2F] row-parallel
// weight split along its last dimension.
struct Megatron {
  static constexpr uint64_t L = 3, NG = 2, P = 3, D = 2, H = 4, TP = 2;
  static constexpr uint64_t R = NG * (P + 2) * D;  // 20 rows
  Megatron(uint64_t tp = TP) {
    source.Attach(catalog.get());
    catalog->format = "test";
    catalog->source = "/mem/megatron";
    for (uint32_t r = 0; r < tp; ++r) {
      uint32_t file = 0;
      Status s = catalog->files->Add(source.Write("/mem/rank" + std::to_string(r), Floats(4096, r)), &file);
      BOOST_REQUIRE(s.ok());
    }
    TensorEntry qkv;
    qkv.key = "qkv";
    qkv.path = {qkv.key};
    qkv.dtype = DType::kF32;
    qkv.shape = {L, R, H};
    const uint64_t rows = R / tp;
    std::vector<Box> boxes;
    for (uint64_t l = 0; l < L; ++l)
      for (uint32_t r = 0; r < tp; ++r)
        boxes.push_back(MakeBox(r, 4 * (l * rows * H), {l, r * rows, 0}, {1, rows, H}, {rows * H, H, 1}));
    qkv.boxes = boxes;
    TensorEntry proj;
    proj.key = "proj";
    proj.path = {proj.key};
    proj.dtype = DType::kF32;
    proj.shape = {L, H, 12};
    boxes.clear();
    for (uint64_t l = 0; l < L; ++l)
      for (uint32_t r = 0; r < tp; ++r)
        boxes.push_back(MakeBox(r, 4 * (1024 + l * H * 12 / tp), {l, 0, r * 12 / tp}, {1, H, 12 / tp}, {H * 12 / tp, 12 / tp, 1}));
    proj.boxes = boxes;
    // One contiguous range over a [5, 3, 4] tensor from element 0 of file 0 at byte 8192.
    TensorEntry flat;
    flat.key = "flat";
    flat.path = {flat.key};
    flat.dtype = DType::kF32;
    flat.shape = {5, 3, 4};
    flat.boxes = {Box::Range(0, 8192, 0, 60)};
    catalog->tensors = {qkv, proj, flat};
    for (const TensorEntry& t : catalog->tensors) BOOST_REQUIRE(ckptfs::ValidateLayout(t, *catalog->files, "x").ok());
  }

  std::unique_ptr<View> Build(const json& map) {
    std::unique_ptr<View> view;
    Status s = BuildMapped(catalog, map, &view);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    return view;
  }

  Status TryBuild(const json& map) {
    std::unique_ptr<View> view;
    return BuildMapped(catalog, map, &view);
  }

  std::vector<float> Read(const View& view, size_t i) {
    const uint64_t n = ckptfs_test::StoredEntry(view.served()[i]).numel();
    std::vector<float> out(n);
    Status s = view.ReadTensorData(i, 0, n * 4, reinterpret_cast<char*>(out.data()));
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    return out;
  }

  ckptfs_test::MemorySource source;
  std::shared_ptr<Catalog> catalog = std::make_shared<Catalog>();
};

json QkvMap(uint64_t groups) {
  auto rows = [&](const std::string& a, const std::string& b) {
    return json{{"op", "row_groups"}, {"dim", 0}, {"groups", groups}, {"size", "(P + 2) * D"}, {"start", a}, {"stop", b}};
  };
  return {{"ckptfs_map", 1},
          {"name", "t"},
          {"parameters", {{"P", 3}, {"D", 2}}},
          {"captures", {{"L", 3}}},
          {"tensors",
           {{{"to", "q.{L}"}, {"from", "qkv[L]"}, {"ops", {rows("0", "P * D")}}},
            {{"to", "k.{L}"}, {"from", "qkv[L]"}, {"ops", {rows("P * D", "P * D + D")}}},
            {{"to", "v.{L}"}, {"from", "qkv[L]"}, {"ops", {rows("P * D + D", "(P + 2) * D")}}},
            {{"to", "proj.{L}"}, {"from", "proj[L]"}},
            {{"to", "flat.T"},
             {"from", "flat"},
             {"ops", {{{"op", "slice"}, {"dim", 0}, {"start", 1}, {"stop", 4}}, {{"op", "transpose"}, {"dims", {0, 2}}}}}}}}};
}

}  // namespace

BOOST_AUTO_TEST_CASE(qkv_row_groups_over_tensor_parallel_chunks) {
  for (uint64_t tp : {1, 2, 4}) {  // tp = 4: a group's rows straddle two ranks' chunks
    BOOST_TEST_CONTEXT("tp " << tp) {
      Megatron m(tp);
      auto view = m.Build(QkvMap(Megatron::NG));
      const auto& served = view->served();
      BOOST_REQUIRE_EQUAL(served.size(), 13u);
      BOOST_TEST(served[0].key() == "q.0");
      BOOST_TEST(served[3].key() == "proj.0");
      const TensorEntry& qkv = m.catalog->tensors[0];
      const uint64_t G = Megatron::NG, S = (Megatron::P + 2) * Megatron::D, PD = Megatron::P * Megatron::D;
      for (uint64_t l = 0; l < Megatron::L; ++l) {
        const std::vector<std::pair<uint64_t, uint64_t>> parts = {{0, PD}, {PD, PD + Megatron::D}, {PD + Megatron::D, S}};
        for (size_t which = 0; which < 3; ++which) {
          const auto got = m.Read(*view, l * 4 + which);
          const auto [a, b] = parts[which];
          std::vector<float> want;
          for (uint64_t g = 0; g < G; ++g)
            for (uint64_t row = g * S + a; row < g * S + b; ++row)
              for (uint64_t c = 0; c < Megatron::H; ++c) want.push_back(At(qkv, {l, row, c}));
          BOOST_TEST(got == want, boost::test_tools::per_element());
        }
        // The row-parallel weight split along its last dimension: gathered from both ranks.
        const auto got = m.Read(*view, l * 4 + 3);
        std::vector<float> want;
        for (uint64_t r = 0; r < Megatron::H; ++r)
          for (uint64_t c = 0; c < 12; ++c) want.push_back(At(m.catalog->tensors[1], {l, r, c}));
        BOOST_TEST(got == want, boost::test_tools::per_element());
      }
      // Rows [1, 4) of a contiguous [5, 3, 4] range, dims 0 and 2 swapped: [4, 3, 3].
      const auto got = m.Read(*view, 12);
      BOOST_TEST(served[12].shape() == (ckptfs::Shape{4, 3, 3}));
      std::vector<float> want;
      for (uint64_t i = 0; i < 4; ++i)
        for (uint64_t j = 0; j < 3; ++j)
          for (uint64_t k = 0; k < 3; ++k) want.push_back(static_cast<float>(2048 + ((k + 1) * 3 + j) * 4 + i));
      BOOST_TEST(got == want, boost::test_tools::per_element());
    }
  }
}

BOOST_AUTO_TEST_CASE(unstacked_contiguous_layers_stay_byte_ranges) {
  Megatron m(1);
  auto view = m.Build(QkvMap(Megatron::NG));
  // A layer of a single-rank chunk is one contiguous block per group: served as extents.
  BOOST_TEST(ckptfs::RouteOf(view->served()[0]) == ckptfs::ReadRoute::kExtents);
  BOOST_TEST(ckptfs_test::StoredEntry(view->served()[0]).boxes.size() == Megatron::NG);
  BOOST_TEST(ckptfs::RouteOf(view->served()[12]) == ckptfs::ReadRoute::kGather);  // the transpose
}

BOOST_AUTO_TEST_CASE(a_map_that_disagrees_with_the_shapes_is_refused) {
  Megatron m;
  Status s = m.TryBuild(QkvMap(3));
  BOOST_TEST(!s.ok());
  BOOST_TEST(s.message() ==
             "map t: 'qkv' (for 'q.0'): row_groups: dimension 0 of shape [20, 4] is 20 long, not groups * size = 3 * 10 = 30");
  json map = QkvMap(Megatron::NG);
  map["captures"]["L"] = 4;
  s = m.TryBuild(map);
  BOOST_TEST(s.message().find("L takes 3 values in [0, 2], the map expects 4 = 4 (0 to 3)") != std::string::npos, s.message());
  map = QkvMap(Megatron::NG);
  map["tensors"].erase(3);  // proj: used by no rule, not ignored
  s = m.TryBuild(map);
  BOOST_TEST(s.message() == "map t: tensor 'proj' [3, 4, 12] is used by no rule of the map and not ignored by it: the map "
                            "does not describe this checkpoint");
  map["ignore"] = {"pro*"};
  BOOST_TEST(m.TryBuild(map).ok());
}

BOOST_AUTO_TEST_CASE(views_of_boxes) {
  const Box of = MakeBox(0, 400, {0, 0, 0}, {4, 5, 6}, {30, 6, 1});
  // Index 2 of dim 0, rows [1, 3): rank 2.
  BOOST_TEST(ckptfs::IsViewOfBox(MakeBox(0, 400 + 4 * (60 + 6), {0, 0}, {2, 6}, {6, 1}), of, 4));
  // Transposed: strides swapped.
  BOOST_TEST(ckptfs::IsViewOfBox(MakeBox(0, 400, {0, 0}, {6, 5}, {1, 6}), of, 4));
  // Past the end of the source box, or another file.
  BOOST_TEST(!ckptfs::IsViewOfBox(MakeBox(0, 400 + 4 * 100, {0, 0}, {2, 6}, {6, 1}), of, 4));
  BOOST_TEST(!ckptfs::IsViewOfBox(MakeBox(1, 400, {0, 0}, {2, 6}, {6, 1}), of, 4));
  // Strides the source does not have.
  BOOST_TEST(!ckptfs::IsViewOfBox(MakeBox(0, 400, {0, 0}, {2, 3}, {12, 2}), of, 4));
  // Any block inside a contiguous range; not one running past it.
  const Box range = Box::Range(0, 1000, 0, 60);
  BOOST_TEST(ckptfs::IsViewOfBox(MakeBox(0, 1000 + 4 * 12, {0, 0}, {3, 4}, {4, 1}), range, 4));
  BOOST_TEST(!ckptfs::IsViewOfBox(MakeBox(0, 1000 + 4 * 50, {0, 0}, {3, 4}, {4, 1}), range, 4));
}

BOOST_AUTO_TEST_CASE(ranges_become_blocks) {
  TensorEntry t;
  t.dtype = DType::kF32;
  t.shape = {3, 4, 5};
  t.boxes = {Box::Range(0, 0, 0, 7), Box::Range(0, 100, 7, 53)};
  ckptfs::BoxedTensor boxed;
  BOOST_REQUIRE(ckptfs::ToBoxedTensor(t, 100, &boxed).ok());
  uint64_t total = 0;
  for (const Box& b : boxed.boxes) {
    BOOST_TEST(b.rank() == 3u);
    total += b.numel();
  }
  BOOST_TEST(total == 60u);
  BOOST_TEST(boxed.boxes.size() <= 6u);
  BOOST_TEST(!ckptfs::ToBoxedTensor(t, 2, &boxed).ok());
}

namespace {

Status Eval(const std::string& text, json* out, const json& names = json::object()) {
  Expr e;
  CKPTFS_RETURN_IF_ERROR(Expr::Parse(text, &e));
  return e.Evaluate(
      [&](std::string_view n, json* v, bool* found) {
        *found = names.contains(std::string(n));
        if (*found) *v = names[std::string(n)];
        return Status::OK();
      },
      out);
}

}  // namespace

BOOST_AUTO_TEST_CASE(expressions) {
  json v;
  const json names = {{"h", 64}, {"n", 4}, {"yes", true}, {"norm", "RMSNorm"}, {"nothing", nullptr}};
  BOOST_TEST(Eval("1 + 2 * 3 == 7 && !(2 > 3)", &v).ok());
  BOOST_TEST(v == true);
  BOOST_TEST(Eval("h / n - 1", &v, names).ok());
  BOOST_TEST(v == 15);
  BOOST_TEST(Eval("missing ?? nothing ?? 1e-5", &v, names).ok());
  BOOST_TEST(v == 1e-5);
  BOOST_TEST(Eval("norm == 'RMSNorm' ? h : n", &v, names).ok());
  BOOST_TEST(v == 64);
  BOOST_TEST(Eval("has(h) && !has(missing) && !has(nothing)", &v, names).ok());
  BOOST_TEST(v == true);
  BOOST_TEST(Eval("7 / 2", &v).message() == "expression '7 / 2': 7 / 2 is not a whole number");
  BOOST_TEST(Eval("h / 0", &v, names).message().find("divides 64 by 0") != std::string::npos);
  BOOST_TEST(Eval("!h", &v, names).message().find("not a boolean") != std::string::npos);
  BOOST_TEST(Eval("heads * 2", &v, names).message().find("'heads' is neither a map parameter") != std::string::npos);
  BOOST_TEST(Eval("9223372036854775807 + 1", &v).message().find("overflow") != std::string::npos);
  BOOST_TEST(!Eval("(1 + 2", &v).ok());
  BOOST_TEST(!Eval("1 +", &v).ok());
  BOOST_TEST(!Eval(std::string(1001, '1'), &v).ok());
  BOOST_TEST(!Eval(std::string(200, '(') + "1" + std::string(200, ')'), &v).ok());
}

BOOST_AUTO_TEST_CASE(map_files_are_checked) {
  ckptfs::KeyMap m;
  const json good = QkvMap(2);
  BOOST_TEST(ckptfs::ParseKeyMap(good.dump(), "map x", &m).ok());
  auto refuse = [&](json doc, const std::string& expected) {
    Status s = ckptfs::ParseKeyMap(doc.dump(), "map x", &m);
    BOOST_TEST(s.message() == expected);
  };
  json doc = good;
  doc["tensor"] = 1;
  refuse(doc, "map x: tensor: not a field of a map (doc/MAPS.md)");
  doc = good;
  doc["tensors"][0]["to"] = "q";
  refuse(doc, "map x: tensors[0].to: 'q' must use exactly the names its source captures");
  doc = good;
  doc["tensors"][0]["ops"][0]["op"] = "reshape";
  refuse(doc, "map x: tensors[0].ops[0].op: 'reshape' is not select, slice, row_groups or transpose");
  doc = good;
  doc["tensors"][0]["from"] = "layers.{L}.qkv[L]";
  refuse(doc, "map x: tensors[0].from: 'L' is both captured and unstacked");
  doc = good;
  doc["tensors"][0]["from"] = "layers{L}1.qkv";
  refuse(doc, "map x: tensors[0].from: a capture in 'layers{L}1.qkv' touches a digit or another capture");
  doc = good;
  doc["tensors"][0]["from"] = "a{A}.b{B}.c{C}.d{L}.qkv[E]";
  refuse(doc, "map x: tensors[0].from: more than 4 captures and unstacked dimensions");
  doc = good;
  doc["parameters"]["P"] = "3 +";
  BOOST_TEST(!ckptfs::ParseKeyMap(doc.dump(), "map x", &m).ok());
  doc = good;
  doc["ckptfs_map"] = 2;
  refuse(doc, "map x: ckptfs_map: must be 1 (the language's version)");
  BOOST_TEST(ckptfs::ParseKeyMap("{", "map x", &m).message() == "map x: not valid JSON");
  BOOST_TEST(ckptfs::ParseKeyMap(std::string(2 << 20, ' '), "map x", &m).message() == "map x: larger than 1 MiB");
}

BOOST_AUTO_TEST_CASE(shipped_maps_parse) {
  std::vector<std::string> names;
  for (const ckptfs::ShippedMap& shipped : ckptfs::ShippedMaps()) {
    ckptfs::KeyMap m;
    Status s = ckptfs::ParseKeyMap(shipped.text, std::string(shipped.name), &m);
    BOOST_TEST(s.ok(), s.message());
    BOOST_TEST(m.name == shipped.name);
    names.emplace_back(shipped.name);
  }
  // Every map file of maps/ is shipped, once (the order map=auto tries them is the build's;
  // tests/views/test_key_map.py checks what it picks).
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(std::string(CKPTFS_TEST_DATA) + "/../../maps"))
    if (e.path().extension() == ".json") files.push_back(e.path().stem().string());
  std::sort(files.begin(), files.end());
  std::sort(names.begin(), names.end());
  BOOST_TEST(files.size() >= 6u);
  BOOST_TEST(names == files, boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(globs) {
  BOOST_TEST(ckptfs::GlobMatch("*._extra_state*", "decoder.layers.x._extra_state/shard_0_4"));
  BOOST_TEST(ckptfs::GlobMatch("optimizer.*", "optimizer.state.exp_avg.w"));
  BOOST_TEST(!ckptfs::GlobMatch("optimizer.*", "model.optimizer.w"));
  BOOST_TEST(ckptfs::GlobMatch("a*b*c", "aXbYbZc"));
  BOOST_TEST(!ckptfs::GlobMatch("a*b", "aXbY"));
}

BOOST_AUTO_TEST_CASE(select_copies_only_the_boxes_of_its_index) {
  // [4 layers, 2 experts, 3] stored as one box per (layer, expert-parallel rank): index 2 of
  // dimension 0 takes the two boxes of layer 2, each with dimension 0 removed.
  ckptfs::BoxedTensor t;
  t.shape = {4, 2, 3};
  t.itemsize = 2;
  for (uint64_t l = 0; l < 4; ++l)
    for (uint64_t e = 0; e < 2; ++e) t.boxes.push_back(MakeBox(e, l * 6, {l, e, 0}, {1, 1, 3}, {3, 3, 1}));
  ckptfs::BoxedTensor out;
  std::string why;
  BOOST_REQUIRE(ckptfs::SelectIndexOf(t, 0, 2, &out, &why));
  BOOST_TEST(out.shape == (ckptfs::Shape{2, 3}));
  BOOST_REQUIRE_EQUAL(out.boxes.size(), 2u);
  for (uint64_t e = 0; e < 2; ++e) {
    BOOST_TEST(out.boxes[e].file == e);
    BOOST_TEST(out.boxes[e].base_offset == 12u);
    BOOST_TEST(out.boxes[e].offset == (ckptfs::BoxDims{e, 0}));
    BOOST_TEST(out.boxes[e].extent == (ckptfs::BoxDims{1, 3}));
    BOOST_TEST(out.boxes[e].strides == (ckptfs::BoxDims{3, 1}));
  }
  BOOST_TEST(t.boxes.size() == 8u);  // the source is kept whole
  BOOST_TEST(!ckptfs::SelectIndexOf(t, 0, 4, &out, &why));
  BOOST_TEST(why == "select: index 4 of dimension 0 of shape [4, 2, 3] is out of range");
  // A slice keeps each box it meets, clipped, in place.
  BOOST_REQUIRE(ckptfs::SliceDim(&out, 1, 1, 3, &why));
  BOOST_TEST(out.shape == (ckptfs::Shape{2, 2}));
  BOOST_TEST(out.boxes[1].base_offset == 14u);
  BOOST_TEST(out.boxes[1].extent == (ckptfs::BoxDims{1, 2}));
}

BOOST_AUTO_TEST_CASE(entries_are_made_on_first_use_once_and_from_any_thread) {
  Megatron m(2);
  json map = QkvMap(Megatron::NG);
  // A shape that depends on the layer: rows [0, L + 1) of each layer's proj.
  map["tensors"].push_back({{"to", "head.{L}"},
                            {"from", "proj[L]"},
                            {"ops", {{{"op", "slice"}, {"dim", 1}, {"start", 0}, {"stop", "L + 1"}}}}});
  auto view = m.Build(map);
  const auto& served = view->served();
  BOOST_TEST(served.deferred());
  BOOST_REQUIRE_EQUAL(served.size(), 16u);
  for (uint64_t l = 0; l < Megatron::L; ++l) {
    BOOST_TEST(served[13 + l].key() == "head." + std::to_string(l));
    BOOST_TEST(served[13 + l].shape() == (ckptfs::Shape{Megatron::H, l + 1}));
  }
  // Each tensor read by 8 threads at once: one entry each, the same bytes as one thread reads.
  std::vector<std::vector<float>> want(served.size());
  for (size_t i = 0; i < served.size(); ++i) {
    const uint64_t n = served[i].numel();
    want[i].resize(n);
    std::vector<std::thread> threads;
    std::vector<std::vector<float>> got(8, std::vector<float>(n));
    std::vector<Status> status(8);
    std::vector<const TensorEntry*> entries(8);
    for (size_t t = 0; t < 8; ++t)
      threads.emplace_back([&, t] {
        status[t] = served[i].Stored(&entries[t]);
        if (status[t].ok()) status[t] = view->ReadTensorData(i, 0, n * 4, reinterpret_cast<char*>(got[t].data()));
      });
    for (std::thread& t : threads) t.join();
    for (size_t t = 0; t < 8; ++t) {
      BOOST_REQUIRE_MESSAGE(status[t].ok(), status[t].message());
      BOOST_TEST(entries[t] == entries[0]);
      BOOST_TEST(got[t] == got[0], boost::test_tools::per_element());
    }
    BOOST_TEST(entries[0]->key == served[i].key());
    BOOST_TEST(entries[0]->shape == served[i].shape());
    want[i] = got[0];
  }
  for (uint64_t l = 0; l < Megatron::L; ++l) {
    std::vector<float> head;
    for (uint64_t r = 0; r < Megatron::H; ++r)
      for (uint64_t c = 0; c <= l; ++c) head.push_back(At(m.catalog->tensors[1], {l, r, c}));
    BOOST_TEST(want[13 + l] == head, boost::test_tools::per_element());
  }
}

BOOST_AUTO_TEST_CASE(two_rules_of_one_key_are_refused) {
  Megatron m;
  json map = QkvMap(Megatron::NG);
  // "proj.1", a literal, is also what "proj.{L}" makes for layer 1.
  map["tensors"].push_back({{"to", "proj.1"}, {"from", "flat"}});
  map["tensors"][4]["to"] = "flat.1";
  Status s = m.TryBuild(map);
  BOOST_TEST(s.message() == "map t: two rules serve the key 'proj.1'", s.message());
  map["tensors"][5]["to"] = "proj.x1";
  BOOST_TEST(m.TryBuild(map).ok(), m.TryBuild(map).message());
}

BOOST_AUTO_TEST_CASE(a_tensor_cut_into_too_many_boxes_is_refused_at_mount) {
  // A [2 * (2^20 + 1), 1] tensor of one contiguous range: row groups of 2 rows keeping the
  // first make 2^20 + 1 pieces, past kMaxRowGroupPieces: refused when the view is built.
  const uint64_t groups = ckptfs::kMaxRowGroupPieces + 1;
  OneFile one("many", std::string(groups * 2 * 4, '\0'));
  one.Add("w", {groups * 2, 1}, 0);
  const json map = {{"ckptfs_map", 1},
                    {"name", "t"},
                    {"tensors",
                     {{{"to", "w.even"},
                       {"from", "w"},
                       {"ops", {{{"op", "row_groups"}, {"dim", 0}, {"groups", groups}, {"size", 2}, {"start", 0}, {"stop", 1}}}}}}}};
  std::unique_ptr<View> view;
  Status s = BuildMapped(one.catalog, map, &view);
  BOOST_TEST(!s.ok());
  BOOST_TEST(s.message().find("cut the tensor's boxes into more than 1048576 pieces") != std::string::npos, s.message());
}

BOOST_AUTO_TEST_CASE(a_map_after_a_root_selection_reads_the_same_tensors) {
  // The same tensors under "model." beside another: root=model then the map serves what the
  // map alone serves of the bare keys, read from the same source tensors.
  Megatron bare(2), nested(2);
  TensorEntry extra = nested.catalog->tensors[2];
  extra.key = "optimizer.flat";
  extra.path = {extra.key};
  for (TensorEntry& t : nested.catalog->tensors) {
    t.key = "model." + t.key;
    t.path = {t.key};
  }
  nested.catalog->tensors.insert(nested.catalog->tensors.begin(), extra);
  auto want = bare.Build(QkvMap(Megatron::NG));
  std::unique_ptr<View> got;
  Status s = BuildMapped(nested.catalog, QkvMap(Megatron::NG), &got, "model");
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE_EQUAL(got->served().size(), want->served().size());
  for (size_t i = 0; i < got->served().size(); ++i) {
    BOOST_TEST(got->served()[i].key() == want->served()[i].key());
    // Source tensor indices are the catalog's: one more tensor comes first in the nested one.
    BOOST_TEST(got->served().source_index(i) == want->served().source_index(i) + 1);
    BOOST_TEST(nested.Read(*got, i) == bare.Read(*want, i), boost::test_tools::per_element());
  }
}

BOOST_AUTO_TEST_CASE(a_concatenation_of_per_layer_keys) {
  // Per-layer keys with digits in every part: l{L}.a ([2, 4]) then l{L}.b ([1, 4]) joined
  // along dimension 0, for three layers, each tensor a contiguous range of one file.
  OneFile one("layers", Floats(256, 0));
  uint64_t element = 0;
  for (int l = 0; l < 3; ++l)
    for (const auto& [name, rows] : {std::pair<const char*, uint64_t>{"a", 2}, {"b", 1}}) {
      one.Add("l" + std::to_string(l) + "." + name, {rows, 4}, element);
      element += rows * 4;
    }
  const json map = json::parse(R"({"ckptfs_map": 1, "name": "t", "captures": {"L": 3},
    "tensors": [{"to": "cat.{L}", "concat": {"dim": 0, "parts": [{"from": "l{L}.a"}, {"from": "l{L}.b"}]}}]})");
  std::unique_ptr<View> view;
  Status s = BuildMapped(one.catalog, map, &view);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE_EQUAL(view->served().size(), 3u);
  for (size_t l = 0; l < 3; ++l) {
    BOOST_TEST(view->served()[l].key() == "cat." + std::to_string(l));
    BOOST_TEST(view->served()[l].shape() == (ckptfs::Shape{3, 4}));
    std::vector<float> got(12), want(12);
    BOOST_REQUIRE(view->ReadTensorData(l, 0, 48, reinterpret_cast<char*>(got.data())).ok());
    for (size_t k = 0; k < 12; ++k) want[k] = static_cast<float>(l * 12 + k);  // a's 8 then b's 4
    BOOST_TEST(got == want, boost::test_tools::per_element());
    BOOST_TEST(view->served().other_sources(l).size() == 1u);
  }
}

BOOST_AUTO_TEST_CASE(captured_numbers_too_wide_for_one_order_word) {
  // Two captures of up to 18 digits each (no count declared, so any value): the served order's
  // fields need more than 64 bits and are compared field by field. Served by A, then B.
  OneFile one("wide", Floats(16, 0));
  const std::vector<std::pair<std::string, std::string>> numbers = {
      {"900000000000000000", "7"}, {"5", "800000000000000000"}, {"900000000000000000", "6"}, {"5", "4"}};
  for (size_t k = 0; k < numbers.size(); ++k) one.Add("t." + numbers[k].first + "." + numbers[k].second, {2}, 2 * k);
  const json map = json::parse(R"({"ckptfs_map": 1, "name": "t",
    "tensors": [{"to": "u.{A}.{B}", "from": "t.{A}.{B}"}]})");
  std::unique_ptr<View> view;
  Status s = BuildMapped(one.catalog, map, &view);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  const std::vector<std::string> want = {"u.5.4", "u.5.800000000000000000", "u.900000000000000000.6",
                                         "u.900000000000000000.7"};
  BOOST_REQUIRE_EQUAL(view->served().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) BOOST_TEST(view->served()[i].key() == want[i]);
}
