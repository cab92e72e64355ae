#include "view/safetensors_header.hpp"

#include <cstdio>

namespace ckptfs {

void ServedDTypeAndShape(const TensorEntry& t, std::string_view* dtype, std::vector<uint64_t>* shape) {
  ServedType served = ServedAs(t.dtype);
  *dtype = Info(served.dtype).safetensors_name;
  *shape = t.shape;
  if (served.extra_dim) shape->push_back(2);
}

void AppendJsonString(std::string* out, std::string_view s) {
  out->push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          *out += buf;
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

std::string SafetensorsHeader(const std::vector<HeaderEntry>& entries) {
  std::string json = R"({"__metadata__":{"format":"pt"})";
  for (const HeaderEntry& e : entries) {
    json += ',';
    AppendJsonString(&json, e.key);
    json += R"(:{"dtype":")";
    json += e.dtype;
    json += R"(","shape":[)";
    for (size_t i = 0; i < e.shape.size(); ++i) {
      if (i) json += ',';
      json += std::to_string(e.shape[i]);
    }
    json += R"(],"data_offsets":[)";
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

}  // namespace ckptfs
