// libFuzzer target: key maps (src/map/key_map.cpp) over a Megatron GPT catalog whose
// model config comes from a fuzzed run_config.yaml, read as the DCP reader reads it
// (format/megatron/megatron_framework_config.hpp, the YAML subset reader).
//
// Input: 16 control bytes, then the text of run_config.yaml.
//   byte 0   the map: auto, llama, mistral, qwen2, qwen3, mixtral, qwen3_moe
//   byte 1   bit 0 per-layer keys (else layers stacked on a leading axis), bit 1 no output
//            layer (tied), bit 2 QKV biases, bit 3 q/k norms, bit 4 keys prefixed "module."
//            (NeMo 2), bit 5 served as bf16
//   2..9     layers, query groups, heads per group, head dim, hidden, ffn, padded vocab rows,
//            experts (0: a dense MLP), each small
// The catalog's tensors are row-major ranges of one file whose float32 element k holds k, so
// every served element names the source element it came from.
// Invariants: a view the map accepts reads back whole and short only at the end; and where a
// dense map (llama, mistral, qwen2, qwen3) accepts, every served tensor holds exactly the
// source elements its Hugging Face meaning selects under the parameters the map records in
// manifest.json (the query-group split of the fused QKV, gate and up of fc1, one layer of a
// stacked tensor, the vocabulary rows kept): never a wrong tensor, whatever the config says.
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/view.hpp"
#include "format/megatron/megatron_framework_config.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;

namespace {

constexpr size_t kControl = 16;
constexpr const char* kMaps[] = {"auto", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"};
constexpr const char* kFolder = "/fuzz/ckpt";

struct Shapes {
  uint64_t layers, groups, per_group, head_dim, hidden, ffn, vocab, experts;
  bool per_layer, tied, qkv_bias, qk_norm;
  std::string prefix;
};

// The source tensors, each a run of the one file from element `first`.
struct Source {
  std::map<std::string, std::pair<uint64_t, Shape>> tensors;  // key -> (first element, shape)
  uint64_t elements = 0;
  void Add(const std::string& key, Shape shape) {
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    tensors[key] = {elements, shape};
    elements += n;
  }
};

Source Megatron(const Shapes& s) {
  Source src;
  const uint64_t rows = s.groups * (s.per_group + 2) * s.head_dim, q_width = s.groups * s.per_group * s.head_dim;
  auto layered = [&](const std::string& name, Shape shape) {
    if (!s.per_layer) {
      shape.insert(shape.begin(), s.layers);
      src.Add(s.prefix + "decoder.layers." + name, shape);
      return;
    }
    for (uint64_t l = 0; l < s.layers; ++l) src.Add(s.prefix + "decoder.layers." + std::to_string(l) + "." + name, shape);
  };
  src.Add(s.prefix + "embedding.word_embeddings.weight", {s.vocab, s.hidden});
  layered("self_attention.linear_qkv.layer_norm_weight", {s.hidden});
  layered("self_attention.linear_qkv.weight", {rows, s.hidden});
  if (s.qkv_bias) layered("self_attention.linear_qkv.bias", {rows});
  if (s.qk_norm) {
    layered("self_attention.q_layernorm.weight", {s.head_dim});
    layered("self_attention.k_layernorm.weight", {s.head_dim});
  }
  layered("self_attention.linear_proj.weight", {s.hidden, q_width});
  if (s.experts == 0) {
    layered("mlp.linear_fc1.layer_norm_weight", {s.hidden});
    layered("mlp.linear_fc1.weight", {2 * s.ffn, s.hidden});
    layered("mlp.linear_fc2.weight", {s.hidden, s.ffn});
  } else {
    layered("pre_mlp_layernorm.weight", {s.hidden});
    layered("mlp.router.weight", {s.experts, s.hidden});
    layered("mlp.experts.experts.linear_fc1.weight", {s.experts, 2 * s.ffn, s.hidden});
    layered("mlp.experts.experts.linear_fc2.weight", {s.experts, s.hidden, s.ffn});
  }
  src.Add(s.prefix + "decoder.final_layernorm.weight", {s.hidden});
  if (!s.tied) src.Add(s.prefix + "output_layer.weight", {s.vocab, s.hidden});
  return src;
}

uint64_t Param(const nlohmann::json& params, const char* name) {
  const nlohmann::json v = params.value(name, nlohmann::json());
  FUZZ_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0));
  return v.get<uint64_t>();
}

// The source element (its value) expected at row-major position `at` of served tensor `key`,
// of shape `shape`, under the parameters the map used; false when the key is not one a dense
// Llama-family map serves.
bool Expected(const Source& src, const Shapes& s, const nlohmann::json& params, std::string_view key,
              const Shape& shape, uint64_t at, uint64_t* value) {
  const uint64_t cols = shape.size() == 2 ? shape[1] : 1;
  const uint64_t r = at / cols, c = at % cols;
  // The element (row, col) of layer l of the source tensor `name` (stacked or per layer); a
  // source the checkpoint lacks is a key the map should not have served.
  bool missing = false;
  auto find = [&](const std::string& key) -> const std::pair<uint64_t, Shape>* {
    auto it = src.tensors.find(key);
    if (it == src.tensors.end()) missing = true;
    return it == src.tensors.end() ? nullptr : &it->second;
  };
  auto of_layer = [&](uint64_t l, const std::string& name, uint64_t row, uint64_t col, uint64_t width) -> uint64_t {
    const auto* t = find(s.prefix + "decoder.layers." + (s.per_layer ? std::to_string(l) + "." : "") + name);
    if (!t) return 0;
    uint64_t per_layer = 1;
    for (size_t d = s.per_layer ? 0 : 1; d < t->second.size(); ++d) per_layer *= t->second[d];
    return t->first + (s.per_layer ? 0 : l * per_layer) + row * width + col;
  };
  auto whole = [&](const std::string& name, uint64_t row, uint64_t col, uint64_t width) -> uint64_t {
    const auto* t = find(s.prefix + name);
    return t ? t->first + row * width + col : 0;
  };
  const uint64_t hidden = s.hidden;
  if (key == "model.embed_tokens.weight") return *value = whole("embedding.word_embeddings.weight", r, c, hidden), !missing;
  if (key == "lm_head.weight") return *value = whole("output_layer.weight", r, c, hidden), !missing;
  if (key == "model.norm.weight") return *value = whole("decoder.final_layernorm.weight", 0, at, 0), !missing;
  if (key.rfind("model.layers.", 0) != 0) return false;
  size_t end = 13;
  uint64_t l = 0;
  while (end < key.size() && end < 17 && key[end] >= '0' && key[end] <= '9') l = l * 10 + (key[end++] - '0');
  if (end == 13 || end >= key.size() || key[end] != '.') return false;
  const std::string rest(key.substr(end + 1));
  const uint64_t groups = Param(params, "groups"), hpg = Param(params, "heads_per_group"),
                 head_dim = Param(params, "head_dim");
  const uint64_t group_rows = (hpg + 2) * head_dim;
  // Row `row` of q (part 0), k (1) or v (2) as a row of the fused QKV.
  auto qkv_row = [&](int part, uint64_t row) {
    if (part == 0) return row / (hpg * head_dim) * group_rows + row % (hpg * head_dim);
    return row / head_dim * group_rows + (hpg + part - 1) * head_dim + row % head_dim;
  };
  const uint64_t rows = s.groups * (s.per_group + 2) * s.head_dim;
  FUZZ_CHECK(groups * group_rows == rows);  // the parameters agree with the tensor they split
  static const char* kParts[] = {"q", "k", "v"};
  for (int part = 0; part < 3; ++part) {
    const std::string p = std::string("self_attn.") + kParts[part] + "_proj.";
    if (rest == p + "weight") return *value = of_layer(l, "self_attention.linear_qkv.weight", qkv_row(part, r), c, hidden), !missing;
    if (rest == p + "bias") return *value = of_layer(l, "self_attention.linear_qkv.bias", 0, qkv_row(part, at), 0), !missing;
  }
  const uint64_t ffn = s.ffn;
  if (rest == "self_attn.o_proj.weight")
    return *value = of_layer(l, "self_attention.linear_proj.weight", r, c, s.groups * s.per_group * s.head_dim), !missing;
  if (rest == "self_attn.q_norm.weight") return *value = of_layer(l, "self_attention.q_layernorm.weight", 0, at, 0), !missing;
  if (rest == "self_attn.k_norm.weight") return *value = of_layer(l, "self_attention.k_layernorm.weight", 0, at, 0), !missing;
  if (rest == "input_layernorm.weight")
    return *value = of_layer(l, "self_attention.linear_qkv.layer_norm_weight", 0, at, 0), !missing;
  if (rest == "post_attention_layernorm.weight")
    return *value = of_layer(l, "mlp.linear_fc1.layer_norm_weight", 0, at, 0), !missing;
  if (rest == "mlp.gate_proj.weight") return *value = of_layer(l, "mlp.linear_fc1.weight", r, c, hidden), !missing;
  if (rest == "mlp.up_proj.weight") return *value = of_layer(l, "mlp.linear_fc1.weight", ffn + r, c, hidden), !missing;
  if (rest == "mlp.down_proj.weight") return *value = of_layer(l, "mlp.linear_fc2.weight", r, c, ffn), !missing;
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kControl) return 0;
  const uint8_t* b = data;
  Shapes s;
  s.per_layer = b[1] & 1;
  s.tied = b[1] & 2;
  s.qkv_bias = b[1] & 4;
  s.qk_norm = b[1] & 8;
  s.prefix = (b[1] & 16) ? "module." : "";
  s.layers = 1 + b[2] % 4;
  s.groups = 1 + b[3] % 3;
  s.per_group = 1 + b[4] % 3;
  s.head_dim = 1 + b[5] % 4;
  s.hidden = 1 + b[6] % 8;
  s.ffn = 1 + b[7] % 6;
  s.vocab = 1 + b[8] % 12;
  s.experts = b[9] % 4;
  const std::string map = kMaps[b[0] % 7];

  static std::shared_ptr<MemoryEnv> env = std::make_shared<MemoryEnv>();
  const std::string yaml_path = std::string(kFolder) + "/run_config.yaml";
  FUZZ_CHECK(env->WriteFile(yaml_path, std::string(reinterpret_cast<const char*>(data + kControl), size - kControl)).ok());
  const Source src = Megatron(s);
  std::string bytes(src.elements * 4, '\0');
  for (uint64_t k = 0; k < src.elements; ++k) {
    const float v = static_cast<float>(k);
    std::memcpy(&bytes[k * 4], &v, 4);
  }
  const std::string data_path = std::string(kFolder) + "/__0_0.distcp";
  FUZZ_CHECK(env->WriteFile(data_path, bytes).ok());

  auto catalog = std::make_shared<Catalog>();
  catalog->format = "dcp";
  catalog->source = kFolder;
  catalog->files = std::make_shared<SourceFiles>(env);
  uint32_t file = 0;
  FUZZ_CHECK(catalog->files->Add(data_path, &file).ok());
  for (const auto& [key, at] : src.tensors) {
    TensorEntry t;
    t.key = key;
    t.path = {key};
    t.dtype = DType::kF32;
    t.shape = at.second;
    uint64_t n = 1;
    for (uint64_t d : at.second) n *= d;
    t.boxes = {Box::Range(file, at.first * 4, 0, n)};
    catalog->tensors.push_back(std::move(t));
  }
  std::string framework;
  ckptfs::ModelDescription model;
  Status read = AddFrameworkModelConfig(*env, kFolder, kFolder, &model, &framework);
  FUZZ_CHECK(read.ok());  // a config that cannot be read is recorded, not an error of the tensors
  catalog->model = std::move(model);
  ckptfs_fuzz::CheckCatalog(*catalog);

  ViewOptions options;
  options.map = map;
  if (b[1] & 32) options.dtype = DType::kBF16;
  std::unique_ptr<View> view;
  const Status built = View::Build(catalog, options, &view);
  if (!built.ok()) {
    FUZZ_CHECK(!built.message().empty() && built.message().find('\n') == std::string::npos);  // one line
    return 0;
  }
  const ServedTensors& served = view->served();
  const nlohmann::json& record = served.manifest_fields().value("map", nlohmann::json::object());
  const std::string used = record.value("name", "");
  const bool dense = used == "llama" || used == "mistral" || used == "qwen2" || used == "qwen3";
  const nlohmann::json params = record.value("parameters", nlohmann::json::object());
  std::vector<char> buf;
  for (size_t i = 0; i < served.size(); ++i) {
    const ServedTensor t = served[i];
    const View::NodeId id = view->TensorFile(i);
    const uint64_t file_size = view->node(id).size;
    FUZZ_CHECK(file_size >= t.nbytes() + 8);
    buf.assign(file_size + 8, '\0');
    size_t nread = 0;
    FUZZ_CHECK(view->Read(id, 0, buf.size(), buf.data(), &nread).ok() && nread == file_size);
    if (!dense || options.dtype) continue;
    const uint64_t begin = file_size - t.nbytes();  // the data end the file
    const uint64_t count = t.nbytes() / 4;
    for (uint64_t e = 0; e < count; ++e) {
      float v = 0;
      std::memcpy(&v, buf.data() + begin + e * 4, 4);
      uint64_t expected = 0;
      const bool known = Expected(src, s, params, t.key(), t.shape(), e, &expected);
      if (!known) std::fprintf(stderr, "map %s serves an unexpected key '%s'\n", used.c_str(), std::string(t.key()).c_str());
      FUZZ_CHECK(known);
      if (static_cast<uint64_t>(v) != expected)
        std::fprintf(stderr, "map %s: '%s' element %llu holds source element %llu, expected %llu\n", used.c_str(),
                     std::string(t.key()).c_str(), static_cast<unsigned long long>(e), static_cast<unsigned long long>(v),
                     static_cast<unsigned long long>(expected));
      FUZZ_CHECK(static_cast<uint64_t>(v) == expected);
    }
  }
  return 0;
}
