// The safetensors header parser, validating headers the way the reference implementation
// does (huggingface/safetensors safetensors/src/tensor.rs `read_metadata`, `validate`;
// the rules are listed in doc/FORMATS.md, "safetensors layout").
#include "codec/safetensors_header.hpp"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "codec/byte_reader.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

bool AsUint(const json& j, uint64_t* out) {
  if (!j.is_number_unsigned()) return false;
  *out = j.get<uint64_t>();
  return true;
}

// What one top-level entry of the header says, checked by the rules of doc/FORMATS.md: an
// error message for the entry, or empty.
std::string CheckMetadata(const json& value) {
  if (!value.is_object()) return "__metadata__ is not an object";
  for (const auto& [key, v] : value.items())
    if (!v.is_string()) return "__metadata__ value of '" + key + "' is not a string";
  return {};
}

std::string CheckTensorEntry(const std::string& key, const json& value, SafetensorsTensor* p) {
  if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets"))
    return "tensor '" + key + "' lacks dtype, shape or data_offsets";
  const json& dt = value["dtype"];
  auto dtype = dt.is_string() ? DTypeFromSafetensorsName(dt.get<std::string>()) : std::nullopt;
  if (!dtype) return "tensor '" + key + "' has an unknown dtype " + dt.dump();
  p->dtype = *dtype;
  const json& shape = value["shape"];
  const json& offsets = value["data_offsets"];
  if (!shape.is_array()) return "tensor '" + key + "' has a malformed shape";
  uint64_t numel = 1;
  for (const json& d : shape) {
    uint64_t dim;
    if (!AsUint(d, &dim)) return "tensor '" + key + "' has a malformed shape";
    if (!CheckedMul(numel, dim, &numel)) return "tensor '" + key + "' shape overflows";
    p->shape.push_back(dim);
  }
  if (p->dtype == DType::kF4x2) {
    // Two values a byte: the last dimension counts values, an odd count cannot be stored.
    if (p->shape.empty() || p->shape.back() % kF4ValuesPerByte != 0)
      return "tensor '" + key + "' of dtype F4 needs an even last dimension";
    p->shape.back() /= kF4ValuesPerByte;
    numel /= kF4ValuesPerByte;
  }
  uint64_t begin, end;
  if (!offsets.is_array() || offsets.size() != 2 || !AsUint(offsets[0], &begin) || !AsUint(offsets[1], &end) ||
      end < begin)
    return "tensor '" + key + "' has malformed data_offsets";
  uint64_t nbytes;
  if (!CheckedMul(numel, Info(p->dtype).itemsize, &nbytes)) return "tensor '" + key + "' size overflows";
  if (end - begin != nbytes)
    return "tensor '" + key + "' spans " + std::to_string(end - begin) + " bytes but its dtype and shape need " +
           std::to_string(nbytes);
  p->data_offset = begin;  // made absolute by the caller, once the spans are checked
  p->nbytes = nbytes;
  return {};
}

// Reads the header in one SAX pass without a DOM of the whole: each top-level entry's value is
// built as a small DOM of its own, checked (CheckTensorEntry, CheckMetadata) and dropped when it
// closes. A DOM of a million-tensor header would cost ~700 bytes per tensor (950 MB peak for
// `ckptfs ls`), and its build and teardown would be most of the parse.
//
// Refused, as the reference parser (serde) does not define them: a key that one object holds
// twice (parsers disagree on which one wins). Nested objects find theirs as their DOM is built
// (the map insertion says whether a key is new); top-level keys are checked at the end by
// sorting their hashes. The first repeated key in document order is reported, and only once
// the whole text is found to be JSON; then the entry count limit; then the entry errors, the
// first by key order (what a check of the entries in a sorted map finds first).
class HeaderReader : public json::json_sax_t {
 public:
  bool null() override { return Put(nullptr); }
  bool boolean(bool v) override { return Put(v); }
  bool number_integer(json::number_integer_t v) override { return Put(v); }
  bool number_unsigned(json::number_unsigned_t v) override { return Put(v); }
  bool number_float(json::number_float_t v, const json::string_t&) override { return Put(v); }
  bool string(json::string_t& v) override { return Put(std::move(v)); }
  bool binary(json::binary_t& v) override { return Put(json::binary(std::move(v))); }
  bool start_object(std::size_t) override {
    if (depth_ == 0) {  // the header itself: its entries are taken one by one
      depth_ = 1;
      return true;
    }
    return Open(json::object());
  }
  bool key(json::string_t& key) override {
    const uint64_t seq = keys_seen_++;
    if (open_.empty()) {  // a top-level key: an entry starts
      top_keys_.push_back({std::hash<std::string>{}(key), seq, static_cast<uint32_t>(keys_.size())});
      keys_.push_back(std::move(key));
      entry_ = nullptr;
      slot_ = &entry_;
      return true;
    }
    auto [it, inserted] = open_.back()->get_ref<json::object_t&>().emplace(std::move(key), nullptr);
    if (inserted) {
      slot_ = &it->second;
    } else {
      NoteRepeated(it->first, seq);
      slot_ = &dropped_.emplace_back();
    }
    return true;
  }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override {
    if (depth_ == 0) return not_object_ = true, false;  // no need to read on: not an object
    return Open(json::array());
  }
  bool end_array() override { return Close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

  // After a successful parse: whether the header was an object, and what it held.
  bool was_object() const { return depth_ == 1 && !not_object_ && open_.empty(); }
  // The first key held twice by one object, in document order; empty when none.
  std::string Repeated() {
    std::sort(top_keys_.begin(), top_keys_.end(),
              [](const TopKey& a, const TopKey& b) { return std::tie(a.hash, a.seq) < std::tie(b.hash, b.seq); });
    for (size_t i = 0; i < top_keys_.size();) {
      size_t j = i + 1;
      while (j < top_keys_.size() && top_keys_[j].hash == top_keys_[i].hash) ++j;
      if (j - i > 1) {
        // One key, or keys whose hashes collide (a crafted header can make many collide): by
        // key, then place, so that equal keys sit side by side in document order.
        auto by_key = [this](const TopKey& a, const TopKey& b) {
          const int order = keys_[a.index].compare(keys_[b.index]);
          return order != 0 ? order < 0 : a.seq < b.seq;
        };
        std::sort(top_keys_.begin() + i, top_keys_.begin() + j, by_key);
        for (size_t k = i + 1; k < j; ++k)
          if (keys_[top_keys_[k - 1].index] == keys_[top_keys_[k].index])
            NoteRepeated(keys_[top_keys_[k].index], top_keys_[k].seq);
      }
      i = j;
    }
    return repeated_;
  }
  size_t entries() const { return keys_.size(); }
  // The tensors that passed their checks, in document order, their keys moved in.
  std::vector<SafetensorsTensor> TakeTensors() {
    for (size_t i = 0; i < tensors_.size(); ++i) tensors_[i].key = std::move(keys_[tensor_keys_[i]]);
    return std::move(tensors_);
  }
  json& metadata() { return metadata_; }
  // The entry error that comes first by key (empty when none).
  const std::string& error() const { return error_; }

 private:
  struct TopKey {
    uint64_t hash;
    uint64_t seq;     // place among all keys of the header, in document order
    uint32_t index;   // in keys_
  };

  void NoteRepeated(const std::string& key, uint64_t seq) {
    if (repeated_seq_ <= seq) return;
    repeated_seq_ = seq;
    repeated_ = key;
  }
  // Where a value goes: the entry being read, the end of the open array, or the slot of the
  // last key.
  json* Place(json&& value) {
    if (!open_.empty() && open_.back()->is_array()) {
      auto& items = open_.back()->get_ref<json::array_t&>();
      items.push_back(std::move(value));
      return &items.back();  // later pushes go into this child until it closes
    }
    *slot_ = std::move(value);
    return slot_;
  }
  bool Put(json&& value) {
    if (depth_ == 0) return not_object_ = true, false;
    Place(std::move(value));
    if (open_.empty()) TakeEntry();  // a scalar entry
    return true;
  }
  bool Open(json&& container) {
    open_.push_back(Place(std::move(container)));
    return true;
  }
  bool Close() {
    if (open_.empty()) return true;  // the header's own closing brace
    open_.pop_back();
    if (open_.empty()) TakeEntry();
    return true;
  }
  void TakeEntry() {
    const uint32_t index = static_cast<uint32_t>(keys_.size() - 1);
    const std::string& key = keys_[index];
    std::string problem;
    if (key == "__metadata__") {
      problem = CheckMetadata(entry_);
      if (problem.empty()) metadata_ = std::move(entry_);
    } else {
      SafetensorsTensor p;
      problem = CheckTensorEntry(key, entry_, &p);
      if (problem.empty()) {
        tensors_.push_back(std::move(p));
        tensor_keys_.push_back(index);
      }
    }
    if (!problem.empty() && (error_.empty() || key < error_key_)) {
      error_ = std::move(problem);
      error_key_ = key;
    }
    entry_ = nullptr;
    dropped_.clear();
  }

  int depth_ = 0;                 // 0: before the header's opening brace; 1: inside it
  bool not_object_ = false;
  json entry_;                    // the value of the top-level entry being read
  std::vector<json*> open_;       // containers of that value not yet closed, innermost last
  json* slot_ = nullptr;          // where the value of the key just read goes
  std::deque<json> dropped_;      // values of repeated keys (stable addresses)
  uint64_t keys_seen_ = 0;
  std::vector<std::string> keys_;  // the top-level keys, in document order
  std::vector<TopKey> top_keys_;
  std::vector<SafetensorsTensor> tensors_;  // keys left empty until TakeTensors
  std::vector<uint32_t> tensor_keys_;       // index of each one's key in keys_
  json metadata_ = json::object();
  std::string error_, error_key_;
  uint64_t repeated_seq_ = UINT64_MAX;
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
                                      std::to_string(limits.header_bytes) + " bytes").WithLimitOption("max_header");
  if (header_len > size - 8) return bad("header length " + std::to_string(header_len) + " runs past the end of the file");
  std::string header(header_len, '\0');
  CKPTFS_RETURN_IF_ERROR(files.ReadExact(window.file, window.base + 8, header_len, header.data()));
  HeaderReader reader;
  if (!json::sax_parse(header, &reader) || !reader.was_object()) return bad("header is not a JSON object");
  std::string().swap(header);
  // JSON parsers disagree on a repeated key (nlohmann and Python keep the last one, others the
  // first), so a header naming a tensor twice means different tensors to different loaders:
  // refuse it.
  if (std::string repeated = reader.Repeated(); !repeated.empty())
    return bad("key '" + repeated + "' appears twice in the header");
  if (reader.entries() > limits.tensors + 1)  // + __metadata__
    return Status::Refused(where, "safetensors: header lists " + std::to_string(reader.entries()) +
                                      " entries, over the limit of " + std::to_string(limits.tensors) + " tensors")
                                          .WithLimitOption("max_tensors");
  if (!reader.error().empty()) return bad(reader.error());

  std::vector<SafetensorsTensor> tensors = reader.TakeTensors();
  out->metadata = std::move(reader.metadata());

  // Sorted by offsets, tensors must tile the byte buffer exactly: no gaps, no overlaps,
  // nothing after the last one. Keys break ties, so that an overlap is named alike whatever
  // the header's order.
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return std::tie(a.data_offset, a.nbytes, a.key) < std::tie(b.data_offset, b.nbytes, b.key);
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
  out->data_start = data_start;
  return Status::OK();
}

}  // namespace ckptfs
