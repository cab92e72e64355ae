// The torch.distributed.checkpoint reader on real folders (tests/data/make_dcp_sample.py:
// dcp-sample/ written by dcp.save, dcp-sharded/ two rank files of torch.save chunks with a
// .metadata pickled from DCP's own classes, dcp-variants/ broken .metadata files for it),
// loaded into a MemoryEnv.
#define BOOST_TEST_MODULE dcp_test
#include <boost/test/unit_test.hpp>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "ckptfs/catalog.hpp"
#include "format/dcp/dcp_metadata.hpp"
#include "format/megatron/megatron_fragments.hpp"
#include "format/megatron/megatron_tensor_facts.hpp"
#include "test_util.hpp"

using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::Status;
using ckptfs::TensorEntry;
using namespace ckptfs_test;

BOOST_TEST_DONT_PRINT_LOG_VALUE(ckptfs::DType)
BOOST_TEST_DONT_PRINT_LOG_VALUE(ckptfs::Status::Code)

namespace {

const std::string kData = CKPTFS_TEST_DATA;

// Copies folder `name` of tests/data into `source` under `dest`.
void CopyFolder(MemorySource* source, const std::string& name, const std::string& dest) {
  for (const auto& e : std::filesystem::directory_iterator(kData + "/" + name))
    source->Write(dest + "/" + e.path().filename().string(), ReadFile(e.path().string()));
}

const TensorEntry& Tensor(const Catalog& c, const std::string& key) {
  for (const TensorEntry& t : c.tensors)
    if (t.key == key) return t;
  BOOST_FAIL("no tensor " + key);
  throw std::logic_error("unreachable");
}

// The stored bytes of a tensor served as extents.
std::string ExtentBytes(const Catalog& c, const TensorEntry& t) {
  std::string out;
  for (const ckptfs::Extent& e : ckptfs::ExtentsOf(t)) {
    std::string part(e.length, '\0');
    BOOST_REQUIRE(c.files->ReadExact(e.file, e.offset, e.length, part.data()).ok());
    out += part;
  }
  return out;
}

template <typename T>
std::string Arange(size_t n) {
  std::string out(n * sizeof(T), '\0');
  for (size_t i = 0; i < n; ++i) {
    T v = static_cast<T>(i);
    std::memcpy(out.data() + i * sizeof(T), &v, sizeof(T));
  }
  return out;
}

Status OpenWithMetadata(const std::string& variant, std::shared_ptr<const Catalog>* out, MemorySource* source) {
  CopyFolder(source, "dcp-sharded", "/ck");
  source->Write("/ck/.metadata", ReadFile(kData + "/dcp-variants/" + variant));
  return source->OpenCatalog("/ck", out);
}

// The catalog of tests/data/`name` served from memory; the test stops if it fails to open.
std::shared_ptr<const Catalog> OpenSample(MemorySource* source, const std::string& name) {
  CopyFolder(source, name, "/ck");
  std::shared_ptr<const Catalog> c;
  Status s = source->OpenCatalog("/ck", &c);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return c;
}

}  // namespace

BOOST_AUTO_TEST_CASE(world_size_one_save) {
  MemorySource source;
  std::shared_ptr<const Catalog> c = OpenSample(&source, "dcp-sample");
  BOOST_TEST(c->format == "dcp");
  BOOST_REQUIRE_EQUAL(c->tensors.size(), 4u);
  BOOST_TEST(c->tensors[0].key == "model.layers.0.weight");
  BOOST_TEST(c->tensors[1].key == "model.layers.0.bias");
  BOOST_TEST(c->tensors[2].key == "model.head");
  BOOST_TEST(c->tensors[3].key == "optim.state.model.layers.0.weight.step");

  const TensorEntry& w = Tensor(*c, "model.layers.0.weight");
  BOOST_TEST(w.dtype == DType::kF32);
  BOOST_TEST(w.shape == (std::vector<uint64_t>{3, 4}));
  BOOST_TEST(w.path.size() == 4u);
  BOOST_REQUIRE(ckptfs::StoredAsExtents(w));
  BOOST_TEST(ExtentBytes(*c, w) == Arange<float>(12));

  const TensorEntry& b = Tensor(*c, "model.layers.0.bias");
  BOOST_TEST(b.dtype == DType::kBF16);
  BOOST_TEST(b.shape == (std::vector<uint64_t>{3}));

  // A transposed view keeps its strides: one strided box over the whole shape.
  const TensorEntry& head = Tensor(*c, "model.head");
  BOOST_TEST(head.dtype == DType::kI64);
  BOOST_TEST(head.shape == (std::vector<uint64_t>{3, 2}));
  BOOST_REQUIRE_EQUAL(head.boxes.size(), 1u);
  BOOST_TEST(head.boxes[0].strides == (std::vector<uint64_t>{1, 3}));
  BOOST_TEST(!ckptfs::StoredAsExtents(head));

  const TensorEntry& step = Tensor(*c, "optim.state.model.layers.0.weight.step");
  BOOST_TEST(step.shape.empty());
  BOOST_TEST(ExtentBytes(*c, step) == Arange<float>(8).substr(7 * 4));

  // Non-tensor entries, nested by their planner_data paths (list positions as keys).
  BOOST_TEST(c->metadata["step"] == 5);
  BOOST_TEST(c->metadata["name"] == "sample");
  BOOST_TEST(c->metadata["optim"]["param_groups"]["0"]["lr"] == 0.5);
  BOOST_TEST(c->metadata["optim"]["param_groups"]["0"]["params"][0] == "model.layers.0.weight");
  BOOST_TEST(c->metadata["dcp"]["version"] == "1.0.0");
  BOOST_TEST(c->metadata["dcp"]["data_files"] == 1);
  BOOST_TEST(!c->metadata["dcp"].contains("step_folder"));
}

BOOST_AUTO_TEST_CASE(sharded_chunks) {
  MemorySource source;
  std::shared_ptr<const Catalog> c = OpenSample(&source, "dcp-sharded");
  BOOST_TEST(c->metadata["dcp"]["ranks"] == 2);

  // Chunks tiling dim 0 are byte ranges of the two rank files, in order.
  const TensorEntry& rows = Tensor(*c, "rows");
  BOOST_REQUIRE_EQUAL(rows.boxes.size(), 2u);
  BOOST_TEST(rows.boxes[0].file != rows.boxes[1].file);
  BOOST_TEST(rows.boxes[1].offset == (std::vector<uint64_t>{5, 0}));
  BOOST_REQUIRE(ckptfs::StoredAsExtents(rows));
  BOOST_TEST(ExtentBytes(*c, rows) == Arange<float>(24));

  // Chunks split along dim 1 are gathered.
  const TensorEntry& cols = Tensor(*c, "cols");
  BOOST_TEST(cols.dtype == DType::kI32);
  BOOST_REQUIRE_EQUAL(cols.boxes.size(), 2u);
  BOOST_TEST(cols.boxes[1].offset == (std::vector<uint64_t>{0, 4}));
  BOOST_TEST(cols.boxes[1].extent == (std::vector<uint64_t>{2, 2}));
  BOOST_TEST(cols.boxes[1].strides == (std::vector<uint64_t>{2, 1}));
  BOOST_TEST(!ckptfs::StoredAsExtents(cols));

  // A chunk replicated on both ranks is served once.
  const TensorEntry& rep = Tensor(*c, "replicated");
  BOOST_REQUIRE_EQUAL(rep.boxes.size(), 1u);
  BOOST_TEST(ExtentBytes(*c, rep).size() == 10u);
}

BOOST_AUTO_TEST_CASE(latest_step_folder) {
  MemorySource source;
  CopyFolder(&source, "dcp-sample", "/run/step-5");
  CopyFolder(&source, "dcp-sharded", "/run/step-10");
  std::shared_ptr<const Catalog> c;
  Status s = source.OpenCatalog("/run", &c);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(c->metadata["dcp"]["step_folder"] == "step-10");
  BOOST_TEST(c->metadata["dcp"]["step"] == 10);
  BOOST_TEST(c->tensors.size() == 3u);
}

BOOST_AUTO_TEST_CASE(megatron_iteration_file) {
  MemorySource source;
  CopyFolder(&source, "dcp-sample", "/run/iter_0000005");
  CopyFolder(&source, "dcp-sharded", "/run/iter_0000010");
  source.Write("/run/iter_0000005/common.pt", "not read");
  source.Write("/run/latest_checkpointed_iteration.txt", "5\n");
  std::shared_ptr<const Catalog> c;
  Status s = source.OpenCatalog("/run", &c);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(c->metadata["dcp"]["step_folder"] == "iter_0000005");
  BOOST_TEST(c->tensors.size() == 4u);
  BOOST_REQUIRE_EQUAL(c->sibling_files.size(), 1u);
  BOOST_TEST(c->files->path(c->sibling_files[0]) == "/run/iter_0000005/common.pt");

  source.Write("/run/latest_checkpointed_iteration.txt", "7");
  s = source.OpenCatalog("/run", &c);
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "latest_checkpointed_iteration.txt"), s.message());
}

BOOST_AUTO_TEST_CASE(code_running_global_refused) {
  MemorySource source;
  CopyFolder(&source, "dcp-sharded", "/ck");
  // pickle protocol 2: os.system("touch /tmp/x")
  static const char kPickle[] = "\x80\x02" "cos\nsystem\n" "q\x00" "X\x0c\x00\x00\x00" "touch /tmp/x" "q\x01\x85q\x02Rq\x03.";
  source.Write("/ck/.metadata", std::string(kPickle, sizeof(kPickle) - 1));
  std::shared_ptr<const Catalog> c;
  Status s = source.OpenCatalog("/ck", &c);
  BOOST_TEST(s.code() == Status::Code::kRefused, s.message());
  BOOST_TEST(Contains(s.message(), "os.system"), s.message());
}

BOOST_AUTO_TEST_CASE(broken_metadata_named) {
  struct Case {
    const char* variant;
    Status::Code code;
    const char* says;
  };
  const Case cases[] = {
      {"transformed.metadata", Status::Code::kNotSupported, "'rows' is stored with transforms (zstd)"},
      {"escaping.metadata", Status::Code::kCorruption, "'rows': storage path '../__1_0.distcp' leaves"},
      {"outside.metadata", Status::Code::kCorruption, "'rows': slice [0, 0+1048576) lies outside"},
      {"no-storage.metadata", Status::Code::kCorruption, "'rows': no storage_data entry for the chunk at offsets (5, 0)"},
      {"wrong-dtype.metadata", Status::Code::kCorruption, "'rows': the chunk is float32 but .metadata says float64"},
      {"hole.metadata", Status::Code::kCorruption, "tensor 'cols'"},
  };
  for (const Case& k : cases) {
    MemorySource source;
    std::shared_ptr<const Catalog> c;
    Status s = OpenWithMetadata(k.variant, &c, &source);
    BOOST_TEST(s.code() == k.code, k.variant << ": " << s.message());
    BOOST_TEST(Contains(s.message(), k.says), k.variant << ": " << s.message());
  }
}

BOOST_AUTO_TEST_CASE(missing_data_file_named) {
  MemorySource source;
  CopyFolder(&source, "dcp-sample", "/ck");
  BOOST_REQUIRE(source.env()->RemoveFile("/ck/__0_0.distcp").ok());
  std::shared_ptr<const Catalog> c;
  Status s = source.OpenCatalog("/ck", &c);
  BOOST_TEST(s.code() == Status::Code::kNotFound, s.message());
  BOOST_TEST(Contains(s.message(), "/ck/__0_0.distcp"), s.message());
  BOOST_TEST(Contains(s.message(), "'model.layers.0.weight'"), s.message());
}

BOOST_AUTO_TEST_CASE(metadata_parser_alone) {
  ckptfs::DcpMetadata meta;
  Status s = ckptfs::ParseDcpMetadata(ReadFile(kData + "/dcp-sharded/.metadata"), "x", &meta);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE_EQUAL(meta.items.size(), 3u);
  BOOST_TEST(meta.items[2].chunk_count() == 2u);  // both replicas listed
  BOOST_REQUIRE_EQUAL(meta.items[0].chunk_count(), 2u);
  BOOST_TEST(meta.files.at(meta.items[0].chunk_slices[1].file) == "__1_0.distcp");
  BOOST_TEST(meta.items[0].offsets(1)[0] == meta.items[0].sizes(0)[0]);  // rows split between two ranks
  BOOST_TEST(meta.items[0].sizes(1)[1] == meta.items[0].shape[1]);
  s = ckptfs::ParseDcpMetadata("", "x", &meta);
  BOOST_TEST(!s.ok());
}

// Megatron's reformulation, by its definition, on small shapes: every way of cutting each chunk
// of every grid of a few real shapes into fragments, each fragment stored contiguously at its
// own place in one file. Every element of the real tensor must be covered by exactly one box,
// at the byte where its fragment stores it.
namespace {

struct Case {
  std::vector<uint64_t> real, grid;
  bool row_major;
};

uint64_t Product(const std::vector<uint64_t>& v) {
  uint64_t p = 1;
  for (uint64_t x : v) p *= x;
  return p;
}

// Row-major index of `index` in `dims`.
uint64_t Flat(const std::vector<uint64_t>& index, const std::vector<uint64_t>& dims) {
  uint64_t f = 0;
  for (size_t d = 0; d < dims.size(); ++d) f = f * dims[d] + index[d];
  return f;
}

std::vector<uint64_t> Unflat(uint64_t f, const std::vector<uint64_t>& dims) {
  std::vector<uint64_t> index(dims.size());
  for (size_t d = dims.size(); d-- > 0;) index[d] = f % dims[d], f /= dims[d];
  return index;
}

// Places fragments of chunk length n cut at `cuts` (sorted, inside (0, n)) for every chunk;
// checks the boxes against where each element is stored.
void CheckCuts(const Case& c, const std::vector<uint64_t>& cuts) {
  ckptfs::MegatronReformulation plan;
  std::string why;
  std::vector<uint64_t> reformulated = c.grid;
  std::vector<uint64_t> chunk(c.real.size());
  for (size_t d = 0; d < chunk.size(); ++d) chunk[d] = c.real[d] / c.grid[d];
  const uint64_t n = Product(chunk);
  reformulated.push_back(n);
  BOOST_REQUIRE_MESSAGE(ckptfs::PlanMegatronReformulation(c.real, reformulated, &plan, &why), why);
  BOOST_TEST(plan.row_major == c.row_major);
  const uint64_t itemsize = 4, base = 1000;
  // Where chunk-flat element k of chunk g is stored: fragments laid out chunk after chunk,
  // with a gap of one element between fragments.
  std::map<std::pair<uint64_t, uint64_t>, uint64_t> stored;
  ckptfs::BoxList boxes;
  uint64_t at = base;
  std::vector<uint64_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(n);
  for (uint64_t g = 0; g < Product(c.grid); ++g) {
    std::vector<uint64_t> offsets = Unflat(g, c.grid);
    offsets.push_back(0);
    std::vector<uint64_t> sizes(c.grid.size(), 1);
    sizes.push_back(0);
    for (size_t f = 0; f + 1 < bounds.size(); ++f) {
      offsets.back() = bounds[f];
      sizes.back() = bounds[f + 1] - bounds[f];
      for (uint64_t k = bounds[f]; k < bounds[f + 1]; ++k) stored[{g, k}] = at + (k - bounds[f]) * itemsize;
      BOOST_REQUIRE_MESSAGE(ckptfs::PlaceMegatronFragment(plan, offsets, sizes, 7, at, itemsize, &boxes, &why), why);
      at += (sizes.back() + 1) * itemsize;
    }
  }
  // Each real element: where the boxes say it is.
  std::map<uint64_t, uint64_t> placed;
  for (const ckptfs::Box& box : boxes) {
    BOOST_REQUIRE(box.file == 7u);
    const size_t rank = box.rank();
    BOOST_REQUIRE(rank == (c.row_major ? 1 : c.real.size()));
    std::vector<uint64_t> extent(box.extent.begin(), box.extent.end());
    for (uint64_t e = 0; e < Product(extent); ++e) {
      std::vector<uint64_t> i = Unflat(e, extent);
      uint64_t element = 0, pos = box.base_offset;
      std::vector<uint64_t> real_index(rank);
      for (size_t d = 0; d < rank; ++d) {
        real_index[d] = box.offset[d] + i[d];
        pos += i[d] * box.strides[d] * itemsize;
      }
      element = rank == 1 ? real_index[0] : Flat(real_index, c.real);
      BOOST_REQUIRE_MESSAGE(placed.emplace(element, pos).second, "element placed twice");
    }
  }
  BOOST_REQUIRE_EQUAL(placed.size(), Product(c.real));
  for (const auto& [element, pos] : placed) {
    const std::vector<uint64_t> r = Unflat(element, c.real);
    std::vector<uint64_t> g(r.size()), i(r.size());
    for (size_t d = 0; d < r.size(); ++d) g[d] = r[d] / chunk[d], i[d] = r[d] % chunk[d];
    BOOST_REQUIRE_EQUAL(pos, (stored[{Flat(g, c.grid), Flat(i, chunk)}]));
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(megatron_fragments_placed_in_the_real_shape) {
  const std::vector<Case> cases = {
      {{7}, {1}, true},                 // a 1-D parameter, unsplit
      {{6}, {2}, true},                 // split 1-D
      {{4, 5}, {1, 1}, true},           // the whole parameter one chunk: a reshape
      {{4, 6}, {2, 1}, true},           // column-parallel (dim 0)
      {{4, 6}, {1, 2}, false},          // row-parallel (dim 1): chunks apart in the full tensor
      {{4, 6}, {2, 3}, false},          // both
      {{3, 4, 6}, {3, 2, 1}, true},     // stacked layers (a prepended axis) + dim-0 split
      {{3, 4, 6}, {3, 1, 2}, false},    // stacked layers + dim-1 split
      {{1, 4, 6}, {1, 1, 3}, false},
      {{3, 1, 6}, {3, 1, 2}, true},     // a dimension of size 1 between splits
      {{2, 3, 2, 2}, {1, 3, 1, 1}, false},
  };
  for (const Case& c : cases) {
    uint64_t n = 1;
    for (size_t d = 0; d < c.real.size(); ++d) n *= c.real[d] / c.grid[d];
    // Every set of cut points of a chunk of up to 12 elements; a sample of the larger ones.
    const uint64_t subsets = n <= 12 ? (uint64_t{1} << (n - 1)) : 600;
    for (uint64_t mask = 0; mask < subsets; ++mask) {
      const uint64_t bits = n <= 12 ? mask : mask * 2654435761u;
      std::vector<uint64_t> cuts;
      for (uint64_t k = 1; k < n; ++k)
        if ((bits >> ((k - 1) % 63)) & 1 && (n <= 12 || (k * 7 + mask) % 5 == 0)) cuts.push_back(k);
      CheckCuts(c, cuts);
    }
  }
}

BOOST_AUTO_TEST_CASE(megatron_reformulation_that_does_not_fit_is_refused) {
  ckptfs::MegatronReformulation plan;
  std::string why;
  using V = std::vector<uint64_t>;
  BOOST_TEST(!ckptfs::PlanMegatronReformulation(V{16, 16}, V{1, 1, 255}, &plan, &why));
  BOOST_TEST(why.find("holds 256 elements") != std::string::npos, why);
  BOOST_TEST(!ckptfs::PlanMegatronReformulation(V{16, 17}, V{1, 2, 136}, &plan, &why));
  BOOST_TEST(why.find("not split into 2 equal chunks") != std::string::npos, why);
  BOOST_TEST(!ckptfs::PlanMegatronReformulation(V{16, 16}, V{1, 256}, &plan, &why));
  BOOST_TEST(!ckptfs::PlanMegatronReformulation(V{}, V{1}, &plan, &why));
  BOOST_TEST(!ckptfs::PlanMegatronReformulation(V{16, 16}, V{0, 1, 256}, &plan, &why));
  BOOST_TEST(!ckptfs::PlanMegatronReformulation(V{uint64_t{1} << 40, uint64_t{1} << 40}, V{1, 1, 0}, &plan, &why));
  BOOST_REQUIRE(ckptfs::PlanMegatronReformulation(V{4, 6}, V{1, 2, 12}, &plan, &why));
  ckptfs::BoxList boxes;
  // Spanning two chunks, or past the chunk's end, or off the grid.
  BOOST_TEST(!ckptfs::PlaceMegatronFragment(plan, V{0, 0, 0}, V{1, 2, 12}, 0, 0, 4, &boxes, &why));
  BOOST_TEST(!ckptfs::PlaceMegatronFragment(plan, V{0, 1, 6}, V{1, 1, 7}, 0, 0, 4, &boxes, &why));
  BOOST_TEST(!ckptfs::PlaceMegatronFragment(plan, V{0, 2, 0}, V{1, 1, 1}, 0, 0, 4, &boxes, &why));
  BOOST_TEST(!ckptfs::PlaceMegatronFragment(plan, V{0, 0, 0}, V{1, 1, 1}, 0, ~uint64_t{0}, 4, &boxes, &why));
  BOOST_TEST(boxes.empty());
}

namespace {

// A catalog of tensors with these keys (shapes [rows, 8]) and a model description of this
// configuration (none for null).
Catalog WithTensors(const std::vector<std::pair<std::string, uint64_t>>& keys, nlohmann::json config) {
  Catalog c;
  for (const auto& [key, rows] : keys) {
    TensorEntry t;
    t.key = key;
    t.shape = {rows, 8};
    c.tensors.push_back(std::move(t));
  }
  if (!config.is_null()) {
    c.model.emplace();
    c.model->source = "the test's config";
    for (const auto& [name, value] : config.items()) c.model->SetFromConfig(name, value);
  }
  return c;
}

}  // namespace

BOOST_AUTO_TEST_CASE(megatron_tensor_facts_fill_what_the_config_leaves_unsaid) {
  // Per-layer keys under NeMo's module. prefix; q/k norms, no biases, SwiGLU rows, tied.
  Catalog c = WithTensors({{"module.decoder.layers.0.self_attention.linear_qkv.weight", 48},
                           {"module.decoder.layers.0.self_attention.k_layernorm.weight", 8},
                           {"module.decoder.layers.0.self_attention.linear_proj.weight", 32},
                           {"module.decoder.layers.0.mlp.linear_fc1.weight", 128},
                           {"module.embedding.word_embeddings.weight", 100}},
                          {{"ffn_hidden_size", 64}, {"add_bias_linear", nullptr}});
  ckptfs::AddMegatronTensorFacts(&c);
  const nlohmann::json config = c.model->Config();
  BOOST_TEST(config["qk_layernorm"] == true);
  BOOST_TEST(config["add_bias_linear"] == false);  // null counts as unset
  BOOST_TEST(config["add_qkv_bias"] == false);
  BOOST_TEST(config["swiglu"] == true);
  BOOST_TEST(config["untie_embeddings_and_output_weights"] == false);
  BOOST_TEST(!config.contains("moe_router_enable_expert_bias"));  // no router: nothing proved
  size_t from_tensors = 0;
  for (const auto& [name, fact] : c.model->facts) from_tensors += fact.origin == ckptfs::ModelFact::Origin::kTensors;
  BOOST_TEST(from_tensors == 5u);
  BOOST_TEST(c.model->facts.at("qk_layernorm").why ==
             "module.decoder.layers.0.self_attention.k_layernorm.weight is stored");
  BOOST_TEST((c.model->facts.at("ffn_hidden_size").origin == ckptfs::ModelFact::Origin::kConfig));
  BOOST_TEST(c.model->conflicts.empty());
  // metadata.json shows the same description.
  ckptfs::AddModelDescriptionToMetadata(*c.model, &c.metadata);
  BOOST_TEST(c.metadata["model_config"] == config);
  BOOST_TEST(c.metadata["model_config_source"] == "the test's config");
  BOOST_TEST(c.metadata["model_config_from_tensors"].size() == 5u);
  BOOST_TEST(c.metadata["model_config_from_tensors"]["qk_layernorm"] ==
             "module.decoder.layers.0.self_attention.k_layernorm.weight is stored");
  BOOST_TEST(!c.metadata.contains("model_config_conflicts"));
}

BOOST_AUTO_TEST_CASE(megatron_tensor_facts_decide_only_on_evidence) {
  // No attention weights: a missing q/k norm proves nothing. Linear biases: the QKV bias
  // cannot tell add_qkv_bias. An fc1 neither F nor 2F rows long: no SwiGLU answer.
  Catalog c = WithTensors({{"decoder.layers.self_attention.linear_proj.weight", 32},
                           {"decoder.layers.self_attention.linear_proj.bias", 32},
                           {"decoder.layers.self_attention.linear_qkv.bias", 48},
                           {"decoder.layers.mlp.linear_fc1.weight", 96},
                           {"optimizer.state.exp_avg.decoder.layers.self_attention.q_layernorm.weight", 8}},
                          {{"ffn_hidden_size", 64}});
  ckptfs::AddMegatronTensorFacts(&c);
  const nlohmann::json config = c.model->Config();
  BOOST_TEST(config["add_bias_linear"] == true);
  for (const char* undecided : {"qk_layernorm", "add_qkv_bias", "swiglu", "untie_embeddings_and_output_weights"})
    BOOST_TEST(!config.contains(undecided), undecided);
  // Without a model_config there is nothing to complete.
  Catalog bare = WithTensors({{"decoder.layers.self_attention.linear_qkv.weight", 48}}, nullptr);
  ckptfs::AddMegatronTensorFacts(&bare);
  BOOST_TEST(!bare.model.has_value());
}

BOOST_AUTO_TEST_CASE(megatron_tensor_facts_note_a_config_the_tensors_contradict) {
  Catalog c = WithTensors({{"decoder.layers.self_attention.linear_qkv.weight", 48},
                           {"decoder.layers.self_attention.q_layernorm.weight", 8},
                           {"decoder.layers.mlp.router.weight", 4},
                           {"decoder.layers.mlp.router.expert_bias", 4},
                           {"output_layer.weight", 100},
                           {"embedding.word_embeddings.weight", 100}},
                          {{"qk_layernorm", false}, {"moe_router_enable_expert_bias", false},
                           {"untie_embeddings_and_output_weights", false}});
  ckptfs::AddMegatronTensorFacts(&c);
  const auto& conflicts = c.model->conflicts;
  BOOST_TEST(conflicts.size() == 2u);
  BOOST_TEST(conflicts.at("qk_layernorm") ==
             "the config says false, but decoder.layers.self_attention.q_layernorm.weight is stored");
  BOOST_TEST(conflicts.count("moe_router_enable_expert_bias") == 1u);
  // A tied output layer may be stored as a copy: the config's word stands, unchanged.
  BOOST_TEST(c.model->Value("untie_embeddings_and_output_weights") == false);
  BOOST_TEST(c.model->Value("qk_layernorm") == false);
  BOOST_TEST((c.model->facts.at("qk_layernorm").origin == ckptfs::ModelFact::Origin::kConfig));
}
