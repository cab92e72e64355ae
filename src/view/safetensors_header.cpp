#include "view/safetensors_header.hpp"

#include "io/json_text.hpp"

namespace ckptfs {

void ServedDTypeAndShape(const ServedTensor& t, std::string_view* dtype, std::vector<uint64_t>* shape) {
  ServedType served = ServedAs(t.dtype);
  *dtype = Info(served.dtype).safetensors_name;
  *shape = t.shape();
  if (served.extra_dim) shape->push_back(2);
  if (served.dtype == DType::kF4x2 && !shape->empty()) shape->back() *= kF4ValuesPerByte;
}

void AppendSafetensorsHeaderStart(std::string* out) {
  out->append(kSafetensorsHeaderStart, kSafetensorsHeaderStartSize);
}

void AppendSafetensorsHeaderEntry(const HeaderEntry& e, std::string* out) {
  *out += ',';
  AppendJsonString(out, e.key);
  *out += R"(:{"dtype":")";
  *out += e.dtype;
  *out += R"(","shape":)";
  AppendJsonArray(out, e.shape);
  *out += R"(,"data_offsets":[)";
  AppendDecimal(out, e.begin);
  *out += ',';
  AppendDecimal(out, e.end);
  *out += "]}";
}

void AppendSafetensorsHeaderEnd(size_t start, std::string* out) {
  *out += '}';
  const uint64_t n = out->size() - start - 8;
  out->append((8 - n % 8) % 8, ' ');
  const uint64_t padded = out->size() - start - 8;
  for (int i = 0; i < 8; ++i) (*out)[start + i] = static_cast<char>((padded >> (8 * i)) & 0xFF);
}

void AppendSafetensorsHeader(const HeaderEntry* entries, size_t count, std::string* out) {
  const size_t start = out->size();
  AppendSafetensorsHeaderStart(out);
  for (size_t k = 0; k < count; ++k) AppendSafetensorsHeaderEntry(entries[k], out);
  AppendSafetensorsHeaderEnd(start, out);
}

std::string SafetensorsHeader(const std::vector<HeaderEntry>& entries) {
  std::string out;
  AppendSafetensorsHeader(entries.data(), entries.size(), &out);
  return out;
}

void AppendTensorFileHeader(const ServedTensor& t, std::string* out) {
  HeaderEntry e;
  e.key = t.key();
  ServedDTypeAndShape(t, &e.dtype, &e.shape);
  e.end = t.nbytes();
  AppendSafetensorsHeader(&e, 1, out);
}

}  // namespace ckptfs
