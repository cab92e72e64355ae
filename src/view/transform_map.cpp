// The `map=` view: a key map (doc/MAPS.md) serves new tensors made from the catalog's, each
// the boxes of rows, slices or layers of source tensors (key_map_ops.hpp), with the files
// the mapped model needs beside them (config.json). The map is data (map_spec.hpp): a shipped
// one (maps/, shipped_maps.hpp) or a file.
//
// Never a silently wrong tree: a parameter that disagrees with a tensor's shape, a source
// tensor no rule uses and the map does not ignore, a rule whose source is missing, a layer
// axis of the wrong length: each refuses the view with one line naming the tensor.
#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>

#include "io/checked_math.hpp"
#include "view/key_map_ops.hpp"
#include "view/map_expr.hpp"
#include "view/map_spec.hpp"
#include "view/model_config.hpp"
#include "view/shipped_maps.hpp"
#include "view/transform.hpp"

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

// The key `p` names for `b`, its length counted first: one allocation per served key.
std::string Substitute(const KeyPattern& p, const Binding& b) {
  std::array<std::array<char, 24>, kMaxKeyCaptures> digits;
  std::array<size_t, kMaxKeyCaptures> lengths{};
  size_t size = p.literals[0].size();
  for (size_t i = 0; i < p.names.size(); ++i) {
    const uint64_t* v = Bound(b, p.names[i]);
    if (v && i < kMaxKeyCaptures) lengths[i] = std::to_chars(digits[i].data(), digits[i].data() + 24, *v).ptr - digits[i].data();
    size += (v ? lengths[i] : p.names[i].size() + 2) + p.literals[i + 1].size();
  }
  std::string out;
  out.reserve(size);
  out += p.literals[0];
  for (size_t i = 0; i < p.names.size(); ++i) {
    if (Bound(b, p.names[i]) && i < kMaxKeyCaptures) out.append(digits[i].data(), lengths[i]);
    else out += "{" + p.names[i] + "}";
    out += p.literals[i + 1];
  }
  return out;
}



class MapTransform : public Transform {
 public:
  explicit MapTransform(const ViewOptions& options)
      : spec_(options.map), settings_(options.map_settings), dtype_(options.dtype) {}
  Status Apply(ServedTensors* served) const override;

 private:
  std::string spec_;
  std::vector<std::pair<std::string, std::string>> settings_;
  std::optional<DType> dtype_;
};

// One application of a map to one view: its names, the source keys, what it makes.
class Mapping {
 public:
  Mapping(const KeyMap& map, json config, std::string where, ServedTensors* served)
      : map_(map), config_(std::move(config)), where_(std::move(where)), served_(*served) {}

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
          if (!Matches(alt).empty()) return true;
    return false;
  }

  Status Run(std::optional<DType> dtype);
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
  struct Number {
    uint64_t value = 0;
    bool canonical = false;
  };
  static Number ToNumber(std::string_view digits) {
    Number n;
    n.canonical = CaptureNumber(digits, &n.value);
    return n;
  }

  void IndexKeys() {
    by_key_.clear();
    by_shape_.clear();
    numbers_.clear();
    std::string shape;
    std::vector<std::string_view> numbers;
    all_keys_indexed_ = false;
    for (size_t i = 0; i < served_.size(); ++i) {
      const std::string& key = served_[i].key();
      if (key.compare(0, prefix_.size(), prefix_) != 0) continue;
      const std::string_view rest = std::string_view(key).substr(prefix_.size());
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
  // save's nearly every key) are found through their numbers (Matches); they are indexed by
  // name only when a lookup first needs one.
  size_t FindKey(std::string_view key) {
    if (!all_keys_indexed_ && HasDigit(key)) {
      for (const auto& [shape, entries] : by_shape_)
        for (const Indexed& entry : entries)
          by_key_.emplace(std::string_view(served_[entry.index].key()).substr(prefix_.size()), entry.index);
      all_keys_indexed_ = true;
    }
    auto it = by_key_.find(key);
    return it == by_key_.end() ? SIZE_MAX : it->second;
  }

  // The tensors `alt`'s key matches, with the captures they give (unstacked names not yet).
  std::vector<std::pair<size_t, Binding>> Matches(const MapSource& alt) {
    std::vector<std::pair<size_t, Binding>> out;
    const KeyPattern& p = alt.key;
    // A key without digits by name; one with digits (`linear_fc1`) through its numbers too.
    if (p.names.empty() && !HasDigit(p.text)) {
      if (const size_t i = FindKey(p.text); i != SIZE_MAX) out.emplace_back(i, Binding{});
      return out;
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
    if (it == by_shape_.end()) return out;
    for (const Indexed& entry : it->second) {
      if (entry.count != slot_name.size()) continue;
      const Number* numbers = &numbers_[entry.first_number];
      Binding b;
      bool ok = true;
      for (size_t k = 0; ok && k < slot_name.size(); ++k) {
        if (!numbers[k].canonical) {
          ok = false;
        } else if (slot_name[k] < 0) {
          ok = numbers[k].value == literal_numbers[k].value && literal_numbers[k].canonical;
        } else {
          const std::string& name = p.names[slot_name[k]];
          if (const uint64_t* prior = Bound(b, name)) ok = *prior == numbers[k].value;
          else b.emplace_back(name, numbers[k].value);
        }
      }
      if (ok) out.emplace_back(entry.index, std::move(b));
    }
    return out;
  }

  // Tensor i as boxes of its rank, into *out, with its first `unstack` index selected when
  // there is one (`index`). Those of many boxes (a stacked tensor's chunks, one layer taken at
  // a time) are made once and kept, and a selection copies only the boxes of its index.
  Status Boxed(size_t i, const uint64_t* index, BoxedTensor* out, std::string* why, bool* selected) {
    const TensorEntry& t = served_[i].stored;
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

  // Every binding rule part `part` gives: its first alternative that finds a tensor.
  Status Enumerate(const MapRule& rule, std::vector<Binding>* out, std::vector<uint32_t>* sources, size_t* alt_used) {
    const MapPart& part = rule.parts[0];
    out->clear();
    sources->clear();
    for (size_t a = 0; a < part.from.size(); ++a) {
      const MapSource& alt = part.from[a];
      *alt_used = a;
      for (auto& [i, b] : Matches(alt)) {
        // The unstacked dimensions' indices, outermost first.
        const Shape& shape = served_[i].shape();
        if (shape.size() < alt.unstack.size())
          return Status::NotSupported(where_, "'" + served_[i].key() + "' of shape " + ShapeText(shape) + " has fewer than " +
                                                  std::to_string(alt.unstack.size()) + " dimensions to unstack");
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
          if (!CheckedMul(made, shape[d], &made) || made > kMaxTensorsPerRule - std::min<uint64_t>(out->size(), kMaxTensorsPerRule))
            return Status::NotSupported(where_, "'" + served_[i].key() + "' of shape " + ShapeText(shape) +
                                                    ": unstacking it makes more than " + std::to_string(kMaxTensorsPerRule) +
                                                    " tensors");
        }
        if (alt.unstack.empty()) {
          out->push_back(b);
          sources->push_back(static_cast<uint32_t>(i));
          continue;
        }
        std::vector<Binding> level{b};
        for (size_t d = 0; d < alt.unstack.size(); ++d) {
          std::vector<Binding> next;
          for (const Binding& partial : level)
            for (uint64_t k = 0; k < shape[d]; ++k) {
              next.push_back(partial);
              next.back().emplace_back(alt.unstack[d], k);
            }
          level = std::move(next);
        }
        for (Binding& full : level) {
          out->push_back(std::move(full));
          sources->push_back(static_cast<uint32_t>(i));
        }
      }
      if (!out->empty()) return Status::OK();
    }
    return Status::OK();
  }

  // The tensor part `part` gives for `binding`: its source and its boxes after the ops.
  // `known`: the source tensor when the enumeration found it (part 0) through alternative
  // `known_alt`, else SIZE_MAX.
  Status MakePart(const MapPart& part, const MapRule& rule, const Binding& binding, const std::string& to, size_t known,
                  size_t known_alt, size_t* source, BoxedTensor* out) {
    const MapSource* found = nullptr;
    if (known != SIZE_MAX) {
      found = &part.from[known_alt];
      *source = known;
    }
    for (size_t a = 0; !found && a < part.from.size(); ++a) {
      const size_t i = FindKey(Substitute(part.from[a].key, binding));
      if (i == SIZE_MAX) continue;
      found = &part.from[a];
      *source = i;
    }
    if (!found)
      return Status::NotSupported(where_, "'" + to + "' needs '" + prefix_ + Substitute(part.from[0].key, binding) +
                                              "', which the checkpoint does not have");
    // Messages are made only for a refusal: this runs once per served tensor.
    auto what = [&] { return "'" + served_[*source].key() + "' (for '" + to + "')"; };
    std::string why;
    bool selected = false;
    Status boxed = Boxed(*source, found->unstack.empty() ? nullptr : Bound(binding, found->unstack[0]), out, &why, &selected);
    if (!boxed.ok() && selected) return Status::NotSupported(where_, what() + ": " + why);
    CKPTFS_RETURN_IF_ERROR(boxed);
    for (size_t u = selected ? 1 : 0; u < found->unstack.size(); ++u)
      if (!SelectIndex(out, 0, *Bound(binding, found->unstack[u]), &why))
        return Status::NotSupported(where_, what() + ": " + why);
    if (!rule.source_shape.empty()) {
      Shape expected;
      CKPTFS_RETURN_IF_ERROR(Dims(rule.source_shape, rule.where, ".source_shape", &expected));
      if (expected != out->shape)
        return Status::NotSupported(where_, what() + " has shape " + ShapeText(out->shape) + ", the map's parameters give [" +
                                                Texts(rule.source_shape) + "] = " + ShapeText(expected));
    }
    for (size_t k = 0; k < part.ops.size(); ++k) {
      const MapOp& op = part.ops[k];
      auto field = [&](const char* name) {
        return [&rule, k, name] { return rule.where + " op " + std::to_string(k) + "." + name; };
      };
      uint64_t index = 0, start = 0, stop = 0, groups = 0, size = 0;
      bool ok = true;
      switch (op.kind) {
        case MapOp::Kind::kSelect:
          CKPTFS_RETURN_IF_ERROR(Count(op.index, field("index"), &index));
          ok = SelectIndex(out, op.dim, index, &why);
          break;
        case MapOp::Kind::kSlice:
          CKPTFS_RETURN_IF_ERROR(Count(op.start, field("start"), &start));
          CKPTFS_RETURN_IF_ERROR(Count(op.stop, field("stop"), &stop));
          ok = SliceDim(out, op.dim, start, stop, &why);
          break;
        case MapOp::Kind::kRowGroups:
          CKPTFS_RETURN_IF_ERROR(Count(op.groups, field("groups"), &groups));
          CKPTFS_RETURN_IF_ERROR(Count(op.size, field("size"), &size));
          CKPTFS_RETURN_IF_ERROR(Count(op.start, field("start"), &start));
          CKPTFS_RETURN_IF_ERROR(Count(op.stop, field("stop"), &stop));
          ok = RowGroups(out, op.dim, groups, size, start, stop, &why);
          break;
        case MapOp::Kind::kTranspose: ok = Transpose(out, op.dim, op.dim2, &why); break;
      }
      if (!ok) return Status::NotSupported(where_, what() + ": " + why);
    }
    return Status::OK();
  }

  Status CheckCaptures(const MapRule& rule, const std::vector<Binding>& bindings);
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

  const KeyMap& map_;
  json config_;
  std::string where_;
  ServedTensors& served_;
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
  // Source tensors of many boxes as boxes of their rank, with their order along the layer axis.
  struct Kept {
    BoxedTensor boxed;
    BoxOrder order;
  };
  std::unordered_map<size_t, Kept> boxed_;
  BoxedTensor scratch_;
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

Status Mapping::CheckCaptures(const MapRule& rule, const std::vector<Binding>& bindings) {
  // Each declared capture takes every value of [0, count) and no other; together they make
  // every combination once (a layer without one of its experts is refused, never served short).
  uint64_t combinations = 1;
  size_t declared = 0;
  for (const auto& [name, count_expr] : map_.captures) {
    if (bindings.empty() || !Bound(bindings[0], name)) continue;
    ++declared;
    uint64_t count = 0;
    CKPTFS_RETURN_IF_ERROR(Count(count_expr, "captures." + name, &count));
    // The distinct values, in order (a sorted vector: one per served tensor of the rule).
    std::vector<uint64_t> seen;
    seen.reserve(bindings.size());
    for (const Binding& b : bindings) seen.push_back(*Bound(b, name));
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    if (seen.size() != count || (count > 0 && *seen.rbegin() != count - 1))
      return CaptureRefusal(rule, name, seen.size(), seen.empty() ? 0 : *seen.begin(), seen.empty() ? 0 : *seen.rbegin(),
                            count_expr, count);
    if (!CheckedMul(combinations, count, &combinations)) combinations = UINT64_MAX;
  }
  // Bindings are distinct (one per source key or unstacked index): with every bound name a
  // declared capture, as many as the combinations means each combination is there.
  if (!bindings.empty() && declared == bindings[0].count && bindings.size() != combinations) {
    std::string names;
    for (const auto& [n, v] : bindings[0]) names += (names.empty() ? "" : ", ") + std::string(n);
    return Status::NotSupported(where_, "'" + rule.to.text + "' from '" + prefix_ + rule.parts[0].from[0].key.text +
                                            "': the checkpoint has " + std::to_string(bindings.size()) + " of the " +
                                            std::to_string(combinations) + " combinations of " + names +
                                            " the map expects (a layer without one of its tensors)");
  }
  return Status::OK();
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

Status Mapping::Run(std::optional<DType> dtype) {
  using Order = std::array<uint64_t, 3 + kMaxKeyCaptures>;
  std::vector<bool> used(served_.size(), false);
  // The rules in use and what each finds, first: every served tensor is counted before one is
  // made, so the entries are allocated once.
  struct Found {
    size_t rule = 0, alt = 0;
    std::vector<Binding> bindings;
    std::vector<uint32_t> sources;
  };
  std::vector<Found> found;
  size_t total = 0;
  for (size_t r = 0; r < map_.rules.size(); ++r) {
    const MapRule& rule = map_.rules[r];
    if (!rule.when.empty()) {
      bool when = false;
      CKPTFS_RETURN_IF_ERROR(Bool(rule.when, rule.where + ".when", &when));
      if (!when) continue;
    }
    Found f;
    f.rule = r;
    CKPTFS_RETURN_IF_ERROR(Enumerate(rule, &f.bindings, &f.sources, &f.alt));
    if (f.bindings.empty())
      return Status::NotSupported(where_, "'" + rule.to.text + "' needs '" + prefix_ + rule.parts[0].from[0].key.text +
                                              "', which the checkpoint does not have");
    CKPTFS_RETURN_IF_ERROR(CheckCaptures(rule, f.bindings));
    total += f.bindings.size();
    found.push_back(std::move(f));
  }
  // Sections of the served order: runs of rules whose first capture is the same; blocks
  // within them: runs of rules with the same captures. Served in order of section, first
  // capture, block, further captures, rule: per layer, each expert's tensors together.
  std::vector<uint64_t> section_of(map_.rules.size(), 0), block_of(map_.rules.size(), 0);
  for (size_t r = 1; r < map_.rules.size(); ++r) {
    const auto& prev = map_.rules[r - 1].to.names;
    const auto& cur = map_.rules[r].to.names;
    section_of[r] = section_of[r - 1] + ((prev.empty() ? "" : prev[0]) != (cur.empty() ? "" : cur[0]));
    block_of[r] = block_of[r - 1] + (prev != cur);
  }
  // Where each served tensor goes, known from its rule and binding alone: the entries are
  // then made once, in the served order.
  struct Slot {
    Order order;
    uint32_t found, binding;
  };
  std::vector<Slot> slots;
  slots.reserve(total);
  for (size_t k = 0; k < found.size(); ++k) {
    const MapRule& rule = map_.rules[found[k].rule];
    const auto& names = rule.to.names;
    for (size_t b = 0; b < found[k].bindings.size(); ++b) {
      const Binding& binding = found[k].bindings[b];
      Slot slot{};
      slot.order[0] = section_of[found[k].rule];
      slot.order[1] = names.empty() ? 0 : *Bound(binding, names[0]);
      slot.order[2] = block_of[found[k].rule];
      for (size_t n = 1; n < names.size(); ++n) slot.order[2 + n] = *Bound(binding, names[n]);
      slot.order[2 + std::max<size_t>(names.size(), 1)] = found[k].rule;
      slot.found = static_cast<uint32_t>(k);
      slot.binding = static_cast<uint32_t>(b);
      slots.push_back(slot);
    }
  }
  std::stable_sort(slots.begin(), slots.end(), [](const Slot& x, const Slot& y) { return x.order < y.order; });
  std::vector<TensorEntry> entries;
  std::vector<uint32_t> from;
  std::vector<std::vector<uint32_t>> others;
  entries.reserve(total);
  from.reserve(total);
  std::vector<BoxedTensor> parts;
  std::vector<size_t> sources;
  BoxedTensor result;
  std::string why, to;
  for (const Slot& slot : slots) {
    const Found& f = found[slot.found];
    const MapRule& rule = map_.rules[f.rule];
    parts.resize(rule.parts.size());
    sources.resize(rule.parts.size());
    const Binding& binding = f.bindings[slot.binding];
    binding_ = &binding;
    to = Substitute(rule.to, binding);
    Status s;
    for (size_t p = 0; s.ok() && p < rule.parts.size(); ++p) {
      s = MakePart(rule.parts[p], rule, binding, to, p == 0 ? f.sources[slot.binding] : SIZE_MAX, f.alt, &sources[p],
                   &parts[p]);
      if (s.ok()) used[sources[p]] = true;
    }
    if (s.ok() && rule.concat) {
      for (size_t p = 1; s.ok() && p < parts.size(); ++p)
        if (served_[sources[p]].stored.dtype != served_[sources[0]].stored.dtype)
          s = Status::NotSupported(where_, "'" + to + "': concat of '" + served_[sources[0]].key() + "' and '" +
                                               served_[sources[p]].key() + "', of different dtypes");
      if (s.ok() && !Concat(parts, rule.concat_dim, &result, &why)) s = Status::NotSupported(where_, "'" + to + "': " + why);
    } else if (s.ok()) {
      std::swap(result, parts[0]);
    }
    if (s.ok() && !rule.shape.empty()) {
      Shape expected;
      s = Dims(rule.shape, rule.where, ".shape", &expected);
      if (s.ok() && expected != result.shape)
        s = Status::NotSupported(where_, "'" + to + "' from '" + served_[sources[0]].key() + "' has shape " +
                                             ShapeText(result.shape) + ", the map's parameters give [" + Texts(rule.shape) +
                                             "] = " + ShapeText(expected));
    }
    binding_ = nullptr;
    if (!s.ok()) return s;
    const TensorEntry& source = served_[sources[0]].stored;
    TensorEntry& entry = entries.emplace_back();
    entry.key = std::move(to);
    to = std::string();
    entry.path = source.path;
    entry.dtype = source.dtype;
    entry.shape = std::move(result.shape);
    entry.boxes = BoxList(std::move(result.boxes));
    result.boxes.clear();  // its capacity serves the next tensor
    from.push_back(static_cast<uint32_t>(served_.source_index(sources[0])));
    bool more = false;
    for (size_t p = 1; p < sources.size(); ++p) more = more || sources[p] != sources[0];
    if (more) {
      others.resize(entries.size());
      for (size_t p = 1; p < sources.size(); ++p)
        if (sources[p] != sources[0]) others.back().push_back(static_cast<uint32_t>(served_.source_index(sources[p])));
    }
  }
  others.resize(others.empty() ? 0 : entries.size());
  slots = std::vector<Slot>();
  found = std::vector<Found>();
  // Every source tensor is used or ignored on purpose.
  for (size_t i = 0; i < served_.size(); ++i) {
    if (used[i]) continue;
    const std::string& key = served_[i].key();
    const std::string_view rest =
        key.compare(0, prefix_.size(), prefix_) == 0 ? std::string_view(key).substr(prefix_.size()) : std::string_view(key);
    bool ignored = false;
    for (const std::string& glob : map_.ignore) ignored = ignored || GlobMatch(glob, rest) || GlobMatch(glob, key);
    if (!ignored)
      return Status::NotSupported(where_, "tensor '" + key + "' " + ShapeText(served_[i].shape()) +
                                              " is used by no rule of the map and not ignored by it: the map does not "
                                              "describe this checkpoint");
  }
  if (std::optional<size_t> twice = FindRepeatedKey(entries))
    return Status::NotSupported(where_, "two rules serve the key '" + entries[*twice].key + "'");
  // What config.json says of the dtype: the type the first tensor is served in.
  if (!entries.empty()) {
    DType d = entries[0].dtype;
    if (dtype && Info(d).is_float && d != DType::kF4x2) d = *dtype;
    served_dtype_ = std::string(Info(d).torch_name);
  }
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& [name, templ] : {std::pair<const char*, const json*>{"config.json", &map_.config},
                                    std::pair<const char*, const json*>{"generation_config.json", &map_.generation_config}}) {
    if (templ->is_null()) continue;
    json content;
    bool keep = true;
    CKPTFS_RETURN_IF_ERROR(MakeFile(*templ, name == std::string("config.json") ? "config" : "generation_config", &content, &keep));
    files.emplace_back(name, content.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
  }
  served_.ReplaceFromSources(std::move(entries), std::move(from), std::move(others));
  for (auto& [name, content] : files) served_.AddFile(name, std::move(content));
  return Status::OK();
}

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

Status MapTransform::Apply(ServedTensors* served) const {
  const json& metadata = served->source().metadata;
  json config = metadata.is_object() && metadata.contains("model_config") && metadata["model_config"].is_object()
                    ? metadata["model_config"]
                    : json::object();
  const bool has_config = !config.empty();
  std::string config_source = metadata.is_object() && metadata.contains("model_config_source") &&
                                      metadata["model_config_source"].is_string()
                                  ? metadata["model_config_source"].get<std::string>()
                                  : "model_config";
  // Why a config beside the weights could not be read (format/megatron_framework_config.hpp),
  // for every refusal that needed it.
  const std::string config_error = metadata.is_object() && metadata.contains("model_config_error") &&
                                           metadata["model_config_error"].is_string()
                                       ? metadata["model_config_error"].get<std::string>()
                                       : "";
  if (!has_config) config_source = config_error.empty() ? "no model_config" : "no model_config: " + config_error;
  for (const auto& [name, value] : settings_) config[name] = SettingValue(value);
  NormalizeModelConfig(&config);
  auto make = [&](const KeyMap& map) {
    auto m = std::make_unique<Mapping>(map, config, "map " + map.name, served);
    for (const auto& [name, value] : settings_) m->Set(name, SettingValue(value));
    return m;
  };

  KeyMap map;
  std::string reason;
  if (spec_ == "auto") {
    if (!has_config)
      return Status::NotSupported("map=auto", "the checkpoint has no model_config (" + served->source().format + " source" +
                                                  (config_error.empty() ? "" : ": " + config_error) +
                                                  "): name a map with map=NAME (" + ShippedNames() +
                                                  ") and give its parameters with map.NAME=VALUE");
    const std::string family = config.contains("model_family") && config["model_family"].is_string()
                                   ? config["model_family"].get<std::string>()
                                   : metadata.value("model_family", json()).is_string() ? metadata["model_family"].get<std::string>() : "";
    std::vector<KeyMap> all;
    for (const ShippedMap& m : ShippedMaps()) {
      all.emplace_back();
      CKPTFS_RETURN_IF_ERROR(LoadShippedMap(m.name, &all.back()));
    }
    // A config that names its family picks the map listing the longest match; among maps
    // the family names equally (qwen3 and qwen3_moe for NeMo's Qwen3Model), the first whose
    // auto.when holds, so the config's experts choose between the dense and the MoE map.
    // Whether `candidate`'s auto.when holds for this config; *why is the evaluation's status.
    auto when_holds = [&](const KeyMap& candidate, Status* why) {
      auto m = make(candidate);
      json v;
      *why = candidate.auto_when.Evaluate([&](std::string_view n, json* out, bool* f) { return m->Resolve(n, out, f); }, &v);
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
      reason = config_source + " names the family " + family;
    } else {
      std::string tried;
      for (size_t k = 0; k < all.size() && best == all.size(); ++k) {
        if (all[k].auto_when.empty()) continue;
        Status why;
        if (when_holds(all[k], &why)) {
          best = k;
          reason = config_source + ": " + all[k].auto_why;
        } else {
          tried += (tried.empty() ? "" : "; ") + all[k].name + " needs " + all[k].auto_why +
                   (why.ok() ? "" : " (" + why.message() + ")");
        }
      }
      if (best == all.size())
        return Status::NotSupported("map=auto", "no shipped map fits the checkpoint's config (" + config_source +
                                                    (family.empty() ? "" : ", family " + family) + "): " + tried);
    }
    map = std::move(all[best]);
  } else if (spec_.find('/') != std::string::npos || spec_.ends_with(".json")) {
    std::string text;
    CKPTFS_RETURN_IF_ERROR(ReadMapFile(spec_, &text));
    CKPTFS_RETURN_IF_ERROR(ParseKeyMap(text, "map " + spec_, &map));
    map.origin = spec_;
    reason = "given as map=" + spec_;
  } else {
    CKPTFS_RETURN_IF_ERROR(LoadShippedMap(spec_, &map));
    reason = "given as map=" + spec_;
  }

  auto mapping = make(map);
  // Without a config, a map's refusal (a name it needs is unset) says why there is none.
  auto with_config_error = [&](const Status& s) {
    if (s.ok() || has_config || config_error.empty() || s.message().find(config_error) != std::string::npos) return s;
    return Status::NotSupported("", s.message() + " (" + config_source + ")");
  };
  CKPTFS_RETURN_IF_ERROR(with_config_error(mapping->CheckRequirements(config_source)));
  bool found = false;
  for (const std::string& prefix : map.key_prefixes)
    if ((found = mapping->FindsUnder(prefix))) break;
  if (!found) {
    std::string prefixes;
    for (const std::string& p : map.key_prefixes) prefixes += (prefixes.empty() ? "'" : ", '") + p + "'";
    return Status::NotSupported("map " + map.name, "no rule finds its source keys in the checkpoint (e.g. '" +
                                                       map.rules[0].parts[0].from[0].key.text + "'; key prefixes tried: " +
                                                       prefixes + ")");
  }
  CKPTFS_RETURN_IF_ERROR(with_config_error(mapping->Run(dtype_)));
  json record = {{"name", map.name},
                 {"reason", reason},
                 {"map_file", map.origin},
                 {"model_config_source", config_source},
                 {"key_prefix", mapping->prefix()},
                 {"parameters", mapping->Parameters()}};
  (*served->mutable_manifest_fields())["map"] = std::move(record);
  return Status::OK();
}

}  // namespace

std::unique_ptr<Transform> MakeMapTransform(const ViewOptions& options) {
  if (options.map.empty() || options.map == "none") return nullptr;
  return std::make_unique<MapTransform>(options);
}

}  // namespace ckptfs
