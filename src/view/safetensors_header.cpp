#include "view/safetensors_header.hpp"

#include "io/json_text.hpp"

namespace ckptfs {

void ServedDTypeAndShape(const TensorEntry& t, std::string_view* dtype, std::vector<uint64_t>* shape) {
  ServedType served = ServedAs(t.served_dtype());
  *dtype = Info(served.dtype).safetensors_name;
  *shape = t.shape;
  if (served.extra_dim) shape->push_back(2);
}

std::string SafetensorsHeader(const std::vector<HeaderEntry>& entries) {
  std::string json = R"({"__metadata__":{"format":"pt"})";
  for (const HeaderEntry& e : entries) {
    json += ',';
    AppendJsonString(&json, e.key);
    json += R"(:{"dtype":")";
    json += e.dtype;
    json += R"(","shape":)";
    AppendJsonArray(&json, e.shape);
    json += R"(,"data_offsets":[)";
    json += std::to_string(e.begin);
    json += ',';
    json += std::to_string(e.end);
    json += "]}";
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out += json;
  return out;
}

std::string TensorFileHeader(const TensorEntry& t) {
  HeaderEntry e;
  e.key = t.key;
  ServedDTypeAndShape(t, &e.dtype, &e.shape);
  e.end = t.served_nbytes();
  return SafetensorsHeader({e});
}

}  // namespace ckptfs
