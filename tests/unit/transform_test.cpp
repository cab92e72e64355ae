// The view's transform stage (src/view/transform.hpp): the sub-box test itself, the view
// options as transforms (root, dtype) and what they leave, and the invariant check refusing
// a transform whose boxes leave its source tensor's while accepting a slice.
#define BOOST_TEST_MODULE transform_test
#include <boost/test/unit_test.hpp>

#include <tuple>

#include "ckptfs/view.hpp"
#include "test_util.hpp"
#include "view/transform.hpp"

using ckptfs::Box;
using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::ServedTensors;
using ckptfs::Status;
using ckptfs::TensorEntry;
using ckptfs::ViewOptions;
using ckptfs_test::Contains;
using json = nlohmann::json;

BOOST_TEST_DONT_PRINT_LOG_VALUE(ckptfs::DType)

namespace {

// A box over `extent` at `base_offset` of file 0, with `strides`, at tensor position `offset`.
Box MakeBox(uint64_t base_offset, ckptfs::BoxDims offset, ckptfs::BoxDims extent, ckptfs::BoxDims strides) {
  Box box;
  box.base_offset = base_offset;
  box.offset = std::move(offset);
  box.extent = std::move(extent);
  box.strides = std::move(strides);
  return box;
}

TensorEntry MakeTensor(std::string key, DType dtype, ckptfs::Shape shape, std::vector<Box> boxes) {
  TensorEntry t;
  t.path = {key};
  t.key = std::move(key);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.boxes = std::move(boxes);
  return t;
}

// A training checkpoint in one in-memory file: model.* and optimizer.* tensors, one of
// them in two boxes (the second stored transposed), one in two flat ranges.
struct Checkpoint {
  Checkpoint() {
    source.Attach(catalog.get());
    catalog->format = "test";
    catalog->source = "/mem/ckpt";
    uint32_t file = 0;
    Status s = catalog->files->Add(source.Write("/mem/ckpt", std::string(4096, 'x')), &file);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    auto& ts = catalog->tensors;
    ts.push_back(MakeTensor("model.w", DType::kF32, {4, 6}, {Box::Strided(0, 0, {4, 6}, {6, 1})}));
    ts.push_back(MakeTensor("model.b", DType::kF16, {6}, {Box::Range(0, 96, 0, 6)}));
    ts.push_back(MakeTensor("model.grid", DType::kF32, {4, 6},
                            {MakeBox(200, {0, 0}, {2, 6}, {6, 1}), MakeBox(300, {2, 0}, {2, 6}, {1, 2})}));
    ts.push_back(MakeTensor("optimizer.step", DType::kI64, {}, {Box::Range(0, 500, 0, 1)}));
    ts.push_back(MakeTensor("optimizer.m", DType::kF32, {4, 6}, {Box::Range(0, 600, 0, 12), Box::Range(0, 700, 12, 12)}));
    for (const TensorEntry& t : ts) {
      Status valid = ckptfs::ValidateLayout(t, *catalog->files, catalog->source);
      BOOST_REQUIRE_MESSAGE(valid.ok(), valid.message());
    }
    catalog->metadata = {{"model", {{"config", 1}}}, {"optimizer", {{"lr", 0.5}}}};
  }

  ServedTensors Apply(const ViewOptions& options) const {
    ServedTensors served;
    Status s = ckptfs::ApplyViewOptions(catalog, options, &served);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
    return served;
  }

  ckptfs_test::MemorySource source;
  std::shared_ptr<Catalog> catalog = std::make_shared<Catalog>();
};

// Whether every box of served tensor i is a sub-box of a box of its source tensor.
bool BoxesWithinSource(const ServedTensors& served, size_t i) {
  const TensorEntry& t = ckptfs_test::StoredEntry(served[i]);
  const TensorEntry& from = served.source().tensors.at(served.source_index(i));
  for (const Box& box : t.boxes) {
    bool within = false;
    for (const Box& of : from.boxes) within = within || ckptfs::IsSubBox(box, of, ckptfs::Info(t.dtype).itemsize);
    if (!within) return false;
  }
  return true;
}

// Serves rows [first, first + count) of each 2-D tensor stored in one box (a slice view, as
// a later transform would add it): the box moved to the first row served, cut to the rows.
class RowSlice : public ckptfs::Transform {
 public:
  RowSlice(uint64_t first, uint64_t count) : first_(first), count_(count) {}

  Status Apply(ServedTensors* served) const override {
    std::vector<TensorEntry> sliced;
    std::vector<uint32_t> from;
    for (size_t i = 0; i < served->size(); ++i) {
      const TensorEntry& t = ckptfs_test::StoredEntry((*served)[i]);
      if (t.shape.size() != 2 || t.boxes.size() != 1 || t.boxes[0].rank() != 2) continue;
      TensorEntry slice = t;
      slice.key += ".rows";
      slice.shape[0] = count_;
      Box& box = slice.boxes[0];
      box.base_offset += first_ * box.strides[0] * ckptfs::Info(t.dtype).itemsize;
      box.extent[0] = count_;
      sliced.push_back(std::move(slice));
      from.push_back(static_cast<uint32_t>(i));
    }
    ckptfs::ServedTensorsEditor(served).Replace(std::move(sliced), from);
    return Status::OK();
  }

 private:
  uint64_t first_, count_;
};

}  // namespace

BOOST_AUTO_TEST_CASE(sub_boxes_of_a_row_major_box) {
  // A 4x6 float32 block stored row-major at byte 100.
  const Box of = MakeBox(100, {0, 0}, {4, 6}, {6, 1});
  BOOST_TEST(ckptfs::IsSubBox(of, of, 4));
  // Rows 1-2, columns 2-4: element (1, 2) is 8 elements in.
  BOOST_TEST(ckptfs::IsSubBox(MakeBox(100 + 4 * 8, {0, 0}, {2, 3}, {6, 1}), of, 4));
  // Its position in the served tensor is the served tensor's own.
  BOOST_TEST(ckptfs::IsSubBox(MakeBox(100 + 4 * 8, {5, 7}, {2, 3}, {6, 1}), of, 4));
  // Columns 2-6: past the block's last column.
  BOOST_TEST(!ckptfs::IsSubBox(MakeBox(100 + 4 * 8, {0, 0}, {2, 5}, {6, 1}), of, 4));
  // Rows 3-4: past its last row.
  BOOST_TEST(!ckptfs::IsSubBox(MakeBox(100 + 4 * 18, {0, 0}, {2, 3}, {6, 1}), of, 4));
  // Not on an element, before the block, in another file, other strides.
  BOOST_TEST(!ckptfs::IsSubBox(MakeBox(100 + 4 * 8 + 1, {0, 0}, {2, 3}, {6, 1}), of, 4));
  BOOST_TEST(!ckptfs::IsSubBox(MakeBox(96, {0, 0}, {2, 3}, {6, 1}), of, 4));
  Box elsewhere = of;
  elsewhere.file = 1;
  BOOST_TEST(!ckptfs::IsSubBox(elsewhere, of, 4));
  BOOST_TEST(!ckptfs::IsSubBox(MakeBox(100, {0, 0}, {2, 3}, {3, 1}), of, 4));
  // Rank differs.
  BOOST_TEST(!ckptfs::IsSubBox(Box::Range(0, 100, 0, 6), of, 4));
  // A box without elements holds nothing: a sub-box of anything.
  BOOST_TEST(ckptfs::IsSubBox(MakeBox(0, {0, 0}, {0, 3}, {9, 9}), of, 4));
}

BOOST_AUTO_TEST_CASE(sub_boxes_of_a_transposed_box_and_of_a_range) {
  // 4x6 stored transposed: element (i, j) at i + 4 * j.
  const Box of = MakeBox(0, {0, 0}, {4, 6}, {1, 4});
  // Rows 1-3, columns 2-3: element (1, 2) is 9 elements in.
  BOOST_TEST(ckptfs::IsSubBox(MakeBox(4 * 9, {0, 0}, {3, 2}, {1, 4}), of, 4));
  // Rows 2-4 (one past the last).
  BOOST_TEST(!ckptfs::IsSubBox(MakeBox(4 * 10, {0, 0}, {3, 2}, {1, 4}), of, 4));
  // Elements 5-11 of a flat range of 24.
  BOOST_TEST(ckptfs::IsSubBox(Box::Range(0, 2 * 5, 5, 7), Box::Range(0, 0, 0, 24), 2));
  BOOST_TEST(!ckptfs::IsSubBox(Box::Range(0, 2 * 20, 20, 7), Box::Range(0, 0, 0, 24), 2));
}

BOOST_AUTO_TEST_CASE(without_options_the_catalog_is_served_as_is) {
  Checkpoint ckpt;
  const ServedTensors served = ckpt.Apply({});
  BOOST_TEST(served.SharesSourceEntries());
  BOOST_REQUIRE_EQUAL(served.size(), ckpt.catalog->tensors.size());
  for (size_t i = 0; i < served.size(); ++i) {
    BOOST_TEST(&ckptfs_test::StoredEntry(served[i]) == &ckpt.catalog->tensors[i]);
    BOOST_TEST(served[i].dtype == ckpt.catalog->tensors[i].dtype);
    BOOST_TEST(!served[i].converted());
  }
  BOOST_TEST(&served.metadata() == &ckpt.catalog->metadata);
  BOOST_TEST(served.manifest_fields() == json::object());
}

BOOST_AUTO_TEST_CASE(dtype_converts_floating_tensors_without_copying_them) {
  Checkpoint ckpt;
  ViewOptions options;
  options.dtype = DType::kBF16;
  const ServedTensors served = ckpt.Apply(options);
  BOOST_TEST(served.SharesSourceEntries());
  const DType want[] = {DType::kBF16, DType::kBF16, DType::kBF16, DType::kI64, DType::kBF16};
  for (size_t i = 0; i < served.size(); ++i) {
    BOOST_TEST(served[i].dtype == want[i], served[i].key());
    BOOST_TEST(ckptfs_test::StoredEntry(served[i]).dtype == ckpt.catalog->tensors[i].dtype);
    BOOST_TEST(served[i].nbytes() == ckptfs_test::StoredEntry(served[i]).numel() * ckptfs::Info(want[i]).itemsize);
  }
  BOOST_TEST(served.manifest_fields() == json({{"dtype", "BF16"}}));
}

BOOST_AUTO_TEST_CASE(root_and_dtype_keep_every_box_within_its_source) {
  Checkpoint ckpt;
  ViewOptions options;
  options.root = "model";
  options.dtype = DType::kF16;
  const ServedTensors served = ckpt.Apply(options);
  BOOST_REQUIRE_EQUAL(served.size(), 3u);
  const char* keys[] = {"w", "b", "grid"};
  const DType want[] = {DType::kF16, DType::kF16, DType::kF16};
  for (size_t i = 0; i < served.size(); ++i) {
    BOOST_TEST(served[i].key() == keys[i]);
    BOOST_TEST(served.source_index(i) == i);
    BOOST_TEST(served[i].dtype == want[i]);
    BOOST_TEST(served[i].converted() == (ckpt.catalog->tensors[i].dtype != DType::kF16));
    BOOST_TEST(ckptfs_test::StoredEntry(served[i]).dtype == ckpt.catalog->tensors[i].dtype);
    BOOST_TEST(BoxesWithinSource(served, i), served[i].key());
  }
  BOOST_TEST(served.metadata() == json({{"config", 1}}));
  BOOST_TEST(served.manifest_fields() == json({{"dtype", "F16"}, {"root", "model"}}));
  BOOST_TEST(ckptfs::CheckSubBoxInvariant(served, "test").ok());
}

BOOST_AUTO_TEST_CASE(an_unknown_root_lists_the_top_level_prefixes) {
  Checkpoint ckpt;
  ViewOptions options;
  options.root = "nope";
  ServedTensors served;
  const Status s = ckptfs::ApplyViewOptions(ckpt.catalog, options, &served);
  BOOST_REQUIRE(!s.ok());
  BOOST_TEST(Contains(s.message(), "root=nope"), s.message());
  BOOST_TEST(Contains(s.message(), "no tensor keys start with 'nope.'; top-level prefixes: model, optimizer"), s.message());
}

BOOST_AUTO_TEST_CASE(a_slice_transform_keeps_the_invariant) {
  // What a later slice view would do: rows 1-2 of each tensor stored in one 2-D box, after
  // root and dtype.
  Checkpoint ckpt;
  ViewOptions options;
  options.root = "model";
  options.dtype = DType::kBF16;
  ServedTensors served = ckpt.Apply(options);
  BOOST_REQUIRE(RowSlice(1, 2).Apply(&served).ok());
  BOOST_REQUIRE_EQUAL(served.size(), 1u);
  BOOST_TEST(served[0].key() == "w.rows");
  BOOST_TEST(served.source_index(0) == 0u);
  BOOST_TEST(served[0].dtype == DType::kBF16);  // the served dtype follows the tensor
  BOOST_TEST(served[0].nbytes() == 2u * 6u * 2u);
  BOOST_TEST(BoxesWithinSource(served, 0));
  const Status s = ckptfs::CheckSubBoxInvariant(served, "row-slice");
  BOOST_TEST(s.ok(), s.message());
}

BOOST_AUTO_TEST_CASE(boxes_outside_the_source_are_refused) {
  Checkpoint ckpt;
  ServedTensors served(ckpt.catalog);
  // Rows 3-4 of model.w: one row past the stored block.
  TensorEntry past = ckpt.catalog->tensors[0];
  past.shape = {2, 6};
  past.boxes[0].base_offset += 3 * 6 * 4;
  past.boxes[0].extent = {2, 6};
  // model.grid with its transposed box read as row-major.
  TensorEntry restrided = ckpt.catalog->tensors[2];
  restrided.boxes[1].strides = {6, 1};
  // model.w claimed as float16: the stored dtype is the source's.
  TensorEntry retyped = ckpt.catalog->tensors[0];
  retyped.dtype = DType::kF16;
  for (const auto& [entry, source, expected] :
       {std::tuple{past, 0u, "box 0 is not a sub-box"}, std::tuple{restrided, 2u, "box 1 is not a sub-box"},
        std::tuple{retyped, 0u, "changes the stored dtype"}}) {
    ServedTensors copy = served;
    ckptfs::ServedTensorsEditor(&copy).Replace({entry}, {source});
    const Status s = ckptfs::CheckSubBoxInvariant(copy, "test");
    BOOST_TEST(!s.ok(), expected);
    BOOST_TEST(Contains(s.message(), expected), s.message());
    BOOST_TEST(Contains(s.message(), "view transform test"), s.message());
  }
  // A selection of whole tensors, unchanged, passes.
  ServedTensors selected = served;
  ckptfs::ServedTensorsEditor(&selected).Replace({ckpt.catalog->tensors[4], ckpt.catalog->tensors[2]}, {4, 2});
  BOOST_TEST(ckptfs::CheckSubBoxInvariant(selected, "test").ok());
  BOOST_TEST(selected.source_index(1) == 2u);
}
