// Reading a key map's JSON (map_spec.hpp). Unknown fields, wrong types and oversized
// entries are refused by name: a map is code-like input, and a typo must not silently drop a rule.
#include "map/map_spec.hpp"

#include <cctype>
#include <set>

namespace ckptfs {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxMapBytes = size_t{1} << 20;
constexpr size_t kMaxEntries = 10000;
constexpr size_t kMaxKey = 1000;
constexpr size_t kMaxRank = 16;

class SpecReader {
 public:
  explicit SpecReader(std::string where) : where_(std::move(where)) {}

  Status Bad(const std::string& entry, const std::string& what) const {
    return Status::InvalidArgument(where_, entry + ": " + what);
  }

  Status Read(const json& doc, KeyMap* m) {
    if (!doc.is_object()) return Status::InvalidArgument(where_, "not a JSON object");
    static const std::set<std::string> kFields = {"ckptfs_map", "name", "description", "key_prefixes", "parameters",
                                                  "captures", "requires", "auto", "families", "tensors", "ignore",
                                                  "config", "generation_config"};
    for (auto it = doc.begin(); it != doc.end(); ++it)
      if (!kFields.count(it.key())) return Bad(it.key(), "not a field of a map (doc/MAPS.md)");
    if (!doc.contains("ckptfs_map") || doc["ckptfs_map"] != 1) return Bad("ckptfs_map", "must be 1 (the language's version)");
    CKPTFS_RETURN_IF_ERROR(String(doc, "name", true, &m->name));
    CKPTFS_RETURN_IF_ERROR(String(doc, "description", false, &m->description));
    if (doc.contains("key_prefixes")) {
      CKPTFS_RETURN_IF_ERROR(Strings(doc["key_prefixes"], "key_prefixes", &m->key_prefixes));
      if (m->key_prefixes.empty()) return Bad("key_prefixes", "is empty");
    }
    if (doc.contains("parameters")) CKPTFS_RETURN_IF_ERROR(Named(doc["parameters"], "parameters", &m->parameters));
    if (doc.contains("captures")) CKPTFS_RETURN_IF_ERROR(Named(doc["captures"], "captures", &m->captures));
    if (doc.contains("requires")) {
      const json& r = doc["requires"];
      if (!r.is_array() || r.size() > kMaxEntries) return Bad("requires", "not a list");
      for (size_t i = 0; i < r.size(); ++i) {
        const std::string at = "requires[" + std::to_string(i) + "]";
        if (!r[i].is_object() || !r[i].contains("check") || r[i].size() > 2) return Bad(at, "needs {\"check\": EXPR, \"why\": TEXT}");
        KeyMap::Requirement q;
        CKPTFS_RETURN_IF_ERROR(Expression(r[i]["check"], at + ".check", &q.check));
        CKPTFS_RETURN_IF_ERROR(String(r[i], "why", false, &q.why, at));
        m->requires_.push_back(std::move(q));
      }
    }
    if (doc.contains("auto")) {
      const json& a = doc["auto"];
      if (!a.is_object() || !a.contains("when")) return Bad("auto", "needs {\"when\": EXPR, \"why\": TEXT}");
      for (auto it = a.begin(); it != a.end(); ++it)
        if (it.key() != "when" && it.key() != "why") return Bad("auto." + it.key(), "not a field of auto");
      CKPTFS_RETURN_IF_ERROR(Expression(a["when"], "auto.when", &m->auto_when));
      CKPTFS_RETURN_IF_ERROR(String(a, "why", false, &m->auto_why, "auto"));
    }
    if (doc.contains("families")) CKPTFS_RETURN_IF_ERROR(Strings(doc["families"], "families", &m->families));
    if (doc.contains("ignore")) CKPTFS_RETURN_IF_ERROR(Strings(doc["ignore"], "ignore", &m->ignore));
    if (!doc.contains("tensors") || !doc["tensors"].is_array() || doc["tensors"].empty() ||
        doc["tensors"].size() > kMaxEntries)
      return Bad("tensors", "needs a list of rules (at most " + std::to_string(kMaxEntries) + ")");
    for (size_t i = 0; i < doc["tensors"].size(); ++i) {
      MapRule rule;
      CKPTFS_RETURN_IF_ERROR(Rule(doc["tensors"][i], "tensors[" + std::to_string(i) + "]", &rule));
      m->rules.push_back(std::move(rule));
    }
    for (const char* name : {"config", "generation_config"}) {
      if (!doc.contains(name)) continue;
      if (!doc[name].is_object()) return Bad(name, "not an object");
      CKPTFS_RETURN_IF_ERROR(Template(doc[name], name));
    }
    if (doc.contains("config")) m->config = doc["config"];
    if (doc.contains("generation_config")) m->generation_config = doc["generation_config"];
    return Status::OK();
  }

 private:
  Status String(const json& obj, const char* field, bool required, std::string* out, const std::string& at = "") {
    const std::string entry = at.empty() ? field : at + "." + field;
    if (!obj.contains(field)) return required ? Bad(entry, "missing") : Status::OK();
    if (!obj[field].is_string() || obj[field].get_ref<const std::string&>().size() > kMaxKey)
      return Bad(entry, "not a text of at most " + std::to_string(kMaxKey) + " characters");
    *out = obj[field].get<std::string>();
    return Status::OK();
  }

  Status Strings(const json& v, const std::string& entry, std::vector<std::string>* out) {
    if (!v.is_array() || v.size() > kMaxEntries) return Bad(entry, "not a list of texts");
    out->clear();
    for (const json& s : v) {
      if (!s.is_string() || s.get_ref<const std::string&>().size() > kMaxKey) return Bad(entry, "not a list of texts");
      out->push_back(s.get<std::string>());
    }
    return Status::OK();
  }

  static bool IsName(std::string_view s) {
    if (s.empty() || s.size() > 64 || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
    for (char c : s)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
    return true;
  }

  Status Named(const json& v, const std::string& entry, std::vector<std::pair<std::string, Expr>>* out) {
    if (!v.is_object() || v.size() > kMaxEntries) return Bad(entry, "not an object of NAME: EXPR");
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!IsName(it.key())) return Bad(entry + "." + it.key(), "not a name (letters, digits, '_')");
      Expr e;
      CKPTFS_RETURN_IF_ERROR(Expression(it.value(), entry + "." + it.key(), &e));
      out->emplace_back(it.key(), std::move(e));
    }
    return Status::OK();
  }

  // An expression: a text, or a JSON integer or boolean as a constant.
  Status Expression(const json& v, const std::string& entry, Expr* out) {
    if (v.is_number_integer() || v.is_boolean()) {
      *out = Expr::Constant(v);
      return Status::OK();
    }
    if (!v.is_string()) return Bad(entry, "not an expression (a text, an integer or a boolean)");
    Status s = Expr::Parse(v.get<std::string>(), out);
    if (!s.ok()) return Bad(entry, s.message());
    return Status::OK();
  }

  Status Dim(const json& op, const char* field, const std::string& entry, size_t* out) {
    if (!op.contains(field) || !op[field].is_number_unsigned() || op[field].get<uint64_t>() >= kMaxRank)
      return Bad(entry + "." + field, "needs a dimension number below " + std::to_string(kMaxRank));
    *out = op[field].get<size_t>();
    return Status::OK();
  }

  Status Pattern(const std::string& text, const std::string& entry, KeyPattern* out) {
    if (text.empty() || text.size() > kMaxKey) return Bad(entry, "a key of 1 to " + std::to_string(kMaxKey) + " characters");
    out->text = text;
    out->literals.assign(1, "");
    out->names.clear();
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] == '}') return Bad(entry, "'}' without '{' in '" + text + "'");
      if (text[i] != '{') {
        out->literals.back() += text[i];
        continue;
      }
      const size_t close = text.find('}', i);
      if (close == std::string::npos) return Bad(entry, "'{' without '}' in '" + text + "'");
      const std::string name = text.substr(i + 1, close - i - 1);
      if (!IsName(name)) return Bad(entry, "'{" + name + "}' is not a capture name");
      // A capture is a whole number: no digit or capture right before it (nor after, below).
      const std::string& before = out->literals.back();
      if ((!out->names.empty() && before.empty()) || (!before.empty() && std::isdigit(static_cast<unsigned char>(before.back()))) ||
          (close + 1 < text.size() && (std::isdigit(static_cast<unsigned char>(text[close + 1])) || text[close + 1] == '{')))
        return Bad(entry, "a capture in '" + text + "' touches a digit or another capture");
      out->names.push_back(name);
      out->literals.emplace_back();
      i = close;
    }
    return Status::OK();
  }

  Status Source(const json& v, const std::string& entry, MapSource* out) {
    if (!v.is_string()) return Bad(entry, "not a key");
    std::string text = v.get<std::string>();
    // Trailing [NAME] suffixes: leading dimensions unstacked, outermost first.
    std::vector<std::string> unstack;
    while (!text.empty() && text.back() == ']') {
      const size_t open = text.rfind('[');
      if (open == std::string::npos) return Bad(entry, "']' without '['");
      const std::string name = text.substr(open + 1, text.size() - open - 2);
      if (!IsName(name)) return Bad(entry, "'[" + name + "]' is not a capture name");
      unstack.insert(unstack.begin(), name);
      text.resize(open);
    }
    CKPTFS_RETURN_IF_ERROR(Pattern(text, entry, &out->key));
    out->unstack = std::move(unstack);
    if (out->key.names.size() + out->unstack.size() > kMaxKeyCaptures)
      return Bad(entry, "more than " + std::to_string(kMaxKeyCaptures) + " captures and unstacked dimensions");
    for (const std::string& n : out->unstack)
      for (const std::string& k : out->key.names)
        if (n == k) return Bad(entry, "'" + n + "' is both captured and unstacked");
    return Status::OK();
  }

  Status Op(const json& op, const std::string& entry, MapOp* out) {
    if (!op.is_object() || !op.contains("op") || !op["op"].is_string()) return Bad(entry, "needs {\"op\": NAME, ...}");
    const std::string kind = op["op"];
    std::set<std::string> fields;
    if (kind == "select") {
      out->kind = MapOp::Kind::kSelect;
      fields = {"op", "dim", "index"};
    } else if (kind == "slice") {
      out->kind = MapOp::Kind::kSlice;
      fields = {"op", "dim", "start", "stop"};
    } else if (kind == "row_groups") {
      out->kind = MapOp::Kind::kRowGroups;
      fields = {"op", "dim", "groups", "size", "start", "stop"};
    } else if (kind == "transpose") {
      out->kind = MapOp::Kind::kTranspose;
      fields = {"op", "dims"};
    } else {
      return Bad(entry + ".op", "'" + kind + "' is not select, slice, row_groups or transpose");
    }
    for (auto it = op.begin(); it != op.end(); ++it)
      if (!fields.count(it.key())) return Bad(entry + "." + it.key(), "not a field of " + kind);
    for (const std::string& f : fields)
      if (!op.contains(f)) return Bad(entry + "." + f, "missing");
    if (out->kind == MapOp::Kind::kTranspose) {
      const json& d = op["dims"];
      if (!d.is_array() || d.size() != 2 || !d[0].is_number_unsigned() || !d[1].is_number_unsigned() ||
          d[0].get<uint64_t>() >= kMaxRank || d[1].get<uint64_t>() >= kMaxRank)
        return Bad(entry + ".dims", "needs two dimension numbers");
      out->dim = d[0].get<size_t>();
      out->dim2 = d[1].get<size_t>();
      return Status::OK();
    }
    CKPTFS_RETURN_IF_ERROR(Dim(op, "dim", entry, &out->dim));
    if (op.contains("index")) CKPTFS_RETURN_IF_ERROR(Expression(op["index"], entry + ".index", &out->index));
    if (op.contains("start")) CKPTFS_RETURN_IF_ERROR(Expression(op["start"], entry + ".start", &out->start));
    if (op.contains("stop")) CKPTFS_RETURN_IF_ERROR(Expression(op["stop"], entry + ".stop", &out->stop));
    if (op.contains("groups")) CKPTFS_RETURN_IF_ERROR(Expression(op["groups"], entry + ".groups", &out->groups));
    if (op.contains("size")) CKPTFS_RETURN_IF_ERROR(Expression(op["size"], entry + ".size", &out->size));
    return Status::OK();
  }

  Status Part(const json& v, const std::string& entry, MapPart* out) {
    const json& from = v["from"];
    if (from.is_string()) {
      out->from.emplace_back();
      CKPTFS_RETURN_IF_ERROR(Source(from, entry + ".from", &out->from.back()));
    } else if (from.is_array() && !from.empty() && from.size() <= 16) {
      for (size_t i = 0; i < from.size(); ++i) {
        out->from.emplace_back();
        CKPTFS_RETURN_IF_ERROR(Source(from[i], entry + ".from[" + std::to_string(i) + "]", &out->from.back()));
      }
    } else {
      return Bad(entry + ".from", "needs a key or a list of 1 to 16 keys");
    }
    if (v.contains("ops")) {
      if (!v["ops"].is_array() || v["ops"].size() > 64) return Bad(entry + ".ops", "not a list of at most 64 ops");
      for (size_t i = 0; i < v["ops"].size(); ++i) {
        out->ops.emplace_back();
        CKPTFS_RETURN_IF_ERROR(Op(v["ops"][i], entry + ".ops[" + std::to_string(i) + "]", &out->ops.back()));
      }
    }
    return Status::OK();
  }

  // The capture names a part binds (the same in each of its alternatives).
  Status Binds(const MapPart& part, const std::string& entry, std::set<std::string>* names) {
    for (size_t i = 0; i < part.from.size(); ++i) {
      std::set<std::string> these(part.from[i].key.names.begin(), part.from[i].key.names.end());
      these.insert(part.from[i].unstack.begin(), part.from[i].unstack.end());
      if (i == 0) *names = these;
      else if (these != *names) return Bad(entry + ".from", "its alternatives capture different names");
    }
    return Status::OK();
  }

  Status Rule(const json& v, const std::string& entry, MapRule* out) {
    out->where = entry;
    if (!v.is_object()) return Bad(entry, "not an object");
    for (auto it = v.begin(); it != v.end(); ++it)
      if (it.key() != "to" && it.key() != "from" && it.key() != "ops" && it.key() != "concat" && it.key() != "when" &&
          it.key() != "shape" && it.key() != "source_shape")
        return Bad(entry + "." + it.key(), "not a field of a rule");
    if (!v.contains("to") || !v["to"].is_string()) return Bad(entry + ".to", "needs the served key");
    CKPTFS_RETURN_IF_ERROR(Pattern(v["to"].get<std::string>(), entry + ".to", &out->to));
    if (v.contains("concat") == v.contains("from"))
      return Bad(entry, "needs either from (and ops) or concat");
    if (v.contains("from")) {
      out->parts.emplace_back();
      CKPTFS_RETURN_IF_ERROR(Part(v, entry, &out->parts.back()));
    } else {
      if (v.contains("ops")) return Bad(entry + ".ops", "a concat's ops go in its parts");
      const json& c = v["concat"];
      if (!c.is_object() || !c.contains("parts") || !c["parts"].is_array() || c["parts"].empty() || c["parts"].size() > 64)
        return Bad(entry + ".concat", "needs {\"dim\": D, \"parts\": [{\"from\": ..., \"ops\": [...]}, ...]}");
      for (auto it = c.begin(); it != c.end(); ++it)
        if (it.key() != "dim" && it.key() != "parts") return Bad(entry + ".concat." + it.key(), "not a field of concat");
      CKPTFS_RETURN_IF_ERROR(Dim(c, "dim", entry + ".concat", &out->concat_dim));
      out->concat = true;
      for (size_t i = 0; i < c["parts"].size(); ++i) {
        const json& p = c["parts"][i];
        const std::string at = entry + ".concat.parts[" + std::to_string(i) + "]";
        if (!p.is_object() || !p.contains("from")) return Bad(at, "needs from");
        for (auto it = p.begin(); it != p.end(); ++it)
          if (it.key() != "from" && it.key() != "ops") return Bad(at + "." + it.key(), "not a field of a part");
        out->parts.emplace_back();
        CKPTFS_RETURN_IF_ERROR(Part(p, at, &out->parts.back()));
      }
    }
    // Every part binds the same names, and they are the names the served key uses.
    std::set<std::string> bound;
    for (size_t i = 0; i < out->parts.size(); ++i) {
      std::set<std::string> names;
      CKPTFS_RETURN_IF_ERROR(Binds(out->parts[i], entry, &names));
      if (i == 0) bound = names;
      else if (names != bound) return Bad(entry + ".concat", "its parts capture different names");
    }
    if (out->to.names.size() > kMaxKeyCaptures)
      return Bad(entry + ".to", "more than " + std::to_string(kMaxKeyCaptures) + " captures");
    std::set<std::string> used(out->to.names.begin(), out->to.names.end());
    if (used != bound) return Bad(entry + ".to", "'" + out->to.text + "' must use exactly the names its source captures");
    if (v.contains("when")) CKPTFS_RETURN_IF_ERROR(Expression(v["when"], entry + ".when", &out->when));
    for (const char* field : {"shape", "source_shape"}) {
      if (!v.contains(field)) continue;
      const json& s = v[field];
      const std::string at = entry + "." + field;
      if (!s.is_array() || s.size() > kMaxRank) return Bad(at, "not a list of dimensions");
      std::vector<Expr>& dims = std::string(field) == "shape" ? out->shape : out->source_shape;
      for (size_t i = 0; i < s.size(); ++i) {
        dims.emplace_back();
        CKPTFS_RETURN_IF_ERROR(Expression(s[i], at + "[" + std::to_string(i) + "]", &dims.back()));
      }
    }
    return Status::OK();
  }

  // A config template: strings starting with '=' must parse; "$when" entries too.
  Status Template(const json& v, const std::string& entry, int depth = 0) {
    if (depth > 16) return Bad(entry, "nested too deep");
    if (v.is_string() && !v.get_ref<const std::string&>().empty() && v.get_ref<const std::string&>()[0] == '=') {
      Expr e;
      Status s = Expr::Parse(v.get_ref<const std::string&>().substr(1), &e);
      return s.ok() ? s : Bad(entry, s.message());
    }
    if (v.is_object()) {
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (it.key() == "$when") {
          Expr e;
          CKPTFS_RETURN_IF_ERROR(Expression(it.value(), entry + ".$when", &e));
          continue;
        }
        CKPTFS_RETURN_IF_ERROR(Template(it.value(), entry + "." + it.key(), depth + 1));
      }
    }
    if (v.is_array())
      for (size_t i = 0; i < v.size(); ++i) CKPTFS_RETURN_IF_ERROR(Template(v[i], entry + "[" + std::to_string(i) + "]", depth + 1));
    return Status::OK();
  }

  std::string where_;
};

}  // namespace

Status ParseKeyMap(std::string_view text, const std::string& where, KeyMap* out) {
  if (text.size() > kMaxMapBytes) return Status::InvalidArgument(where, "larger than 1 MiB");
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::InvalidArgument(where, "not valid JSON");
  *out = KeyMap();
  SpecReader reader(where);
  return reader.Read(doc, out);
}

bool GlobMatch(std::string_view glob, std::string_view key) {
  // Iterative matching with one backtrack point (the last '*').
  size_t g = 0, k = 0, star = std::string_view::npos, mark = 0;
  while (k < key.size()) {
    if (g < glob.size() && glob[g] == '*') {
      star = g++;
      mark = k;
    } else if (g < glob.size() && glob[g] == key[k]) {
      ++g, ++k;
    } else if (star != std::string_view::npos) {
      g = star + 1;
      k = ++mark;
    } else {
      return false;
    }
  }
  while (g < glob.size() && glob[g] == '*') ++g;
  return g == glob.size();
}

}  // namespace ckptfs
