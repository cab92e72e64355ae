// The catalog's compact value types: KeyPath (a tensor's path packed into one string) gives
// back exactly the elements it was given, whatever their bytes or values, and flattens to
// the same key as the element list; SmallVector behaves as a vector across the switch from
// inline to heap storage (copies, moves, growth, inserts).
#define BOOST_TEST_MODULE catalog_test
#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"

using ckptfs::FindRepeatedKey;
using ckptfs::FlattenKey;
using ckptfs::KeyPath;
using ckptfs::PathElement;
using ckptfs::SmallVector;
using ckptfs::TensorEntry;

BOOST_AUTO_TEST_CASE(key_path_round_trips_every_kind_of_element) {
  const std::string long_name(300, 'x');  // a length past one varint byte
  const std::vector<PathElement> elements = {
      std::string("model"),
      int64_t{0},
      int64_t{-1},
      std::numeric_limits<int64_t>::min(),
      std::numeric_limits<int64_t>::max(),
      std::string(""),
      std::string("a\0b.c", 5),
      std::string("\xff\xfe not utf-8"),
      long_name,
      int64_t{300},
  };
  const KeyPath path(elements);
  BOOST_TEST(path.size() == elements.size());
  BOOST_TEST(!path.empty());
  const std::vector<PathElement> back = path;
  BOOST_TEST((back == elements));
  for (size_t i = 0; i < elements.size(); ++i) BOOST_TEST((path[i] == elements[i]));
  BOOST_TEST(FlattenKey(path) == FlattenKey(elements));

  KeyPath built;
  BOOST_TEST(built.empty());
  BOOST_TEST(built.size() == 0u);
  for (const PathElement& e : elements) built.push_back(e);
  BOOST_TEST((built == path));
  size_t strings = 0, ints = 0;
  path.ForEach([&](std::string_view) { ++strings; }, [&](int64_t) { ++ints; });
  BOOST_TEST(strings == 5u);
  BOOST_TEST(ints == 5u);
}

BOOST_AUTO_TEST_CASE(key_path_of_one_key_flattens_to_it) {
  const KeyPath path = {std::string("layers.7.weight")};
  BOOST_TEST(path.size() == 1u);
  BOOST_TEST(FlattenKey(path) == "layers.7.weight");
  const KeyPath nested = {std::string("optimizer"), std::string("state"), int64_t{3}, std::string("exp_avg")};
  BOOST_TEST(FlattenKey(nested) == "optimizer.state.3.exp_avg");
}

BOOST_AUTO_TEST_CASE(small_vector_grows_past_its_inline_storage) {
  SmallVector<uint64_t, 2> v;
  std::vector<uint64_t> reference;
  for (uint64_t i = 0; i < 100; ++i) {
    v.push_back(i * 3);
    reference.push_back(i * 3);
    BOOST_TEST((v == reference));
  }
  SmallVector<uint64_t, 2> copy = v;
  BOOST_TEST((copy == reference));
  SmallVector<uint64_t, 2> moved = std::move(copy);
  BOOST_TEST((moved == reference));
  BOOST_TEST(copy.empty());
  moved.insert(moved.begin() + 1, uint64_t{7});
  reference.insert(reference.begin() + 1, 7);
  BOOST_TEST((moved == reference));
  moved.erase(moved.begin());
  reference.erase(reference.begin());
  BOOST_TEST((moved == reference));
  moved.resize(1);
  BOOST_TEST(moved.size() == 1u);
  BOOST_TEST(moved[0] == 7u);
  std::vector<uint64_t> as_vector = moved;
  BOOST_TEST((as_vector == std::vector<uint64_t>{7}));
}

BOOST_AUTO_TEST_CASE(small_vector_stays_inline_and_converts_between_sizes) {
  SmallVector<uint64_t, 4> shape = {2, 3, 4};
  BOOST_TEST(shape.capacity() == 4u);
  SmallVector<uint64_t, 2> extent = shape;  // a shape becomes a box's extent
  BOOST_TEST((extent == std::vector<uint64_t>{2, 3, 4}));
  shape = {5};
  BOOST_TEST((shape == std::vector<uint64_t>{5}));
  SmallVector<uint64_t, 4> moved = std::move(shape);  // inline: copied, source emptied
  BOOST_TEST((moved == std::vector<uint64_t>{5}));
  BOOST_TEST(shape.empty());
  moved.assign(3, 9);
  BOOST_TEST((moved == std::vector<uint64_t>{9, 9, 9}));
  moved.push_back(moved[0]);  // an element of the vector itself, at the growth point
  moved.push_back(moved[0]);
  BOOST_TEST((moved == std::vector<uint64_t>{9, 9, 9, 9, 9}));
}

// The boxes a list holds, as (file, base offset) pairs: what tells them apart here.
std::vector<std::pair<uint32_t, uint64_t>> Files(const ckptfs::BoxList& boxes) {
  std::vector<std::pair<uint32_t, uint64_t>> out;
  for (const ckptfs::Box& b : boxes) out.emplace_back(b.file, b.base_offset);
  return out;
}

BOOST_AUTO_TEST_CASE(box_list_keeps_one_box_inline_and_more_in_order) {
  using ckptfs::Box;
  using ckptfs::BoxList;
  using Pairs = std::vector<std::pair<uint32_t, uint64_t>>;
  BoxList boxes;
  BOOST_TEST(boxes.empty());
  boxes.push_back(Box::Range(1, 10, 0, 4));
  BOOST_TEST((Files(boxes) == Pairs{{1, 10}}));
  BOOST_TEST(boxes.front().extent[0] == 4u);
  boxes.push_back(boxes[0]);  // its own element: copied before the list moves it
  boxes.push_back(Box::Range(3, 30, 8, 4));
  BOOST_TEST((Files(boxes) == Pairs{{1, 10}, {1, 10}, {3, 30}}));
  BOOST_TEST(boxes.end() - boxes.begin() == 3);
  BOOST_TEST(boxes.back().offset[0] == 8u);
  BoxList copy = boxes;
  boxes.resize(1);  // back inline, the first kept
  BOOST_TEST((Files(boxes) == Pairs{{1, 10}}));
  BOOST_TEST((Files(copy) == Pairs{{1, 10}, {1, 10}, {3, 30}}));
  boxes.resize(3);  // grown with empty boxes after it
  BOOST_TEST(boxes.size() == 3u);
  BOOST_TEST((Files(boxes)[0] == std::pair<uint32_t, uint64_t>{1, 10}));
  BOOST_TEST(boxes[2].rank() == 0u);
  boxes.clear();
  BOOST_TEST(boxes.empty());
  boxes.reserve(4);
  boxes.push_back(Box::Range(5, 50, 0, 1));
  BOOST_TEST((Files(boxes) == Pairs{{5, 50}}));
  BoxList from_vector = std::vector<Box>{Box::Range(6, 60, 0, 2), Box::Range(7, 70, 2, 2)};
  BoxList moved = std::move(from_vector);
  BOOST_TEST((Files(moved) == Pairs{{6, 60}, {7, 70}}));
  BoxList single = {Box::Range(8, 80, 0, 1)};
  single.reserve(2);  // an inline box moves to the heap with the room asked for
  single.push_back(Box::Range(9, 90, 1, 1));
  BOOST_TEST((Files(single) == Pairs{{8, 80}, {9, 90}}));
}

BOOST_AUTO_TEST_CASE(key_path_packed_bytes_round_trip_and_malformed_ones_are_refused) {
  const KeyPath path = {std::string("model"), int64_t{-5}, std::string(""), int64_t{1} << 40, std::string(300, 'x')};
  KeyPath back;
  BOOST_REQUIRE(KeyPath::FromPacked(path.packed(), &back));
  BOOST_TEST((back == path));
  BOOST_TEST(std::vector<PathElement>(back) == std::vector<PathElement>(path));
  BOOST_REQUIRE(KeyPath::FromPacked("", &back));
  BOOST_TEST(back.empty());
  // Every proper prefix that cuts an element is refused; the full bytes are not.
  const std::string packed(path.packed());
  size_t accepted = 0;
  for (size_t n = 0; n < packed.size(); ++n) accepted += KeyPath::FromPacked(packed.substr(0, n), &back) ? 1 : 0;
  BOOST_TEST(accepted == 5u);  // the empty prefix and the four ends of whole elements
  const std::string malformed[] = {
      std::string("\x0A" "abc", 4),           // a string of 5 bytes with 3 left
      std::string("\x03\x02", 2),             // an int element with a header other than 1
      std::string("\x01", 1),                 // an int element without its value
      std::string("\x80\x80", 2),             // a varint that never ends
      std::string(11, '\xFF') + "\x01",       // a varint of more than 64 bits
  };
  for (const std::string& bytes : malformed) BOOST_TEST(!KeyPath::FromPacked(bytes, &back));
}

BOOST_AUTO_TEST_CASE(repeated_keys_are_found_only_in_the_range_asked) {
  std::vector<TensorEntry> tensors(5);
  const char* keys[] = {"a.b", "x", "a.c", "y", "a.b"};
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].key = keys[i];
  BOOST_TEST(FindRepeatedKey(tensors).value_or(99) == 4u);  // the later of the pair
  BOOST_TEST(!FindRepeatedKey(tensors, 1).has_value());      // "a.b" at 0 is outside
  tensors[3].key = "x";
  BOOST_TEST(FindRepeatedKey(tensors, 1).value_or(99) == 3u);
  BOOST_TEST(!FindRepeatedKey(tensors, 5).has_value());
  BOOST_TEST(!FindRepeatedKey({}).has_value());
}

// Many keys, sorted as (hash, index) words: a repeat must be found wherever it lies and
// reported by its later place, and none reported where there is none.
BOOST_AUTO_TEST_CASE(repeated_keys_are_found_among_many) {
  std::vector<TensorEntry> tensors(200'000);
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].key = "layers." + std::to_string(i) + ".weight";
  BOOST_TEST(!FindRepeatedKey(tensors).has_value());
  BOOST_TEST(!FindRepeatedKey(tensors, 123'456).has_value());
  tensors[150'001].key = tensors[7].key;
  BOOST_TEST(FindRepeatedKey(tensors).value_or(0) == 150'001u);
  BOOST_TEST(!FindRepeatedKey(tensors, 8).has_value());  // its first is outside the range
  tensors[199'999].key = tensors[150'000].key;
  BOOST_TEST(FindRepeatedKey(tensors, 8).value_or(0) == 199'999u);
}
