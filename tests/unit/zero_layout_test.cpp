// The DeepSpeed ZeRO extent arithmetic (src/format/deepspeed/zero_layout.hpp) on hand-made layouts,
// without any file: stage 1/2 with 1, 2 and 3 ranks, parameters straddling rank
// boundaries, per-parameter alignment pads, the 2·W rounding, the BF16_Optimizer and
// several groups; stage 3 with ceil(n/W) chunks, a parameter smaller than W and a chunk
// straddling two sub-groups; flat partitions that are themselves several ranges; Adam
// moments laid out like the partitions; and each refusal with its exact message. Every
// expectation is worked out by hand from doc/FORMATS.md, "DeepSpeed stage 1/2 layout" and
// "DeepSpeed stage 3 layout" (f32 elements: 4 bytes).
#define BOOST_TEST_MODULE zero_layout_test
#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "format/deepspeed/zero_layout.hpp"

using ckptfs::Box;
using ckptfs::DType;
using ckptfs::Status;
using ckptfs::TensorEntry;
using ckptfs::ZeroLayout;
using ckptfs::ZeroRankFlats;

namespace {

// Where `count` elements of a flat tensor are stored: byte `base` of file `file`.
struct Range {
  uint32_t file;
  uint64_t base;
  uint64_t count;
};

// A flat 1-D tensor stored as the given ranges, in order.
TensorEntry Flat(const std::vector<Range>& ranges, DType dtype = DType::kF32) {
  TensorEntry t;
  t.dtype = dtype;
  uint64_t numel = 0;
  for (const Range& r : ranges) {
    t.boxes.push_back(Box::Range(r.file, r.base, numel, r.count));
    numel += r.count;
  }
  t.shape = {numel};
  return t;
}

// Rank r's flat tensors in these tests: file r + 1, group g at byte 1000·(r+1) + 500·g,
// with lengths[g] elements; its path is "rank<r>.pt".
ZeroRankFlats Rank(uint32_t r, const std::vector<uint64_t>& lengths) {
  ZeroRankFlats rank{"rank" + std::to_string(r) + ".pt", {}};
  for (size_t g = 0; g < lengths.size(); ++g) rank.groups.push_back(Flat({{r + 1, 1000 * (r + 1) + 500 * g, lengths[g]}}));
  return rank;
}

ZeroLayout Layout(int stage, uint64_t world, ckptfs::ZeroParamShapes shapes,
                  std::vector<std::vector<uint64_t>> align_pads = {}) {
  ZeroLayout layout;
  layout.stage = stage;
  layout.world = world;
  layout.shapes = std::move(shapes);
  layout.align_pads = std::move(align_pads);
  return layout;
}

// What the reader does: measure the fp32 partitions, then walk `flats` (the partitions
// themselves when empty).
Status Walk(ZeroLayout layout, const std::vector<ZeroRankFlats>& fp32, std::vector<TensorEntry>* out,
            const std::vector<ZeroRankFlats>& flats = {}) {
  CKPTFS_RETURN_IF_ERROR(ckptfs::CheckZeroPartitions(fp32, &layout));
  return ckptfs::WalkZeroTrainable(layout, flats.empty() ? fp32 : flats, out);
}

// The boxes of a tensor as "file base offset extent" lines (each a rank-1 contiguous range).
std::vector<std::string> Boxes(const TensorEntry& t) {
  std::vector<std::string> out;
  for (const Box& b : t.boxes) {
    BOOST_TEST(b.rank() == 1u);
    BOOST_TEST(b.strides == std::vector<uint64_t>{1});
    out.push_back(std::to_string(b.file) + " " + std::to_string(b.base_offset) + " " + std::to_string(b.offset[0]) + " " +
                  std::to_string(b.extent[0]));
  }
  return out;
}

// Checks the walk produced `expected.size()` parameters with these keys and boxes.
void ExpectParams(const std::vector<TensorEntry>& params,
                  const std::vector<std::pair<std::string, std::vector<std::string>>>& expected) {
  BOOST_TEST_REQUIRE(params.size() == expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    BOOST_TEST_CONTEXT("parameter " << expected[i].first) {
      BOOST_TEST(params[i].key == expected[i].first);
      const std::vector<std::string> boxes = Boxes(params[i]);
      BOOST_TEST(boxes == expected[i].second, boost::test_tools::per_element());
    }
  }
}

void ExpectOk(const Status& s) { BOOST_TEST_REQUIRE(s.ok(), s.message()); }

void ExpectCorruption(const Status& s, const std::string& message) {
  BOOST_TEST(!s.ok());
  BOOST_TEST((s.code() == Status::Code::kCorruption));
  BOOST_TEST(s.message() == message);
}

}  // namespace

// ---- arithmetic helpers -------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(chunk_sizes) {
  BOOST_TEST(ckptfs::ZeroChunkElements(10, 3) == 4u);
  BOOST_TEST(ckptfs::ZeroChunkElements(9, 3) == 3u);
  BOOST_TEST(ckptfs::ZeroChunkElements(0, 3) == 0u);
  BOOST_TEST(ckptfs::ZeroRealChunkElements(10, 3, 0) == 4u);
  BOOST_TEST(ckptfs::ZeroRealChunkElements(10, 3, 2) == 2u);
  BOOST_TEST(ckptfs::ZeroRealChunkElements(2, 4, 1) == 1u);
  BOOST_TEST(ckptfs::ZeroRealChunkElements(2, 4, 3) == 0u);
  // ceil(n/W) without computing n + W - 1.
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  BOOST_TEST(ckptfs::ZeroChunkElements(max, 2) == (max / 2 + 1));
}

BOOST_AUTO_TEST_CASE(shape_sizes) {
  BOOST_TEST(ckptfs::ZeroNumel({}) == 1u);
  BOOST_TEST(ckptfs::ZeroNumel({2, 3, 4}) == 24u);
  BOOST_TEST(ckptfs::ZeroShapeFits({uint64_t{1} << 60}));
  BOOST_TEST(!ckptfs::ZeroShapeFits({uint64_t{1} << 61}));  // 2^61 elements of 8 bytes
  BOOST_TEST(!ckptfs::ZeroShapeFits({uint64_t{1} << 32, uint64_t{1} << 32}));
}

// ---- stage 1/2 ------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(stage12_one_rank) {
  // A (2x3) then B (4): one partition of 10 elements, already a multiple of 2·W = 2.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 1, {{{"A", {2, 3}}, {"B", {4}}}}), {Rank(0, {10})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 6"}}, {"B", {"1 1024 0 4"}}});
  BOOST_TEST((params[0].shape == std::vector<uint64_t>{2, 3}));
  BOOST_TEST((params[0].dtype == DType::kF32));
}

BOOST_AUTO_TEST_CASE(stage12_two_ranks_parameter_straddles_the_boundary) {
  // A (5), B (6): N = 11, N_pad = 12, S = 6; saved lengths 6 and 5 (C = 0, 6, 11).
  // B = rank 0 [5, 6) + rank 1 [0, 5).
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 2, {{{"A", {5}}, {"B", {6}}}}), {Rank(0, {6}), Rank(1, {5})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 5"}}, {"B", {"1 1020 0 1", "2 2000 1 5"}}});
}

BOOST_AUTO_TEST_CASE(stage12_three_ranks_formats_example) {
  // doc/FORMATS.md's example: A (10), B (5); saved lengths 6, 6, 3 (C = 0, 6, 12, 15).
  // A = rank 0 [0, 6) + rank 1 [0, 4); B = rank 1 [4, 6) + rank 2 [0, 3).
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(1, 3, {{{"A", {10}}, {"B", {5}}}}), {Rank(0, {6}), Rank(1, {6}), Rank(2, {3})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 6", "2 2000 6 4"}}, {"B", {"2 2016 0 2", "3 3000 2 3"}}});
}

BOOST_AUTO_TEST_CASE(stage12_scalar_and_empty_parameters) {
  // A scalar is one element; a parameter with no elements gets no box and uses no space.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 1, {{{"s", {}}, {"e", {0, 3}}, {"v", {3}}}}), {Rank(0, {4})}, &params));
  ExpectParams(params, {{"s", {"1 1000 0 1"}}, {"e", {}}, {"v", {"1 1004 0 3"}}});
}

BOOST_AUTO_TEST_CASE(stage12_alignment_paddings) {
  // W = 2, A (3) followed by 1 pad element, B (4): the flat vector is A, pad, B (8
  // elements, S = 4). B starts at 4: all of rank 1.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 2, {{{"A", {3}}, {"B", {4}}}}, {{1, 0}}), {Rank(0, {4}), Rank(1, {4})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 3"}}, {"B", {"2 2000 0 4"}}});
}

BOOST_AUTO_TEST_CASE(stage12_alignment_paddings_shorter_than_the_group) {
  // Pads listed for the first parameter only and for group 0 only: the rest have none.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 1, {{{"A", {1}}, {"B", {2}}}, {{"C", {1}}, {"D", {1}}}}, {{1}}),
                {Rank(0, {4, 2})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 1"}}, {"B", {"1 1008 0 2"}}, {"C", {"1 1500 0 1"}}, {"D", {"1 1504 0 1"}}});
}

BOOST_AUTO_TEST_CASE(stage12_totals_agree_after_rounding_to_2w) {
  // W = 2, A (5) then a 1-element pad: the parameters use 6, the partitions hold 5 (saved
  // lengths 4 and 1); both round up to 8.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 2, {{{"A", {5}}}}, {{1}}), {Rank(0, {4}), Rank(1, {1})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 4", "2 2000 4 1"}}});
}

BOOST_AUTO_TEST_CASE(stage12_totals_disagreeing_are_refused) {
  // A (3) in partitions of 4 + 4: round_up(3, 4) = 4, round_up(8, 4) = 8.
  std::vector<TensorEntry> params;
  ExpectCorruption(Walk(Layout(2, 2, {{{"A", {3}}}}), {Rank(0, {4}), Rank(1, {4})}, &params),
                   "rank0.pt: group 0: parameters use 3 elements but the partitions hold 8");
}

BOOST_AUTO_TEST_CASE(bf16_optimizer_partitions_keep_their_padding) {
  // The same layout under the BF16_Optimizer: its saved partitions include the padding, so
  // the parameters need only fit.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(-1, 2, {{{"A", {3}}}}), {Rank(0, {4}), Rank(1, {4})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 3"}}});
  // ... and a pad running past the partitions is refused.
  params.clear();
  ExpectCorruption(Walk(Layout(-1, 2, {{{"A", {3}}}}, {{6}}), {Rank(0, {4}), Rank(1, {4})}, &params),
                   "rank0.pt: group 0: parameters use 9 elements but the partitions hold 8");
}

BOOST_AUTO_TEST_CASE(stage12_several_groups) {
  // W = 2. Group 0: A (4), saved 2 + 2. Group 1: B (2), C (2), saved 2 + 2.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 2, {{{"A", {4}}}, {{"B", {2}}, {"C", {1, 2}}}}), {Rank(0, {2, 2}), Rank(1, {2, 2})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 2", "2 2000 2 2"}}, {"B", {"1 1500 0 2"}}, {"C", {"2 2500 0 2"}}});
}

BOOST_AUTO_TEST_CASE(stage12_partition_stored_as_two_ranges) {
  // W = 2; rank 0's 6-element partition is 3 elements in file 5 then 3 in file 6; rank 1
  // holds 4 (C = 0, 6, 10). A (5) = file 5 [0, 3) + file 6 [0, 2); B (5) = file 6 [2, 3) +
  // rank 1 [0, 4).
  ZeroRankFlats rank0{"rank0.pt", {Flat({{5, 100, 3}, {6, 0, 3}})}};
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 2, {{{"A", {5}}, {"B", {5}}}}), {rank0, Rank(1, {4})}, &params));
  ExpectParams(params, {{"A", {"5 100 0 3", "6 0 3 2"}}, {"B", {"6 8 0 1", "2 2000 1 4"}}});
}

BOOST_AUTO_TEST_CASE(adjacent_ranges_of_one_file_merge) {
  // Both ranks' partitions in file 1, rank 1's right after rank 0's: A (8) is one read.
  ZeroRankFlats rank0{"rank0.pt", {Flat({{1, 0, 4}})}};
  ZeroRankFlats rank1{"rank1.pt", {Flat({{1, 16, 4}})}};
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 2, {{{"A", {8}}}}), {rank0, rank1}, &params));
  ExpectParams(params, {{"A", {"1 0 0 8"}}});
}

BOOST_AUTO_TEST_CASE(stage12_moments_use_the_partitions_lengths) {
  // W = 2, A (3), B (3): N = 6, N_pad = 8, S = 4; fp32 saved 4 + 2, moments at full S = 4.
  // The walk uses C = 0, 4, 6 from the fp32 partitions: B = rank 0 [3, 4) + rank 1 [0, 2).
  std::vector<ZeroRankFlats> moments = {{"rank0.pt", {Flat({{11, 0, 4}})}}, {"rank1.pt", {Flat({{12, 0, 4}})}}};
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(2, 2, {{{"A", {3}}, {"B", {3}}}}), {Rank(0, {4}), Rank(1, {2})}, &params, moments));
  ExpectParams(params, {{"A", {"11 0 0 3"}}, {"B", {"11 12 0 1", "12 0 1 2"}}});
}

BOOST_AUTO_TEST_CASE(stage12_refusals) {
  std::vector<TensorEntry> params;
  ExpectCorruption(Walk(Layout(2, 1, {{{"A", {1}}}, {{"B", {1}}}}), {Rank(0, {2})}, &params),
                   "rank0.pt: holds 1 parameter groups but param_shapes lists 2");
  ExpectCorruption(Walk(Layout(2, 2, {{{"A", {4}}, {"B", {5}}}}), {Rank(0, {4}), Rank(1, {4})}, &params),
                   "rank0.pt: parameter 'B' runs past the end of the flat partitions");
  // A pad that would wrap the offset round to a small total.
  ExpectCorruption(Walk(Layout(2, 1, {{{"A", {2}}}}, {{std::numeric_limits<uint64_t>::max() - 1}}), {Rank(0, {2})}, &params),
                   "rank0.pt: the alignment padding after parameter 'A' overflows");
  // A moment shorter than the fp32 partition it mirrors.
  std::vector<ZeroRankFlats> short_moment = {{"m0.pt", {Flat({{11, 0, 3}})}}};
  ExpectCorruption(Walk(Layout(2, 1, {{{"A", {4}}}}), {Rank(0, {4})}, &params, short_moment),
                   "m0.pt: a flat partition is shorter than its parameters need");
  // Ranks whose partitions differ in dtype.
  ZeroRankFlats bf16_rank{"rank1.pt", {Flat({{2, 2000, 2}}, DType::kBF16)}};
  ExpectCorruption(Walk(Layout(2, 2, {{{"A", {4}}}}), {Rank(0, {2}), bf16_rank}, &params),
                   "rank1.pt: a flat partition's dtype differs from its parameter's");
}

// ---- stage 3 --------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(stage3_formats_example) {
  // doc/FORMATS.md's example: W = 3, A (10) and B (5) in one sub-group of M = 6 per rank.
  // P_A = 4: ranks 0 and 1 [0, 4), rank 2 [0, 2). P_B = 2 at offset 4: ranks 0 and 1 [4, 6),
  // rank 2 [4, 5).
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(3, 3, {{{"A", {2, 5}}, {"B", {5}}}}), {Rank(0, {6}), Rank(1, {6}), Rank(2, {6})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 4", "2 2000 4 4", "3 3000 8 2"}},
                        {"B", {"1 1016 0 2", "2 2016 2 2", "3 3016 4 1"}}});
  BOOST_TEST((params[0].shape == std::vector<uint64_t>{2, 5}));
}

BOOST_AUTO_TEST_CASE(stage3_parameter_smaller_than_the_world) {
  // W = 4, A (2): P = 1; ranks 0 and 1 hold one real element each, ranks 2 and 3 padding.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(3, 4, {{{"A", {2}}}}), {Rank(0, {1}), Rank(1, {1}), Rank(2, {1}), Rank(3, {1})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 1", "2 2000 1 1"}}});
}

BOOST_AUTO_TEST_CASE(stage3_chunk_straddling_two_sub_groups) {
  // W = 2, sub-groups of 3 and 3 per rank (param_shapes lists them as two dicts). A (4):
  // P = 2 at [0, 2); B (6): P = 3 at [2, 5), across the boundary at 3; C (2): P = 1 at
  // [5, 6). Sub-group j of rank r sits at byte 1000·(r+1) + 500·j.
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(3, 2, {{{"A", {4}}, {"B", {6}}}, {{"C", {2}}}}), {Rank(0, {3, 3}), Rank(1, {3, 3})}, &params));
  ExpectParams(params, {{"A", {"1 1000 0 2", "2 2000 2 2"}},
                        {"B", {"1 1008 0 1", "1 1500 1 2", "2 2008 3 1", "2 2500 4 2"}},
                        {"C", {"1 1508 0 1", "2 2508 1 1"}}});
}

BOOST_AUTO_TEST_CASE(stage3_sub_group_stored_as_two_ranges) {
  // W = 2, A (6): P = 3; rank 0's sub-group is 2 elements in file 7 then 1 in file 8.
  ZeroRankFlats rank0{"rank0.pt", {Flat({{7, 40, 2}, {8, 0, 1}})}};
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(3, 2, {{{"A", {6}}}}), {rank0, Rank(1, {3})}, &params));
  ExpectParams(params, {{"A", {"7 40 0 2", "8 0 2 1", "2 2000 3 3"}}});
}

BOOST_AUTO_TEST_CASE(stage3_moments_laid_out_like_the_sub_groups) {
  // W = 2, A (5): P = 3 at [0, 3), rank 1 holding 2 real elements; B (6): P = 3 at [3, 6).
  // The moments' sub-groups sit in files 21 and 22.
  std::vector<ZeroRankFlats> moments = {{"rank0.pt", {Flat({{21, 0, 6}})}}, {"rank1.pt", {Flat({{22, 64, 6}})}}};
  std::vector<TensorEntry> params;
  ExpectOk(Walk(Layout(3, 2, {{{"A", {5}}, {"B", {6}}}}), {Rank(0, {6}), Rank(1, {6})}, &params, moments));
  ExpectParams(params, {{"A", {"21 0 0 3", "22 64 3 2"}}, {"B", {"21 12 0 3", "22 76 3 3"}}});
}

BOOST_AUTO_TEST_CASE(stage3_refusals) {
  std::vector<TensorEntry> params;
  ExpectCorruption(Walk(Layout(3, 2, {{{"A", {4}}}}), {Rank(0, {3}), Rank(1, {4})}, &params),
                   "rank1.pt: sub-group 0 differs in size from rank 0's");
  // A (4) uses P = 2 per rank; the sub-groups hold 3.
  ExpectCorruption(Walk(Layout(3, 2, {{{"A", {4}}}}), {Rank(0, {3}), Rank(1, {3})}, &params),
                   "rank0.pt: parameters use 2 elements per rank but the flat groups hold 3");
  // A (8) needs P = 4 per rank; the sub-groups hold 3.
  params.clear();
  ExpectCorruption(Walk(Layout(3, 2, {{{"A", {8}}}}), {Rank(0, {3}), Rank(1, {3})}, &params),
                   "rank0.pt: parameters run past the flat groups");
  // A moment shorter than the sub-group it mirrors.
  std::vector<ZeroRankFlats> short_moment = {{"m0.pt", {Flat({{21, 0, 2}})}}, {"m1.pt", {Flat({{22, 0, 3}})}}};
  ExpectCorruption(Walk(Layout(3, 2, {{{"A", {6}}}}), {Rank(0, {3}), Rank(1, {3})}, &params, short_moment),
                   "m0.pt: a flat partition is shorter than its parameters need");
}
