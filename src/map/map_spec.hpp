// A key map as read from its JSON text (the language of doc/MAPS.md), checked for shape
// and bounds before anything uses it: every error is one line naming the map and the entry.
#ifndef CKPTFS_MAP_MAP_SPEC_HPP_
#define CKPTFS_MAP_MAP_SPEC_HPP_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/status.hpp"
#include "map/map_expr.hpp"

namespace ckptfs {

// The most captures one served key may use.
inline constexpr size_t kMaxKeyCaptures = 4;

// A key pattern: literal text and {NAME} captures, alternating (literals.size() ==
// names.size() + 1).
struct KeyPattern {
  std::string text;
  std::vector<std::string> literals;
  std::vector<std::string> names;
};

// One alternative of a rule's `from`: a source key pattern and the leading dimensions it
// unstacks ("key[L][E]").
struct MapSource {
  KeyPattern key;
  std::vector<std::string> unstack;
};

struct MapOp {
  enum class Kind { kSelect, kSlice, kRowGroups, kTranspose };
  Kind kind = Kind::kSelect;
  size_t dim = 0, dim2 = 0;  // dim2: transpose's second dimension
  Expr index, start, stop, groups, size;
};

// A rule's source tensor: alternatives of where it comes from, then the ops on it.
struct MapPart {
  std::vector<MapSource> from;
  std::vector<MapOp> ops;
};

struct MapRule {
  KeyPattern to;
  std::vector<MapPart> parts;  // one, or a concatenation's parts
  bool concat = false;
  size_t concat_dim = 0;
  Expr when;                 // empty: always
  std::vector<Expr> shape;   // empty: not checked
  std::vector<Expr> source_shape;  // the source's shape after unstacking; empty: not checked
  std::string where;         // "tensors[3]", for messages
};

struct KeyMap {
  std::string name;
  std::string description;
  std::string origin;  // "shipped" or the file's path
  std::vector<std::string> key_prefixes{""};
  std::vector<std::pair<std::string, Expr>> parameters;
  std::vector<std::pair<std::string, Expr>> captures;  // name -> how many values
  struct Requirement {
    Expr check;
    std::string why;
  };
  std::vector<Requirement> requires_;
  Expr auto_when;
  std::string auto_why;
  std::vector<std::string> families;
  std::vector<MapRule> rules;
  std::vector<std::string> ignore;  // globs
  nlohmann::json config, generation_config;  // templates; null: not written
};

// Parses a map's JSON text; `where` names it in errors ("map llama", "map /x/m.json").
Status ParseKeyMap(std::string_view text, const std::string& where, KeyMap* out);

// Whether `key` matches `glob` (`*` any text, everything else itself).
bool GlobMatch(std::string_view glob, std::string_view key);

}  // namespace ckptfs

#endif  // CKPTFS_MAP_MAP_SPEC_HPP_
