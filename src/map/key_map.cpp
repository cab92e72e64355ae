// The key map engine (key_map.hpp).
#include "map/key_map.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <map>
#include <mutex>
#include <functional>
#include <bit>
#include <set>
#include <unordered_map>

#include "io/checked_math.hpp"
#include "map/key_map_ops.hpp"
#include "map/map_expr.hpp"
#include "map/map_spec.hpp"
#include "map/model_config.hpp"
#include "map/shipped_maps.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

// A row-major range split into more blocks than this is refused (ToBoxedTensor): no layout a
// framework writes comes near it.
constexpr size_t kMaxBlocksPerTensor = size_t{1} << 20;
constexpr uint64_t kMaxMapFileBytes = uint64_t{1} << 20;
// Tensors one rule may serve: far above any model (128 layers of 256 experts are 32,768), far
// below what a lying shape could ask for.
constexpr uint64_t kMaxTensorsPerRule = uint64_t{1} << 22;
// Parameters defined through parameters, at most this deep (each level a stack frame or more).
constexpr size_t kMaxParameterDepth = 64;

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string ShippedNames() {
  std::string names;
  for (const ShippedMap& m : ShippedMaps()) names += (names.empty() ? "" : ", ") + std::string(m.name);
  return names;
}

Status ReadMapFile(const std::string& path, std::string* text) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return Status::FromErrno(path, "cannot open the map file", errno);
  text->clear();
  char buffer[65536];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, f)) > 0) {
    text->append(buffer, n);
    if (text->size() > kMaxMapFileBytes) {
      std::fclose(f);
      return Status::InvalidArgument(path, "a map file is at most 1 MiB");
    }
  }
  const bool failed = std::ferror(f);
  std::fclose(f);
  if (failed) return Status::FromErrno(path, "cannot read the map file", EIO);
  return Status::OK();
}

// A key split at its digit runs: the text with each run as "#", and the runs.
void Split(std::string_view key, std::string* shape, std::vector<std::string_view>* numbers) {
  shape->clear();
  numbers->clear();
  for (size_t i = 0; i < key.size();) {
    if (!std::isdigit(static_cast<unsigned char>(key[i]))) {
      size_t j = i + 1;
      while (j < key.size() && !std::isdigit(static_cast<unsigned char>(key[j]))) ++j;
      shape->append(key.substr(i, j - i));
      i = j;
      continue;
    }
    size_t j = i;
    while (j < key.size() && std::isdigit(static_cast<unsigned char>(key[j]))) ++j;
    shape->push_back('#');
    numbers->push_back(key.substr(i, j - i));
    i = j;
  }
}

bool HasDigit(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A decimal number as a capture takes it: no leading zero, at most 18 digits.
bool CaptureNumber(std::string_view digits, uint64_t* value) {
  if (digits.empty() || digits.size() > 18 || (digits.size() > 1 && digits[0] == '0')) return false;
  uint64_t v = 0;
  for (char c : digits) v = v * 10 + static_cast<uint64_t>(c - '0');
  *value = v;
  return true;
}

// Values of captured and unstacked names, without allocation (a map makes one per served
// tensor). Names point into the map's patterns, which outlive every binding.
struct Binding {
  std::array<std::pair<std::string_view, uint64_t>, kMaxKeyCaptures> items{};
  size_t count = 0;
  void emplace_back(std::string_view name, uint64_t value) {
    // The parser bounds the names of a source (captures and unstacked) by kMaxKeyCaptures.
    if (count < items.size()) items[count++] = {name, value};
  }
  const std::pair<std::string_view, uint64_t>* begin() const { return items.data(); }
  const std::pair<std::string_view, uint64_t>* end() const { return items.data() + count; }
};

const uint64_t* Bound(const Binding& b, std::string_view name) {
  for (const auto& [n, v] : b)
    if (n == name) return &v;
  return nullptr;
}

// Appends the key `p` names for `b` to *out (a served key is written straight into the
// view's key text: no allocation of its own).
void AppendSubstituted(const KeyPattern& p, const Binding& b, std::string* out) {
  *out += p.literals[0];
  for (size_t i = 0; i < p.names.size(); ++i) {
    if (const uint64_t* v = Bound(b, p.names[i])) {
      char digits[24];
      out->append(digits, std::to_chars(digits, digits + sizeof digits, *v).ptr - digits);
    } else {
      *out += "{" + p.names[i] + "}";
    }
    *out += p.literals[i + 1];
  }
}

// Sorts `values`, each below 2^bits, 11 bits at a time from the lowest (a few passes over
// 150,000 served tensors' order words where a comparison sort takes ~10 ms).
void RadixSort(std::vector<uint64_t>* values, int bits) {
  constexpr int kDigit = 11;
  constexpr uint64_t kMask = (uint64_t{1} << kDigit) - 1;
  std::vector<uint64_t> sorted(values->size());
  for (int shift = 0; shift < bits; shift += kDigit) {
    std::array<size_t, kMask + 2> at{};
    for (uint64_t v : *values) ++at[((v >> shift) & kMask) + 1];
    for (size_t d = 0; d <= kMask; ++d) at[d + 1] += at[d];
    for (uint64_t v : *values) sorted[at[(v >> shift) & kMask]++] = v;
    values->swap(sorted);
  }
}

// The shape Split gives every key `p` makes (each digit run one '#'): captures are digit runs,
// and a capture next to a literal's digits joins their run. *distinct: whether distinct
// bindings make distinct keys (no two captures in one run). A literal '#' would read as a
// digit run: the caller compares every key then.
std::string KeyShape(const KeyPattern& p, bool* distinct) {
  std::string shape, piece;
  std::vector<std::string_view> numbers;
  bool run_has_capture = false;
  *distinct = true;
  auto add = [&](std::string_view text, bool capture) {
    for (char c : text) {
      if (c == '#' && !shape.empty() && shape.back() == '#') {
        if (capture && run_has_capture) *distinct = false;
        run_has_capture = run_has_capture || capture;
        continue;
      }
      if (c == '#') run_has_capture = capture;
      shape.push_back(c);
    }
  };
  for (size_t i = 0; i < p.literals.size(); ++i) {
    Split(p.literals[i], &piece, &numbers);
    // A literal digit run is a run of its own unless it touches a capture's.
    add(piece, false);
    if (i < p.names.size()) add("#", true);
  }
  return shape;
}

std::string Substitute(const KeyPattern& p, const Binding& b) {
  std::string out;
  AppendSubstituted(p, b, &out);
  return out;
}

// What a request and its input decide before a map runs: the config the map reads, and
// which map.
class MapChoice {
 public:
  explicit MapChoice(const KeyMapRequest& request)
      : spec_(request.spec), settings_(request.settings) {}

  // What the source says of its model, for a map: the config with the user's settings, where
  // it came from (or why there is none), and the facts of it the stored tensors gave.
  struct SourceConfig {
    json config = json::object();
    bool has_config = false;
    std::string source;
    std::string error;   // why a config beside the weights could not be read
    std::string family;  // the Hugging Face family the model's class names, if any
    json from_tensors = json::object();
  };
  Status ReadSourceConfig(const MapInput& input, SourceConfig* out) const;
  // The map map= names: chosen by the config (auto), a map file, or a shipped map.
  Status LoadMap(const MapInput& input, const SourceConfig& c, KeyMap* map, std::string* reason) const;

 private:
  Status ChooseShippedMap(const MapInput& input, const SourceConfig& c, KeyMap* map, std::string* reason) const;

  std::string spec_;
  std::vector<std::pair<std::string, std::string>> settings_;
};

// One application of a map to one input: its names, the source keys, what it serves. It lives
// as long as what it serves (MapState): the served tensors' entries are made from it on first use.
class Mapping {
 public:
  // `served`: the tensors the map is applied to (kept alive by MapState::input).
  Mapping(const KeyMap& map, json config, std::string where, const MapInput& served)
      : map_(map), config_(std::move(config)), where_(std::move(where)), served_(served) {}

  // map.NAME=VALUE: a parameter of that name is replaced; a config field too.
  void Set(const std::string& name, const json& value) {
    config_[name] = value;
    for (const auto& [n, e] : map_.parameters)
      if (n == name) overrides_[name] = value;
  }

  Status Resolve(std::string_view name, json* value, bool* found) {
    *found = true;
    if (binding_)
      if (const uint64_t* v = Bound(*binding_, name)) {
        *value = *v;
        used_binding_ = true;
        return Status::OK();
      }
    const std::string key(name);
    if (auto it = overrides_.find(key); it != overrides_.end()) {
      *value = it->second;
      return Status::OK();
    }
    if (auto it = memo_.find(key); it != memo_.end()) {
      *value = it->second;
      return Status::OK();
    }
    for (const auto& [n, e] : map_.parameters) {
      if (n != name) continue;
      if (evaluating_.size() >= kMaxParameterDepth)
        return Status::InvalidArgument(where_, "parameter '" + key + "' is defined through more than " +
                                                   std::to_string(kMaxParameterDepth) + " other parameters");
      if (!evaluating_.insert(key).second)
        return Status::InvalidArgument(where_, "parameter '" + key + "' is defined through itself");
      const Binding* saved = binding_;
      binding_ = nullptr;  // parameters do not depend on captured values
      Status s = e.Evaluate(resolver_, value);
      binding_ = saved;
      evaluating_.erase(key);
      if (!s.ok() && s.message().starts_with(where_)) return s;
      if (!s.ok()) return Status::InvalidArgument(where_, "parameter '" + key + "' = " + e.text() + ": " + s.message());
      memo_[key] = *value;
      return Status::OK();
    }
    if (config_.contains(key)) {
      *value = config_[key];
      return Status::OK();
    }
    if (name == "served_dtype" && !served_dtype_.empty()) {
      *value = served_dtype_;
      return Status::OK();
    }
    *found = false;
    return Status::OK();
  }

  Status Evaluate(const Expr& e, const std::string& entry, json* out) {
    Status s = e.Evaluate(resolver_, out);
    if (!s.ok()) return Wrap(s, entry);
    return Status::OK();
  }
  Status Count(const Expr& e, const std::string& entry, uint64_t* out) {
    return Count(e, [&] { return entry; }, out);
  }
  // The same with the entry's name made only for an error. A value that depends on no
  // captured name is the same for every tensor of its rule: evaluated once, then kept.
  template <typename Entry>
  Status Count(const Expr& e, const Entry& entry, uint64_t* out) {
    if (auto it = constant_counts_.find(&e); it != constant_counts_.end()) {
      *out = it->second;
      return Status::OK();
    }
    const bool outer = used_binding_;
    used_binding_ = false;
    Status s = e.EvaluateCount(resolver_, out);
    const bool varies = used_binding_;
    used_binding_ = outer || varies;
    if (!s.ok()) return Wrap(s, entry());
    if (!varies) constant_counts_.emplace(&e, *out);
    return Status::OK();
  }
  Status Bool(const Expr& e, const std::string& entry, bool* out) {
    Status s = e.EvaluateBool(resolver_, out);
    if (!s.ok()) return Wrap(s, entry);
    return Status::OK();
  }

  Status CheckRequirements(const std::string& config_source) {
    for (size_t i = 0; i < map_.requires_.size(); ++i) {
      const auto& q = map_.requires_[i];
      bool ok = false;
      CKPTFS_RETURN_IF_ERROR(Bool(q.check, "requires[" + std::to_string(i) + "]", &ok));
      if (!ok)
        return Status::NotSupported(where_, "the checkpoint's config (" + config_source + ") fails '" + q.check.text() +
                                                "': " + q.why);
    }
    return Status::OK();
  }

  // Whether some rule of the map finds a source tensor under `prefix`.
  bool FindsUnder(const std::string& prefix) {
    prefix_ = prefix;
    IndexKeys();
    for (const MapRule& rule : map_.rules)
      for (const MapPart& part : rule.parts)
        for (const MapSource& alt : part.from)
          if (CountMatches(alt) > 0) return true;
    return false;
  }

  // Finds what the map serves and lays it out as `out`'s keys, shapes and sources (every
  // refusal is here), with the files it adds (config.json); the entries are made later by
  // MakeEntry.
  Status Run(std::optional<DType> dtype, MappedTensors* out,
             std::vector<std::pair<std::string, std::string>>* files);
  // Served tensor i's entry (after Run). Not thread-safe: MapEntries calls it under a lock.
  Status MakeEntry(size_t i, TensorEntry* out);
  const std::string& prefix() const { return prefix_; }
  json Parameters() {
    json out = json::object();
    for (const auto& [n, e] : map_.parameters) {
      json v;
      bool found = false;
      if (Resolve(n, &v, &found).ok() && found) out[n] = v;
    }
    return out;
  }

 private:
  Status Wrap(const Status& s, const std::string& entry) const {
    if (s.message().starts_with(where_)) return s;
    return Status::InvalidArgument(where_, entry + ": " + s.message());
  }

  // A digit run as a value, and whether it is written as a capture takes a number (no
  // leading zero, at most 18 digits): a key's "01" matches neither {L} nor a literal "1".
  // 8 bytes: a value of at most 18 digits is below 2^60, so all ones marks a digit run that
  // is not canonical (one per key of a per-layer save).
  struct Number {
    static constexpr uint64_t kNotCanonical = ~uint64_t{0};
    uint64_t value = kNotCanonical;
    bool canonical() const { return value != kNotCanonical; }
  };
  static Number ToNumber(std::string_view digits) {
    Number n;
    if (!CaptureNumber(digits, &n.value)) n.value = Number::kNotCanonical;
    return n;
  }

  void IndexKeys() {
    by_key_.clear();
    by_shape_.clear();
    numbers_.clear();
    std::string shape;
    std::vector<std::string_view> numbers;
    all_keys_indexed_ = false;
    most_boxes_ = 0;
    for (size_t i = 0; i < served_.size(); ++i) {
      const TensorEntry* entry = nullptr;
      if (served_.Stored(i, &entry).ok()) most_boxes_ = std::max<uint64_t>(most_boxes_, entry->boxes.size());
      const std::string_view key = served_.key(i);
      if (!key.starts_with(prefix_)) continue;
      const std::string_view rest = key.substr(prefix_.size());
      Split(rest, &shape, &numbers);
      if (numbers.empty()) {
        by_key_.emplace(rest, i);
        continue;
      }
      auto it = by_shape_.find(shape);
      if (it == by_shape_.end()) it = by_shape_.emplace(shape, std::vector<Indexed>()).first;
      it->second.push_back(Indexed{static_cast<uint32_t>(i), static_cast<uint32_t>(numbers_.size()),
                                   static_cast<uint32_t>(numbers.size())});
      for (std::string_view n : numbers) numbers_.push_back(ToNumber(n));
    }
  }

  // The tensor of key `key` (after the prefix), or SIZE_MAX. Keys with digits (a per-layer
  // save's nearly every key) are found through their numbers (ForEachMatch); they are indexed
  // by name only when a lookup first needs one.
  size_t FindKey(std::string_view key) {
    if (HasDigit(key)) IndexAllKeys();
    auto it = by_key_.find(key);
    return it == by_key_.end() ? SIZE_MAX : it->second;
  }
  void IndexAllKeys() {
    if (all_keys_indexed_) return;
    for (const auto& [shape, entries] : by_shape_)
      for (const Indexed& entry : entries) by_key_.emplace(served_.key(entry.index).substr(prefix_.size()), entry.index);
    all_keys_indexed_ = true;
  }

  // Calls on_match(tensor, binding) for each tensor `alt`'s key matches, with the captures it
  // gives (unstacked names not yet), until on_match returns a non-OK status (returned).
  template <typename OnMatch>
  Status ForEachMatch(const MapSource& alt, OnMatch on_match) {
    const KeyPattern& p = alt.key;
    // A key without digits by name; one with digits (`linear_fc1`) through its numbers too.
    if (p.names.empty() && !HasDigit(p.text)) {
      if (const size_t i = FindKey(p.text); i != SIZE_MAX) return on_match(i, Binding{});
      return Status::OK();
    }
    // The pattern's shape: captures and the digit runs of its literal text as '#'.
    std::string shape, piece;
    std::vector<int> slot_name;  // per '#': capture index, or -1 for a literal run
    std::vector<Number> literal_numbers;
    for (size_t i = 0; i < p.literals.size(); ++i) {
      std::vector<std::string_view> numbers;
      Split(p.literals[i], &piece, &numbers);
      shape += piece;
      for (std::string_view n : numbers) {
        slot_name.push_back(-1);
        literal_numbers.push_back(ToNumber(n));
      }
      if (i < p.names.size()) {
        shape += '#';
        slot_name.push_back(static_cast<int>(i));
        literal_numbers.emplace_back();
      }
    }
    auto it = by_shape_.find(shape);
    if (it == by_shape_.end()) return Status::OK();
    for (const Indexed& entry : it->second) {
      if (entry.count != slot_name.size()) continue;
      const Number* numbers = &numbers_[entry.first_number];
      Binding b;
      bool ok = true;
      for (size_t k = 0; ok && k < slot_name.size(); ++k) {
        if (!numbers[k].canonical()) {
          ok = false;
        } else if (slot_name[k] < 0) {
          ok = numbers[k].value == literal_numbers[k].value && literal_numbers[k].canonical();
        } else {
          const std::string& name = p.names[slot_name[k]];
          if (const uint64_t* prior = Bound(b, name)) ok = *prior == numbers[k].value;
          else b.emplace_back(name, numbers[k].value);
        }
      }
      if (ok) CKPTFS_RETURN_IF_ERROR(on_match(entry.index, b));
    }
    return Status::OK();
  }
  // The number of tensors `alt`'s key matches.
  size_t CountMatches(const MapSource& alt) {
    size_t n = 0;
    Status s = ForEachMatch(alt, [&](size_t, const Binding&) {
      ++n;
      return Status::OK();
    });
    return s.ok() ? n : 0;
  }

  // A rule's tensors as its source keys give them: one binding each of the names its
  // alternative binds (the pattern's captures, then the unstacked dimensions: the same names
  // in the same order for every binding of one alternative), and each one's source tensor.
  struct Found {
    size_t rule = 0, alt = 0;
    std::vector<std::string_view> names;
    std::vector<uint64_t> values;   // names.size() per binding
    std::vector<uint32_t> sources;  // per binding: the source tensor of its first part
    size_t size() const { return sources.size(); }
    Binding At(size_t b) const {
      Binding binding;
      for (size_t n = 0; n < names.size(); ++n) binding.emplace_back(names[n], values[b * names.size() + n]);
      return binding;
    }
  };

  Status Append(Found* f, const Binding& b, uint32_t source) const {
    if (f->sources.empty()) {
      f->names.clear();
      for (const auto& [n, v] : b) f->names.push_back(n);
    }
    bool same = b.count == f->names.size();
    for (size_t n = 0; same && n < b.count; ++n) same = b.items[n].first == f->names[n];
    if (!same) return Status::Corruption(where_, "'" + map_.rules[f->rule].to.text + "': bindings of one source pattern differ");
    for (const auto& [n, v] : b) f->values.push_back(v);
    f->sources.push_back(source);
    return Status::OK();
  }

  // Tensor i as boxes of its rank, into *out, with its first `unstack` index selected when
  // there is one (`index`). Those of many boxes (a stacked tensor's chunks, one layer taken at
  // a time) are made once and kept, and a selection copies only the boxes of its index.
  Status Boxed(size_t i, const uint64_t* index, BoxedTensor* out, std::string* why, bool* selected) {
    const TensorEntry* entry = nullptr;
    CKPTFS_RETURN_IF_ERROR(served_.Stored(i, &entry));
    const TensorEntry& t = *entry;
    *selected = false;
    const BoxedTensor* whole = nullptr;
    const BoxOrder* order = nullptr;
    if (t.boxes.size() > 8) {
      auto it = boxed_.find(i);
      if (it == boxed_.end()) {
        Kept made;
        Status s = ToBoxedTensor(t, kMaxBlocksPerTensor, &made.boxed);
        if (!s.ok()) return Status::NotSupported(where_, "'" + t.key + "': " + s.message());
        made.order = OrderAlong(made.boxed, 0);
        it = boxed_.emplace(i, std::move(made)).first;
      }
      whole = &it->second.boxed;
      order = &it->second.order;
    } else {
      Status s = ToBoxedTensor(t, kMaxBlocksPerTensor, &scratch_);
      if (!s.ok()) return Status::NotSupported(where_, "'" + t.key + "': " + s.message());
      whole = &scratch_;
    }
    if (index) {
      *selected = true;
      if (!SelectIndexOf(*whole, 0, *index, out, why, order)) return Status::NotSupported(where_, "'" + t.key + "': " + *why);
    } else if (whole == &scratch_) {
      std::swap(*out, scratch_);
    } else {
      *out = *whole;
    }
    return Status::OK();
  }

  // Every binding rule part `part` gives, into *f: its first alternative that finds a tensor.
  Status Enumerate(const MapRule& rule, Found* f) {
    const MapPart& part = rule.parts[0];
    for (size_t a = 0; a < part.from.size(); ++a) {
      const MapSource& alt = part.from[a];
      f->alt = a;
      CKPTFS_RETURN_IF_ERROR(ForEachMatch(alt, [&](size_t i, const Binding& b) -> Status {
        if (alt.unstack.empty()) return Append(f, b, static_cast<uint32_t>(i));
        // The unstacked dimensions' indices, outermost first.
        const Shape& shape = served_.shape(i);
        if (shape.size() < alt.unstack.size())
          return Status::NotSupported(where_, "'" + std::string(served_.key(i)) + "' of shape " + ShapeText(shape) +
                                                  " has fewer than " + std::to_string(alt.unstack.size()) +
                                                  " dimensions to unstack");
        // A dimension longer than its capture's count is refused before its indices are made
        // (a lying shape of 10^11 layers needs no byte of storage when another dimension is 0).
        uint64_t made = 1;
        for (size_t d = 0; d < alt.unstack.size(); ++d) {
          for (const auto& [name, count_expr] : map_.captures) {
            if (name != alt.unstack[d]) continue;
            uint64_t count = 0;
            CKPTFS_RETURN_IF_ERROR(Count(count_expr, "captures." + name, &count));
            if (shape[d] > count) return CaptureRefusal(rule, name, shape[d], 0, shape[d] - 1, count_expr, count);
          }
          if (!CheckedMul(made, shape[d], &made) || made > kMaxTensorsPerRule - std::min<uint64_t>(f->size(), kMaxTensorsPerRule))
            return Status::NotSupported(where_, "'" + std::string(served_.key(i)) + "' of shape " + ShapeText(shape) +
                                                    ": unstacking it makes more than " + std::to_string(kMaxTensorsPerRule) +
                                                    " tensors");
        }
        // Each combination of the unstacked indices, the last varying fastest.
        for (uint64_t k = 0; k < made; ++k) {
          Binding full = b;
          uint64_t rest = k, stride = made;
          for (size_t d = 0; d < alt.unstack.size(); ++d) {
            stride /= shape[d];
            full.emplace_back(alt.unstack[d], rest / stride);
            rest %= stride;
          }
          CKPTFS_RETURN_IF_ERROR(Append(f, full, static_cast<uint32_t>(i)));
        }
        return Status::OK();
      }));
      if (f->size() > 0) return Status::OK();
    }
    return Status::OK();
  }

  // The source of part `part` (after the first) for `binding`: its first alternative whose key
  // the checkpoint has.
  Status FindPart(const MapPart& part, const Binding& binding, std::string_view to, uint32_t* source, uint32_t* alt) {
    for (size_t a = 0; a < part.from.size(); ++a) {
      const size_t i = FindKey(Substitute(part.from[a].key, binding));
      if (i == SIZE_MAX) continue;
      *source = static_cast<uint32_t>(i);
      *alt = static_cast<uint32_t>(a);
      return Status::OK();
    }
    return Status::NotSupported(where_, "'" + std::string(to) + "' needs '" + prefix_ + Substitute(part.from[0].key, binding) +
                                            "', which the checkpoint does not have");
  }

  // One form of the operations: on shapes alone or on boxes (key_map_ops.hpp).
  template <typename T>
  struct OpForms {
    bool (*select)(T*, size_t, uint64_t, std::string*);
    bool (*slice)(T*, size_t, uint64_t, uint64_t, std::string*);
    bool (*row_groups)(T*, size_t, uint64_t, uint64_t, uint64_t, uint64_t, std::string*);
    bool (*transpose)(T*, size_t, size_t, std::string*);
  };
  // Part `part`'s operations on *target in `forms`, their values evaluated for the current
  // binding; *groups: the product of its row_groups' group counts.
  template <typename T>
  Status ApplyOps(const MapPart& part, const MapRule& rule, const OpForms<T>& forms, T* target,
                  const std::function<std::string()>& what, uint64_t* groups) {
    std::string why;
    for (size_t k = 0; k < part.ops.size(); ++k) {
      const MapOp& op = part.ops[k];
      auto field = [&](const char* name) {
        return [&rule, k, name] { return rule.where + " op " + std::to_string(k) + "." + name; };
      };
      uint64_t index = 0, start = 0, stop = 0, count = 0, size = 0;
      bool ok = true;
      switch (op.kind) {
        case MapOp::Kind::kSelect:
          CKPTFS_RETURN_IF_ERROR(Count(op.index, field("index"), &index));
          ok = forms.select(target, op.dim, index, &why);
          break;
        case MapOp::Kind::kSlice:
          CKPTFS_RETURN_IF_ERROR(Count(op.start, field("start"), &start));
          CKPTFS_RETURN_IF_ERROR(Count(op.stop, field("stop"), &stop));
          ok = forms.slice(target, op.dim, start, stop, &why);
          break;
        case MapOp::Kind::kRowGroups:
          CKPTFS_RETURN_IF_ERROR(Count(op.groups, field("groups"), &count));
          CKPTFS_RETURN_IF_ERROR(Count(op.size, field("size"), &size));
          CKPTFS_RETURN_IF_ERROR(Count(op.start, field("start"), &start));
          CKPTFS_RETURN_IF_ERROR(Count(op.stop, field("stop"), &stop));
          ok = forms.row_groups(target, op.dim, count, size, start, stop, &why);
          if (!CheckedMul(*groups, count, groups)) *groups = UINT64_MAX;
          break;
        case MapOp::Kind::kTranspose: ok = forms.transpose(target, op.dim, op.dim2, &why); break;
      }
      if (!ok) return Status::NotSupported(where_, what() + ": " + why);
    }
    return Status::OK();
  }

  // The rule's source_shape check of a part's shape after unstacking.
  Status CheckSourceShape(const MapRule& rule, const Shape& shape, const std::function<std::string()>& what) {
    if (rule.source_shape.empty()) return Status::OK();
    Shape expected;
    CKPTFS_RETURN_IF_ERROR(Dims(rule.source_shape, rule.where, ".source_shape", &expected));
    if (expected != shape)
      return Status::NotSupported(where_, what() + " has shape " + ShapeText(shape) + ", the map's parameters give [" +
                                              Texts(rule.source_shape) + "] = " + ShapeText(expected));
    return Status::OK();
  }

  // The shape part `part` gives from source tensor `source` through alternative `alt` for
  // the current binding: its operations on the shape alone, refused where the boxes' would be
  // (key_map_ops.hpp). *box_factor: at most how many boxes its box form makes per source box.
  Status PartShape(const MapPart& part, const MapRule& rule, size_t alt, size_t source, const Binding& binding,
                   std::string_view to, Shape* out, uint64_t* box_factor) {
    const MapSource& from = part.from[alt];
    auto what = [&] { return "'" + std::string(served_.key(source)) + "' (for '" + std::string(to) + "')"; };
    std::string why;
    *out = served_.shape(source);
    for (size_t u = 0; u < from.unstack.size(); ++u)
      if (!SelectShape(out, 0, *Bound(binding, from.unstack[u]), &why))
        return Status::NotSupported(where_, what() + ": " + why);
    CKPTFS_RETURN_IF_ERROR(CheckSourceShape(rule, *out, what));
    static constexpr OpForms<Shape> kShapeForms{SelectShape, SliceShape, RowGroupsShape, TransposeShape};
    uint64_t groups = 1;
    CKPTFS_RETURN_IF_ERROR(ApplyOps(part, rule, kShapeForms, out, what, &groups));
    // A source box becomes at most 2 * rank blocks (ToBoxedTensor: a range of row-major
    // elements), and each block meets at most `groups` groups of a row_groups.
    if (!CheckedMul(groups, 2 * std::max<uint64_t>(served_.shape(source).size(), 1), box_factor)) *box_factor = UINT64_MAX;
    return Status::OK();
  }

  // The same part as boxes, for the current binding.
  Status PartBoxes(const MapPart& part, const MapRule& rule, size_t alt, size_t source, const Binding& binding,
                   std::string_view to, BoxedTensor* out) {
    const MapSource& from = part.from[alt];
    // Messages are made only for a refusal.
    auto what = [&] { return "'" + std::string(served_.key(source)) + "' (for '" + std::string(to) + "')"; };
    std::string why;
    bool selected = false;
    Status boxed = Boxed(source, from.unstack.empty() ? nullptr : Bound(binding, from.unstack[0]), out, &why, &selected);
    if (!boxed.ok() && selected) return Status::NotSupported(where_, what() + ": " + why);
    CKPTFS_RETURN_IF_ERROR(boxed);
    for (size_t u = selected ? 1 : 0; u < from.unstack.size(); ++u)
      if (!SelectIndex(out, 0, *Bound(binding, from.unstack[u]), &why))
        return Status::NotSupported(where_, what() + ": " + why);
    CKPTFS_RETURN_IF_ERROR(CheckSourceShape(rule, out->shape, what));
    static constexpr OpForms<BoxedTensor> kBoxForms{SelectIndex, SliceDim, RowGroups, Transpose};
    uint64_t groups = 1;
    return ApplyOps(part, rule, kBoxForms, out, what, &groups);
  }

  // The rule's tensor for binding b of found_[k] whose parts' sources (and alternatives) are
  // `sources`, as an entry of key `to`.
  Status Make(size_t k, size_t b, const std::vector<std::pair<uint32_t, uint32_t>>& sources, std::string to,
              TensorEntry* out) {
    const Found& f = found_[k];
    const MapRule& rule = map_.rules[f.rule];
    const Binding binding = f.At(b);
    binding_ = &binding;
    parts_.resize(rule.parts.size());
    Status s;
    for (size_t p = 0; s.ok() && p < rule.parts.size(); ++p)
      s = PartBoxes(rule.parts[p], rule, sources[p].second, sources[p].first, binding, to, &parts_[p]);
    std::string why;
    if (s.ok() && rule.concat && !Concat(parts_, rule.concat_dim, &result_, &why))
      s = Status::NotSupported(where_, "'" + to + "': " + why);
    else if (s.ok() && !rule.concat)
      std::swap(result_, parts_[0]);
    binding_ = nullptr;
    CKPTFS_RETURN_IF_ERROR(s);
    const size_t first = sources[0].first;
    out->key = std::move(to);
    out->path = served_.path(first);
    out->dtype = served_.stored_dtype(first);
    out->shape = std::move(result_.shape);
    out->boxes = BoxList(std::move(result_.boxes));
    result_.boxes.clear();
    return Status::OK();
  }

  Status CheckCaptures(const MapRule& rule, const Found& f);
  Status CaptureRefusal(const MapRule& rule, const std::string& name, uint64_t values, uint64_t lowest, uint64_t highest,
                        const Expr& count_expr, uint64_t count) const;
  // `where` + `field` name the entry in an error.
  Status Dims(const std::vector<Expr>& exprs, const std::string& where, const char* field, Shape* out) {
    out->clear();
    for (const Expr& e : exprs) {
      uint64_t n = 0;
      CKPTFS_RETURN_IF_ERROR(Count(e, [&] { return where + field; }, &n));
      out->push_back(n);
    }
    return Status::OK();
  }
  static std::string Texts(const std::vector<Expr>& exprs) {
    std::string texts;
    for (size_t d = 0; d < exprs.size(); ++d) texts += (d ? ", " : "") + exprs[d].text();
    return texts;
  }
  Status MakeFile(const json& templ, const std::string& entry, json* out, bool* keep);
  // The served order (Run): per served tensor, found_ index << 32 | binding index.
  Status Order(const std::vector<uint64_t>& section_of, const std::vector<uint64_t>& block_of, std::vector<uint64_t>* slots);

  // Run's parts, in the order it calls them.
  using PartSources = std::vector<std::pair<uint32_t, uint32_t>>;  // per part: source tensor, alternative
  // The served shapes, each stored once (MappedTensors::shapes), found by their bytes.
  struct ShapeTable {
    std::vector<Shape>* shapes;
    std::unordered_map<std::string, uint32_t> index;
    uint32_t Intern(const Shape& shape) {
      const std::string bytes(reinterpret_cast<const char*>(shape.data()), shape.size() * sizeof(uint64_t));
      auto [it, added] = index.try_emplace(bytes, static_cast<uint32_t>(shapes->size()));
      if (added) shapes->push_back(shape);
      return it->second;
    }
  };
  // A rule's served shape for sources of one shape, where it depends on nothing else.
  struct ShapeMemo {
    bool set = false;
    Shape in;
    uint32_t shape = 0;
    uint64_t box_factor = 0;
  };
  Status FindRules();
  Status ServedShape(size_t k, const Binding& binding, std::string_view to, const PartSources& sources,
                     ShapeMemo* memo, ShapeTable* shapes, uint32_t* shape, uint64_t* box_factor);
  Status CheckEntryAtMount(size_t k, size_t b, const PartSources& sources, std::string_view to, uint64_t box_factor,
                           std::vector<bool>* checked);
  Status CheckEverySourceUsed(const std::vector<bool>& used) const;
  Status CheckKeysDistinct(const MappedTensors& out) const;
  Status AddModelFiles(std::optional<DType> dtype, std::vector<std::pair<std::string, std::string>>* files);

  const KeyMap& map_;
  json config_;
  std::string where_;
  const MapInput& served_;
  std::string prefix_;
  std::unordered_map<std::string, json> overrides_, memo_;
  std::set<std::string> evaluating_;
  const Binding* binding_ = nullptr;
  bool used_binding_ = false;  // whether an evaluation looked up a captured name
  std::unordered_map<const Expr*, uint64_t> constant_counts_;
  std::string served_dtype_;
  Expr::Resolver resolver_ = [this](std::string_view n, json* v, bool* f) { return Resolve(n, v, f); };
  std::unordered_map<std::string_view, size_t> by_key_;
  bool all_keys_indexed_ = false;
  struct Indexed {
    uint32_t index, first_number, count;
  };
  std::unordered_map<std::string, std::vector<Indexed>> by_shape_;
  std::vector<Number> numbers_;
  uint64_t most_boxes_ = 0;  // the most boxes a source tensor has (IndexKeys)
  // Source tensors of many boxes as boxes of their rank, with their order along the layer axis.
  struct Kept {
    BoxedTensor boxed;
    BoxOrder order;
  };
  std::unordered_map<size_t, Kept> boxed_;
  BoxedTensor scratch_, result_;
  std::vector<BoxedTensor> parts_;
  std::vector<Shape> part_shapes_;  // ServedShape's, kept between its calls
  Shape result_shape_;
  // What Run found, kept for MakeEntry: the rules' bindings, each served tensor's (found,
  // binding), and the sources of the parts after the first of a concatenation's tensors.
  std::vector<Found> found_;
  std::vector<uint64_t> slots_;
  std::unordered_map<uint32_t, std::vector<std::pair<uint32_t, uint32_t>>> more_parts_;
};

Status Mapping::CaptureRefusal(const MapRule& rule, const std::string& name, uint64_t values, uint64_t lowest,
                               uint64_t highest, const Expr& count_expr, uint64_t count) const {
  return Status::NotSupported(
      where_, "'" + rule.to.text + "' from '" + prefix_ + rule.parts[0].from[0].key.text + "': " + name + " takes " +
                  std::to_string(values) + " values" +
                  (values == 0 ? "" : " in [" + std::to_string(lowest) + ", " + std::to_string(highest) + "]") +
                  ", the map expects " + count_expr.text() + " = " + std::to_string(count) + " (0 to " +
                  std::to_string(count ? count - 1 : 0) + ")");
}

Status Mapping::MakeFile(const json& templ, const std::string& entry, json* out, bool* keep) {
  *keep = true;
  if (templ.is_string()) {
    const std::string& s = templ.get_ref<const std::string&>();
    if (s.empty() || s[0] != '=') {
      *out = templ;
      return Status::OK();
    }
    Expr e;
    CKPTFS_RETURN_IF_ERROR(Expr::Parse(s.substr(1), &e));
    return Evaluate(e, entry, out);
  }
  if (templ.is_object()) {
    *out = json::object();
    for (auto it = templ.begin(); it != templ.end(); ++it) {
      if (it.key() == "$when") {
        Expr e;
        // The map's parser took a text, an integer or a boolean here (map_spec.cpp).
        if (!it.value().is_string()) e = Expr::Constant(it.value());
        else CKPTFS_RETURN_IF_ERROR(Expr::Parse(it.value().get<std::string>(), &e));
        bool when = false;
        CKPTFS_RETURN_IF_ERROR(Bool(e, entry + ".$when", &when));
        if (!when) {
          *keep = false;
          return Status::OK();
        }
        continue;
      }
      json v;
      bool k = true;
      CKPTFS_RETURN_IF_ERROR(MakeFile(it.value(), entry + "." + it.key(), &v, &k));
      if (k) (*out)[it.key()] = std::move(v);
    }
    return Status::OK();
  }
  if (templ.is_array()) {
    *out = json::array();
    for (size_t i = 0; i < templ.size(); ++i) {
      json v;
      bool k = true;
      CKPTFS_RETURN_IF_ERROR(MakeFile(templ[i], entry + "[" + std::to_string(i) + "]", &v, &k));
      if (k) out->push_back(std::move(v));
    }
    return Status::OK();
  }
  *out = templ;
  return Status::OK();
}

Status Mapping::CheckCaptures(const MapRule& rule, const Found& f) {
  // Each declared capture takes every value of [0, count) and no other; together they make
  // every combination once (a layer without one of its experts is refused, never served short).
  uint64_t combinations = 1;
  size_t declared = 0;
  const size_t width = f.names.size();
  for (const auto& [name, count_expr] : map_.captures) {
    const auto at = std::find(f.names.begin(), f.names.end(), std::string_view(name));
    if (f.size() == 0 || at == f.names.end()) continue;
    const size_t n = static_cast<size_t>(at - f.names.begin());
    ++declared;
    uint64_t count = 0;
    CKPTFS_RETURN_IF_ERROR(Count(count_expr, "captures." + name, &count));
    // The distinct values, in order (a sorted vector: one per served tensor of the rule).
    std::vector<uint64_t> seen(f.size());
    for (size_t b = 0; b < f.size(); ++b) seen[b] = f.values[b * width + n];
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    if (seen.size() != count || (count > 0 && *seen.rbegin() != count - 1))
      return CaptureRefusal(rule, name, seen.size(), seen.empty() ? 0 : *seen.begin(), seen.empty() ? 0 : *seen.rbegin(),
                            count_expr, count);
    if (!CheckedMul(combinations, count, &combinations)) combinations = UINT64_MAX;
  }
  // Bindings are distinct (one per source key or unstacked index): with every bound name a
  // declared capture, as many as the combinations means each combination is there.
  if (f.size() > 0 && declared == width && f.size() != combinations) {
    std::string names;
    for (std::string_view n : f.names) names += (names.empty() ? "" : ", ") + std::string(n);
    return Status::NotSupported(where_, "'" + rule.to.text + "' from '" + prefix_ + rule.parts[0].from[0].key.text +
                                            "': the checkpoint has " + std::to_string(f.size()) + " of the " +
                                            std::to_string(combinations) + " combinations of " + names +
                                            " the map expects (a layer without one of its tensors)");
  }
  return Status::OK();
}

Status Mapping::Order(const std::vector<uint64_t>& section_of, const std::vector<uint64_t>& block_of,
                      std::vector<uint64_t>* slots) {
  // Sections of the served order: runs of rules whose first capture is the same; blocks within
  // them: runs of rules with the same captures. Served in order of section, first capture,
  // block, further captures, rule (per layer, each expert's tensors together), ties in the
  // order found.
  using Key = std::array<uint64_t, 3 + kMaxKeyCaptures>;
  std::vector<std::vector<int>> to_pos(found_.size());  // per served key name: its place in the binding
  std::vector<uint64_t> first_of(found_.size() + 1, 0);  // found k's slots start at first_of[k]
  for (size_t k = 0; k < found_.size(); ++k) {
    for (const std::string& name : map_.rules[found_[k].rule].to.names) {
      const auto at = std::find(found_[k].names.begin(), found_[k].names.end(), std::string_view(name));
      to_pos[k].push_back(at == found_[k].names.end() ? -1 : static_cast<int>(at - found_[k].names.begin()));
    }
    first_of[k + 1] = first_of[k] + found_[k].size();
  }
  const uint64_t total = first_of.back();
  // The order of a tensor of found_[k] whose served key's n-th name has the value value(n).
  auto key_with = [&](size_t k, auto value) {
    const Found& f = found_[k];
    const auto& names = map_.rules[f.rule].to.names;
    Key key{};
    key[0] = section_of[f.rule];
    key[1] = names.empty() ? 0 : value(0);
    key[2] = block_of[f.rule];
    for (size_t n = 1; n < names.size(); ++n) key[2 + n] = value(n);
    key[2 + std::max<size_t>(names.size(), 1)] = f.rule;
    return key;
  };
  auto key_of = [&](size_t k, size_t b) {
    const Found& f = found_[k];
    return key_with(k, [&](size_t n) { return to_pos[k][n] < 0 ? 0 : f.values[b * f.names.size() + to_pos[k][n]]; });
  };
  // Packed into one word with the slot's number below when the fields fit (a map of 128 layers
  // and 20 rules needs ~30 bits): one integer sort of the served tensors. Each field's widest
  // value: the rules' numbers, and the largest value each rule binds to each name.
  Key widest{};
  for (size_t k = 0; k < found_.size(); ++k) {
    const Found& f = found_[k];
    const size_t width = f.names.size();
    std::array<uint64_t, kMaxKeyCaptures> most{};
    for (size_t at = 0; at < f.values.size(); ++at) most[at % width] = std::max(most[at % width], f.values[at]);
    const Key key = key_with(k, [&](size_t n) { return to_pos[k][n] < 0 ? 0 : most[to_pos[k][n]]; });
    for (size_t j = 0; j < key.size(); ++j) widest[j] = std::max(widest[j], key[j]);
  }
  Key bits{};
  size_t total_bits = static_cast<size_t>(std::bit_width(total));
  for (size_t j = 0; j < widest.size(); ++j) total_bits += bits[j] = static_cast<uint64_t>(std::bit_width(widest[j]));
  slots->clear();
  if (total_bits <= 64) {
    const int index_bits = std::bit_width(total);
    std::vector<uint64_t> packed;
    packed.reserve(total);
    for (size_t k = 0; k < found_.size(); ++k)
      for (size_t b = 0; b < found_[k].size(); ++b) {
        const Key key = key_of(k, b);
        uint64_t word = 0;
        for (size_t j = 0; j < key.size(); ++j)
          if (bits[j] > 0) word = (word << bits[j]) | key[j];
        packed.push_back(index_bits == 0 ? word : (word << index_bits) | (first_of[k] + b));
      }
    RadixSort(&packed, static_cast<int>(total_bits));
    const uint64_t index_mask = index_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << index_bits) - 1;
    for (uint64_t& word : packed) {  // each word becomes its slot, in place
      const uint64_t g = word & index_mask;
      const size_t k = static_cast<size_t>(std::upper_bound(first_of.begin(), first_of.end(), g) - first_of.begin()) - 1;
      word = uint64_t{k} << 32 | (g - first_of[k]);
    }
    *slots = std::move(packed);
    return Status::OK();
  }
  slots->reserve(total);
  for (size_t k = 0; k < found_.size(); ++k)
    for (size_t b = 0; b < found_[k].size(); ++b) slots->push_back(uint64_t{k} << 32 | b);
  std::stable_sort(slots->begin(), slots->end(), [&](uint64_t x, uint64_t y) {
    return key_of(x >> 32, x & 0xFFFFFFFF) < key_of(y >> 32, y & 0xFFFFFFFF);
  });
  return Status::OK();
}

// The rules in use and what each finds.
Status Mapping::FindRules() {
  found_.clear();
  for (size_t r = 0; r < map_.rules.size(); ++r) {
    const MapRule& rule = map_.rules[r];
    if (!rule.when.empty()) {
      bool when = false;
      CKPTFS_RETURN_IF_ERROR(Bool(rule.when, rule.where + ".when", &when));
      if (!when) continue;
    }
    Found f;
    f.rule = r;
    CKPTFS_RETURN_IF_ERROR(Enumerate(rule, &f));
    if (f.size() == 0)
      return Status::NotSupported(where_, "'" + rule.to.text + "' needs '" + prefix_ + rule.parts[0].from[0].key.text +
                                              "', which the checkpoint does not have");
    CKPTFS_RETURN_IF_ERROR(CheckCaptures(rule, f));
    found_.push_back(std::move(f));
  }
  return Status::OK();
}

// The served shape of one tensor of found_[k] (`to`: its served key; `sources`: its parts'):
// each part's shape, their concatenation, checked against the map's stated shape, interned in
// `shapes`; and the factor that bounds its entry's box count. A single-part rule whose shape
// depends on no captured value gives every source of one shape the same served shape: made
// once per rule and source shape (`memo`).
Status Mapping::ServedShape(size_t k, const Binding& binding, std::string_view to, const PartSources& sources,
                            ShapeMemo* memo, ShapeTable* shapes, uint32_t* shape, uint64_t* box_factor) {
  const MapRule& rule = map_.rules[found_[k].rule];
  if (memo->set && memo->in == served_.shape(sources[0].first)) {
    *shape = memo->shape;
    *box_factor = memo->box_factor;
    return Status::OK();
  }
  *box_factor = 0;
  used_binding_ = false;
  part_shapes_.resize(rule.parts.size());
  for (size_t p = 0; p < rule.parts.size(); ++p) {
    uint64_t factor = 0;
    CKPTFS_RETURN_IF_ERROR(
        PartShape(rule.parts[p], rule, sources[p].second, sources[p].first, binding, to, &part_shapes_[p], &factor));
    if (!CheckedAdd(*box_factor, factor, box_factor)) *box_factor = UINT64_MAX;
  }
  if (rule.concat) {
    for (size_t p = 1; p < sources.size(); ++p)
      if (served_.stored_dtype(sources[p].first) != served_.stored_dtype(sources[0].first))
        return Status::NotSupported(where_, "'" + std::string(to) + "': concat of '" +
                                                std::string(served_.key(sources[0].first)) + "' and '" +
                                                std::string(served_.key(sources[p].first)) + "', of different dtypes");
    std::string why;
    if (!ConcatShape(part_shapes_, rule.concat_dim, &result_shape_, &why))
      return Status::NotSupported(where_, "'" + std::string(to) + "': " + why);
  } else {
    result_shape_ = part_shapes_[0];
  }
  if (!rule.shape.empty()) {
    Shape expected;
    CKPTFS_RETURN_IF_ERROR(Dims(rule.shape, rule.where, ".shape", &expected));
    if (expected != result_shape_)
      return Status::NotSupported(where_, "'" + std::string(to) + "' from '" + std::string(served_.key(sources[0].first)) +
                                              "' has shape " + ShapeText(result_shape_) + ", the map's parameters give [" +
                                              Texts(rule.shape) + "] = " + ShapeText(expected));
  }
  *shape = shapes->Intern(result_shape_);
  if (rule.parts.size() == 1 && !used_binding_) *memo = ShapeMemo{true, served_.shape(sources[0].first), *shape, *box_factor};
  return Status::OK();
}

// Made at mount: a tensor whose boxes could pass the limits, and the first of each rule, its
// entry checked as every made entry is (a map's error shows at mount, not at a read). The
// bound with the most boxes any source has first: only past the limit are this tensor's own
// sources' counted.
Status Mapping::CheckEntryAtMount(size_t k, size_t b, const PartSources& sources, std::string_view to,
                                  uint64_t box_factor, std::vector<bool>* checked) {
  // A made entry's box count is refused past this (ToBoxedTensor, RowGroups).
  constexpr uint64_t kBoxLimit = std::min<uint64_t>(kMaxBlocksPerTensor, kMaxRowGroupPieces);
  uint64_t bound = 0;
  bool past = !CheckedMul(most_boxes_, box_factor, &bound) || bound > kBoxLimit;
  if (past) {
    uint64_t boxes = 0;
    for (const auto& [source, alt] : sources) {
      const TensorEntry* entry = nullptr;
      CKPTFS_RETURN_IF_ERROR(served_.Stored(source, &entry));
      boxes = std::max<uint64_t>(boxes, entry->boxes.size());
    }
    past = !CheckedMul(boxes, box_factor, &bound) || bound > kBoxLimit;
  }
  if (!past && (*checked)[k]) return Status::OK();
  (*checked)[k] = true;
  TensorEntry probe;
  CKPTFS_RETURN_IF_ERROR(Make(k, b, sources, std::string(to), &probe));
  std::vector<uint32_t> others;
  for (size_t p = 1; p < sources.size(); ++p)
    if (sources[p].first != sources[0].first) others.push_back(static_cast<uint32_t>(served_.source_index(sources[p].first)));
  return served_.CheckEntry(probe, served_.source_index(sources[0].first), others);
}

// Every source tensor is used or ignored on purpose.
Status Mapping::CheckEverySourceUsed(const std::vector<bool>& used) const {
  for (size_t i = 0; i < served_.size(); ++i) {
    if (used[i]) continue;
    const std::string_view key = served_.key(i);
    const std::string_view rest = key.starts_with(prefix_) ? key.substr(prefix_.size()) : key;
    bool ignored = false;
    for (const std::string& glob : map_.ignore) ignored = ignored || GlobMatch(glob, rest) || GlobMatch(glob, key);
    if (!ignored)
      return Status::NotSupported(where_, "tensor '" + std::string(key) + "' " + ShapeText(served_.shape(i)) +
                                              " is used by no rule of the map and not ignored by it: the map does not "
                                              "describe this checkpoint");
  }
  return Status::OK();
}

// Two served tensors of one key: only possible among rules whose keys have one digit-run
// shape (KeyShape), or within a rule whose captures run together; only those are compared.
Status Mapping::CheckKeysDistinct(const MappedTensors& out) const {
  std::map<std::string, std::vector<size_t>> rules_of_shape;  // shape -> found_ indices
  std::vector<bool> compare(found_.size(), false);
  for (size_t k = 0; k < found_.size(); ++k) {
    bool distinct = true;
    const std::string shape = KeyShape(map_.rules[found_[k].rule].to, &distinct);
    compare[k] = !distinct;
    rules_of_shape[shape].push_back(k);
  }
  for (size_t k = 0; k < found_.size(); ++k)
    for (const std::string& literal : map_.rules[found_[k].rule].to.literals)
      if (literal.find('#') != std::string::npos) compare.assign(found_.size(), true);
  for (const auto& [shape, ks] : rules_of_shape)
    if (ks.size() > 1)
      for (size_t k : ks) compare[k] = true;
  std::vector<uint32_t> compared;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (compare[slots_[i] >> 32]) compared.push_back(static_cast<uint32_t>(i));
  auto key_at = [&](size_t i) -> std::string_view {
    const uint64_t begin = i == 0 ? 0 : out.key_end[i - 1];
    return std::string_view(out.key_text).substr(begin, out.key_end[i] - begin);
  };
  if (std::optional<size_t> twice = FindRepeatedKey(compared.size(), [&](size_t c) { return key_at(compared[c]); }))
    return Status::NotSupported(where_, "two rules serve the key '" + std::string(key_at(compared[*twice])) + "'");
  return Status::OK();
}

// config.json and generation_config.json from the map's templates; what config.json says of
// the dtype is the type the first tensor is served in.
Status Mapping::AddModelFiles(std::optional<DType> dtype, std::vector<std::pair<std::string, std::string>>* files) {
  if (!slots_.empty()) {
    DType d = served_.stored_dtype(found_[slots_[0] >> 32].sources[slots_[0] & 0xFFFFFFFF]);
    if (dtype && Info(d).is_float && d != DType::kF4x2) d = *dtype;
    served_dtype_ = std::string(Info(d).torch_name);
  }
  for (const auto& [name, templ] : {std::pair<const char*, const json*>{"config.json", &map_.config},
                                    std::pair<const char*, const json*>{"generation_config.json", &map_.generation_config}}) {
    if (templ->is_null()) continue;
    json content;
    bool keep = true;
    CKPTFS_RETURN_IF_ERROR(MakeFile(*templ, name == std::string("config.json") ? "config" : "generation_config", &content, &keep));
    files->emplace_back(name, content.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
  }
  return Status::OK();
}

Status Mapping::Run(std::optional<DType> dtype, MappedTensors* out,
                    std::vector<std::pair<std::string, std::string>>* files) {
  // The rules in use and what each finds, first: every served tensor is counted and ordered
  // before one is laid out.
  CKPTFS_RETURN_IF_ERROR(FindRules());
  std::vector<uint64_t> section_of(map_.rules.size(), 0), block_of(map_.rules.size(), 0);
  for (size_t r = 1; r < map_.rules.size(); ++r) {
    const auto& prev = map_.rules[r - 1].to.names;
    const auto& cur = map_.rules[r].to.names;
    section_of[r] = section_of[r - 1] + ((prev.empty() ? "" : prev[0]) != (cur.empty() ? "" : cur[0]));
    block_of[r] = block_of[r - 1] + (prev != cur);
  }
  // Keys are found by their numbers no more: only by name, for a concatenation's parts.
  for (const Found& f : found_)
    if (map_.rules[f.rule].parts.size() > 1) IndexAllKeys();
  by_shape_ = {};
  numbers_ = {};
  CKPTFS_RETURN_IF_ERROR(Order(section_of, block_of, &slots_));
  const size_t total = slots_.size();

  // Each served tensor's key, shape and sources, in the served order; its boxes are made on
  // first use (MakeEntry).
  std::vector<ShapeMemo> memos(found_.size());
  std::vector<bool> checked(found_.size(), false);
  ShapeTable shapes{&out->shapes, {}};
  // The key text sized once (grown by doubling it would be copied and faulted in twice).
  uint64_t key_bytes = 0;
  for (const Found& f : found_) key_bytes += f.size() * (map_.rules[f.rule].to.text.size() + 8);
  out->key_text.reserve(key_bytes);
  out->key_end.reserve(total);
  out->shape_of.reserve(total);
  out->from_sources.reserve(total);
  std::vector<bool> used(served_.size(), false);
  PartSources sources;
  for (size_t i = 0; i < total; ++i) {
    const size_t k = slots_[i] >> 32, b = slots_[i] & 0xFFFFFFFF;
    const Found& f = found_[k];
    const MapRule& rule = map_.rules[f.rule];
    const Binding binding = f.At(b);
    binding_ = &binding;
    const size_t key_begin = out->key_text.size();
    AppendSubstituted(rule.to, binding, &out->key_text);
    // The key just written (valid until the next key is appended).
    const std::string_view to = std::string_view(out->key_text).substr(key_begin);
    sources.assign(1, {f.sources[b], static_cast<uint32_t>(f.alt)});
    Status s;
    for (size_t p = 1; s.ok() && p < rule.parts.size(); ++p) {
      uint32_t source = 0, alt = 0;
      s = FindPart(rule.parts[p], binding, to, &source, &alt);
      sources.emplace_back(source, alt);
    }
    uint32_t shape = 0;
    uint64_t box_factor = 0;
    if (s.ok()) s = ServedShape(k, binding, to, sources, &memos[k], &shapes, &shape, &box_factor);
    if (s.ok()) s = CheckEntryAtMount(k, b, sources, to, box_factor, &checked);
    binding_ = nullptr;
    if (!s.ok()) return s;
    out->key_end.push_back(out->key_text.size());
    out->shape_of.push_back(shape);
    out->from_sources.push_back(static_cast<uint32_t>(served_.source_index(sources[0].first)));
    bool more = false;
    for (const auto& [source, alt] : sources) {
      used[source] = true;
      more = more || source != sources[0].first;
    }
    if (sources.size() > 1) more_parts_[static_cast<uint32_t>(i)] = sources;
    if (more) {
      out->others.resize(total);
      for (size_t p = 1; p < sources.size(); ++p)
        if (sources[p].first != sources[0].first)
          out->others[i].push_back(static_cast<uint32_t>(served_.source_index(sources[p].first)));
    }
  }
  CKPTFS_RETURN_IF_ERROR(CheckEverySourceUsed(used));
  CKPTFS_RETURN_IF_ERROR(CheckKeysDistinct(*out));
  by_key_ = {};  // the last of the key index (MakeEntry has each tensor's sources)
  CKPTFS_RETURN_IF_ERROR(AddModelFiles(dtype, files));
  return Status::OK();
}

Status Mapping::MakeEntry(size_t i, TensorEntry* out) {
  if (i >= slots_.size()) return Status::Corruption(where_, "no served tensor " + std::to_string(i));
  const size_t k = slots_[i] >> 32, b = slots_[i] & 0xFFFFFFFF;
  const Found& f = found_[k];
  std::vector<std::pair<uint32_t, uint32_t>> sources;
  if (auto it = more_parts_.find(static_cast<uint32_t>(i)); it != more_parts_.end()) sources = it->second;
  else sources.emplace_back(f.sources[b], static_cast<uint32_t>(f.alt));
  return Make(k, b, sources, Substitute(map_.rules[f.rule].to, f.At(b)), out);
}

// What a map serves, for as long as it is served: the map, the tensors it maps and the
// Mapping that makes entries from them.
struct MapState {
  KeyMap map;
  std::shared_ptr<const MapInput> input;
  std::unique_ptr<Mapping> mapping;
  std::mutex mu;  // a Mapping is not thread-safe; entries are made one at a time
};

// The shipped map named `name`, parsed.
Status LoadShippedMap(std::string_view name, KeyMap* out) {
  for (const ShippedMap& m : ShippedMaps()) {
    if (m.name != name) continue;
    CKPTFS_RETURN_IF_ERROR(ParseKeyMap(m.text, "map " + std::string(m.name), out));
    out->origin = "shipped";
    return Status::OK();
  }
  return Status::InvalidArgument("map=" + std::string(name), "no shipped map of that name (shipped: " + ShippedNames() +
                                                                 "; a map file is given by its absolute path)");
}

Status MapChoice::ReadSourceConfig(const MapInput& input, SourceConfig* out) const {
  static const ModelDescription kNone;
  const ModelDescription& model = input.catalog().model ? *input.catalog().model : kNone;
  out->config = model.Config();
  out->has_config = !out->config.empty();
  out->source = model.source.empty() ? "model_config" : model.source;
  out->family = model.family;
  // Why a config beside the weights could not be read (format/megatron/megatron_framework_config.hpp),
  // for every refusal that needed it.
  out->error = model.error;
  if (!out->has_config) out->source = out->error.empty() ? "no model_config" : "no model_config: " + out->error;
  for (const auto& [name, value] : settings_) out->config[name] = SettingValue(value);
  NormalizeModelConfig(&out->config);
  // A config that says otherwise than the stored tensors (format/megatron/megatron_tensor_facts.hpp)
  // would have the map serve a model the weights do not make; a setting of the user's decides.
  auto set_by_user = [&](const std::string& field) {
    return std::any_of(settings_.begin(), settings_.end(), [&](const auto& s) { return s.first == field; });
  };
  const std::string where = spec_ == "auto" ? "map=auto" : "map " + spec_;
  for (const auto& [field, why] : model.conflicts)
    if (!set_by_user(field))
      return Status::NotSupported(where, out->source + " disagrees with the stored tensors on " + field + ": " + why +
                                             " (give map." + field + "=VALUE to decide)");
  // The facts of the config that the tensors gave (and no setting overrode), for info.
  for (const auto& [field, fact] : model.facts)
    if (fact.origin == ModelFact::Origin::kTensors && !set_by_user(field) && out->config.contains(field))
      out->from_tensors[field] = {{"value", out->config[field]}, {"why", fact.why}};
  return Status::OK();
}

// map=auto: a config that names its family picks the map listing the longest match; among
// maps the family names equally (qwen3 and qwen3_moe for NeMo's Qwen3Model), the first whose
// auto.when holds, so the config's experts choose between the dense and the MoE map. A config
// that names none takes the first map whose auto.when holds.
Status MapChoice::ChooseShippedMap(const MapInput& input, const SourceConfig& c, KeyMap* map,
                                   std::string* reason) const {
  if (!c.has_config)
    return Status::NotSupported("map=auto", "the checkpoint has no model_config (" + input.catalog().format + " source" +
                                                (c.error.empty() ? "" : ": " + c.error) +
                                                "): name a map with map=NAME (" + ShippedNames() +
                                                ") and give its parameters with map.NAME=VALUE");
  const std::string family = c.config.contains("model_family") && c.config["model_family"].is_string()
                                 ? c.config["model_family"].get<std::string>()
                                 : c.family;
  std::vector<KeyMap> all;
  for (const ShippedMap& m : ShippedMaps()) {
    all.emplace_back();
    CKPTFS_RETURN_IF_ERROR(LoadShippedMap(m.name, &all.back()));
  }
  // Whether `candidate`'s auto.when holds for this config; *why is the evaluation's status.
  auto when_holds = [&](const KeyMap& candidate, Status* why) {
    Mapping m(candidate, c.config, "map " + candidate.name, input);
    for (const auto& [name, value] : settings_) m.Set(name, SettingValue(value));
    json v;
    *why = candidate.auto_when.Evaluate([&](std::string_view n, json* out, bool* f) { return m.Resolve(n, out, f); }, &v);
    return why->ok() && v == true;
  };
  size_t best = all.size(), best_length = 0;
  bool best_holds = false;
  if (!family.empty()) {
    const std::string f = Lower(family);
    for (size_t k = 0; k < all.size(); ++k) {
      size_t length = 0;
      for (const std::string& entry : all[k].families) {
        const std::string e = Lower(entry);
        if ((f == e || f.starts_with(e)) && e.size() > length) length = e.size();
      }
      if (length == 0) continue;
      Status why;
      const bool holds = all[k].auto_when.empty() || when_holds(all[k], &why);
      if (length > best_length || (length == best_length && holds && !best_holds))
        best = k, best_length = length, best_holds = holds;
    }
  }
  if (best < all.size()) {
    *reason = c.source + " names the family " + family;
  } else {
    std::string tried;
    for (size_t k = 0; k < all.size() && best == all.size(); ++k) {
      if (all[k].auto_when.empty()) continue;
      Status why;
      if (when_holds(all[k], &why)) {
        best = k;
        *reason = c.source + ": " + all[k].auto_why;
      } else {
        tried += (tried.empty() ? "" : "; ") + all[k].name + " needs " + all[k].auto_why +
                 (why.ok() ? "" : " (" + why.message() + ")");
      }
    }
    if (best == all.size())
      return Status::NotSupported("map=auto", "no shipped map fits the checkpoint's config (" + c.source +
                                                  (family.empty() ? "" : ", family " + family) + "): " + tried);
  }
  *map = std::move(all[best]);
  return Status::OK();
}

Status MapChoice::LoadMap(const MapInput& input, const SourceConfig& c, KeyMap* map, std::string* reason) const {
  if (spec_ == "auto") return ChooseShippedMap(input, c, map, reason);
  *reason = "given as map=" + spec_;
  if (spec_.find('/') != std::string::npos || spec_.ends_with(".json")) {
    std::string text;
    CKPTFS_RETURN_IF_ERROR(ReadMapFile(spec_, &text));
    CKPTFS_RETURN_IF_ERROR(ParseKeyMap(text, "map " + spec_, map));
    map->origin = spec_;
    return Status::OK();
  }
  return LoadShippedMap(spec_, map);
}

}  // namespace

Status ApplyKeyMap(const KeyMapRequest& request, std::shared_ptr<const MapInput> input, MappedTensors* out) {
  const MapChoice choice(request);
  MapChoice::SourceConfig c;
  CKPTFS_RETURN_IF_ERROR(choice.ReadSourceConfig(*input, &c));
  KeyMap map;
  std::string reason;
  CKPTFS_RETURN_IF_ERROR(choice.LoadMap(*input, c, &map, &reason));

  auto state = std::make_shared<MapState>();
  state->map = std::move(map);
  state->input = std::move(input);
  state->mapping = std::make_unique<Mapping>(state->map, c.config, "map " + state->map.name, *state->input);
  for (const auto& [name, value] : request.settings) state->mapping->Set(name, SettingValue(value));
  const KeyMap& used_map = state->map;
  Mapping* mapping = state->mapping.get();
  // Without a config, a map's refusal (a name it needs is unset) says why there is none.
  auto with_config_error = [&](const Status& s) {
    if (s.ok() || c.has_config || c.error.empty() || s.message().find(c.error) != std::string::npos) return s;
    return Status::NotSupported("", s.message() + " (" + c.source + ")");
  };
  // A requirement that fails on a fact the tensors gave names the tensor that gave it.
  auto with_evidence = [&](const Status& s) {
    if (s.ok()) return s;
    std::string evidence;
    for (const auto& [field, fact] : c.from_tensors.items())
      if (s.message().find(field) != std::string::npos)
        evidence += (evidence.empty() ? "" : "; ") + field + " from the tensors: " + fact["why"].get<std::string>();
    return evidence.empty() ? s : Status::NotSupported("", s.message() + " (" + evidence + ")");
  };
  CKPTFS_RETURN_IF_ERROR(with_evidence(with_config_error(mapping->CheckRequirements(c.source))));
  bool found = false;
  for (const std::string& prefix : used_map.key_prefixes)
    if ((found = mapping->FindsUnder(prefix))) break;
  if (!found) {
    std::string prefixes;
    for (const std::string& p : used_map.key_prefixes) prefixes += (prefixes.empty() ? "'" : ", '") + p + "'";
    return Status::NotSupported("map " + used_map.name, "no rule finds its source keys in the checkpoint (e.g. '" +
                                                       used_map.rules[0].parts[0].from[0].key.text + "'; key prefixes tried: " +
                                                       prefixes + ")");
  }
  CKPTFS_RETURN_IF_ERROR(with_config_error(mapping->Run(request.dtype, out, &out->files)));
  out->make = [state](size_t i, TensorEntry* entry) {
    std::lock_guard<std::mutex> lock(state->mu);
    return state->mapping->MakeEntry(i, entry);
  };
  out->record = {{"name", used_map.name},
                 {"reason", reason},
                 {"map_file", used_map.origin},
                 {"model_config_source", c.source},
                 {"model_config_from_tensors", c.from_tensors},
                 {"key_prefix", mapping->prefix()},
                 {"parameters", mapping->Parameters()}};
  return Status::OK();
}

}  // namespace ckptfs
