// Reader for safetensors files, validating headers the way the reference implementation
// does (huggingface/safetensors safetensors/src/tensor.rs `read_metadata`, `validate`;
// the rules are listed in doc/FORMATS.md, "safetensors layout").
#include <algorithm>
#include <deque>
#include <string>
#include <vector>

#include "format/byte_reader.hpp"
#include "format/limit_hint.hpp"
#include "format/readers.hpp"
#include "format/safetensors_header.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

bool AsUint(const json& j, uint64_t* out) {
  if (!j.is_number_unsigned()) return false;
  *out = j.get<uint64_t>();
  return true;
}

// Builds the header's DOM in one SAX pass and notes the first key that one JSON object holds
// twice. json::parse keeps the last of a repeated key silently; a second SAX pass with a key
// set per object found them but cost another tokenization and a hash per key, and nlohmann's
// parse callback rescans an object's members each time a nested object ends (quadratic: 18 s
// for a header of 70,000 tensors). Here the map insertion that builds each object says
// whether its key was new. A repeated key's value is parsed into a slot of its own and
// dropped, so that the whole text is still checked to be JSON.
class HeaderDomBuilder : public json::json_sax_t {
 public:
  bool null() override { return Put(nullptr); }
  bool boolean(bool v) override { return Put(v); }
  bool number_integer(json::number_integer_t v) override { return Put(v); }
  bool number_unsigned(json::number_unsigned_t v) override { return Put(v); }
  bool number_float(json::number_float_t v, const json::string_t&) override { return Put(v); }
  bool string(json::string_t& v) override { return Put(std::move(v)); }
  bool binary(json::binary_t& v) override { return Put(json::binary(std::move(v))); }
  bool start_object(std::size_t) override { return Open(json::object()); }
  bool key(json::string_t& key) override {
    auto [it, inserted] = open_.back()->get_ref<json::object_t&>().emplace(std::move(key), nullptr);
    if (inserted) {
      slot_ = &it->second;
    } else {
      if (repeated_.empty()) repeated_ = it->first;
      slot_ = &dropped_.emplace_back();
    }
    return true;
  }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override { return Open(json::array()); }
  bool end_array() override { return Close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

  json& root() { return root_; }
  const std::string& repeated() const { return repeated_; }

 private:
  // Where a value goes: the root, the end of the open array, or the slot of the last key.
  json* Place(json&& value) {
    if (open_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      auto& items = parent.get_ref<json::array_t&>();
      items.push_back(std::move(value));
      return &items.back();  // later pushes go into this child until it closes
    }
    *slot_ = std::move(value);
    return slot_;
  }
  bool Put(json&& value) {
    Place(std::move(value));
    return true;
  }
  bool Open(json&& container) {
    open_.push_back(Place(std::move(container)));
    return true;
  }
  bool Close() {
    open_.pop_back();
    return true;
  }

  json root_;
  std::vector<json*> open_;       // the objects and arrays not yet closed, innermost last
  json* slot_ = nullptr;          // the value of the key just read
  std::deque<json> dropped_;      // values of repeated keys (stable addresses)
  std::string repeated_;
};

}  // namespace

bool LooksLikeSafetensors(const SourceFiles& files, const FileWindow& window) {
  char head[9];
  if (window.length < 9 || !files.ReadExact(window.file, window.base, 9, head).ok()) return false;
  uint64_t header_len;
  ByteReader(std::string_view(head, 8)).U64(&header_len);
  return header_len <= window.length - 8 && head[8] == '{';
}

Status ParseSafetensorsHeader(const SourceFiles& files, const FileWindow& window, const ReadLimits& limits,
                              SafetensorsHeader* out) {
  const std::string where = files.Describe(window);
  const uint64_t size = window.length;
  auto bad = [&](const std::string& what) { return Status::Corruption(where, "safetensors: " + what); };
  if (size < 8) return bad("file is shorter than its 8-byte header length");
  char len_bytes[8];
  CKPTFS_RETURN_IF_ERROR(files.ReadExact(window.file, window.base, 8, len_bytes));
  uint64_t header_len;
  ByteReader(std::string_view(len_bytes, 8)).U64(&header_len);
  if (header_len > limits.header_bytes)
    return Status::Refused(where, "safetensors: header length " + std::to_string(header_len) + " exceeds the limit of " +
                                      std::to_string(limits.header_bytes) + " bytes" + LimitHint("max_header"));
  if (header_len > size - 8) return bad("header length " + std::to_string(header_len) + " runs past the end of the file");
  std::string header(header_len, '\0');
  CKPTFS_RETURN_IF_ERROR(files.ReadExact(window.file, window.base + 8, header_len, header.data()));
  HeaderDomBuilder builder;
  const bool parsed = json::sax_parse(header, &builder);
  json& doc = builder.root();
  if (!parsed || !doc.is_object()) return bad("header is not a JSON object");
  // JSON parsers disagree on a repeated key (nlohmann and Python keep the last one, others the
  // first), so a header naming a tensor twice means different tensors to different loaders:
  // refuse it.
  if (!builder.repeated().empty()) return bad("key '" + builder.repeated() + "' appears twice in the header");
  if (doc.size() > limits.tensors + 1)  // + __metadata__
    return Status::Refused(where, "safetensors: header lists " + std::to_string(doc.size()) + " entries, over the limit of " +
                                      std::to_string(limits.tensors) + " tensors" + LimitHint("max_tensors"));

  std::vector<SafetensorsTensor> tensors;
  tensors.reserve(doc.size());
  out->metadata = json::object();
  for (auto& [key, value] : doc.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return bad("__metadata__ is not an object");
      for (auto& [mk, mv] : value.items())
        if (!mv.is_string()) return bad("__metadata__ value of '" + mk + "' is not a string");
      out->metadata = value;
      continue;
    }
    SafetensorsTensor p;
    p.key = key;
    uint64_t begin, end;
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets"))
      return bad("tensor '" + key + "' lacks dtype, shape or data_offsets");
    const json& dt = value["dtype"];
    auto dtype = dt.is_string() ? DTypeFromSafetensorsName(dt.get<std::string>()) : std::nullopt;
    if (!dtype) return bad("tensor '" + key + "' has an unknown dtype " + dt.dump());
    p.dtype = *dtype;
    const json& shape = value["shape"];
    const json& offsets = value["data_offsets"];
    if (!shape.is_array()) return bad("tensor '" + key + "' has a malformed shape");
    uint64_t numel = 1;
    for (const json& d : shape) {
      uint64_t dim;
      if (!AsUint(d, &dim)) return bad("tensor '" + key + "' has a malformed shape");
      if (!CheckedMul(numel, dim, &numel)) return bad("tensor '" + key + "' shape overflows");
      p.shape.push_back(dim);
    }
    if (!offsets.is_array() || offsets.size() != 2 || !AsUint(offsets[0], &begin) || !AsUint(offsets[1], &end) ||
        end < begin)
      return bad("tensor '" + key + "' has malformed data_offsets");
    uint64_t nbytes;
    if (!CheckedMul(numel, Info(p.dtype).itemsize, &nbytes)) return bad("tensor '" + key + "' size overflows");
    if (end - begin != nbytes)
      return bad("tensor '" + key + "' spans " + std::to_string(end - begin) + " bytes but its dtype and shape need " +
                 std::to_string(nbytes));
    p.data_offset = begin;  // made absolute below, once the spans are checked
    p.nbytes = nbytes;
    tensors.push_back(std::move(p));
  }

  // Sorted by offsets, tensors must tile the byte buffer exactly: no gaps, no overlaps,
  // nothing after the last one.
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return std::tie(a.data_offset, a.nbytes) < std::tie(b.data_offset, b.nbytes);
  });
  uint64_t expected = 0;
  for (const SafetensorsTensor& p : tensors) {
    if (p.data_offset != expected)
      return bad("tensor '" + p.key + "' starts at " + std::to_string(p.data_offset) +
                 (p.data_offset < expected ? ", overlapping" : ", leaving a gap after") +
                 " the previous tensor (expected " + std::to_string(expected) + ")");
    expected = p.data_offset + p.nbytes;
  }
  const uint64_t data_start = window.base + 8 + header_len;
  if (expected != size - 8 - header_len)
    return bad("tensors cover " + std::to_string(expected) + " bytes but the data buffer holds " +
               std::to_string(size - 8 - header_len));

  for (SafetensorsTensor& p : tensors) p.data_offset += data_start;
  out->tensors = std::move(tensors);
  return Status::OK();
}

Status ReadSafetensorsFile(const std::string& path, Catalog* catalog, json* metadata, const ReadLimits& limits) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  SafetensorsHeader header;
  CKPTFS_RETURN_IF_ERROR(ParseSafetensorsHeader(*catalog->files, catalog->files->whole(file), limits, &header));
  *metadata = std::move(header.metadata);
  for (SafetensorsTensor& p : header.tensors) {
    TensorEntry t;
    t.key = p.key;
    t.path = {p.key};
    t.dtype = p.dtype;
    t.shape = std::move(p.shape);
    if (p.nbytes > 0) t.boxes.push_back(Box::Range(file, p.data_offset, 0, t.numel()));
    catalog->tensors.push_back(std::move(t));
  }
  return Status::OK();
}

}  // namespace ckptfs
