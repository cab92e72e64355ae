// Expressions of the key-map language (doc/MAPS.md, "Expressions"): integers, booleans,
// null, 'text', names, + - * / (exact integer division), comparisons, && || !, `a ?? b`,
// `c ? a : b`, has(NAME), parentheses. Parsed once when a map is read, evaluated against
// names a caller resolves (parameters, captured values, model_config fields).
#ifndef CKPTFS_MAP_MAP_EXPR_HPP_
#define CKPTFS_MAP_MAP_EXPR_HPP_

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/status.hpp"

namespace ckptfs {

struct ExprNode;

class Expr {
 public:
  // How a name is looked up: true with *value set when it has one, false when it is
  // missing; an error for a name that cannot be worked out (a parameter that failed).
  using Resolver = std::function<Status(std::string_view name, nlohmann::json* value, bool* found)>;

  Expr();
  ~Expr();
  Expr(Expr&&) noexcept;
  Expr& operator=(Expr&&) noexcept;

  // Parses `text` (at most 1000 characters, nesting at most 64 deep). The error's text
  // says what is wrong where; the caller names the map and entry.
  static Status Parse(std::string_view text, Expr* out);
  // A constant (a JSON number or boolean given where an expression may stand).
  static Expr Constant(nlohmann::json value);

  // The value, a JSON null, boolean, number or string. A missing name, arithmetic on
  // something other than integers, an inexact division or overflow is an error naming it.
  Status Evaluate(const Resolver& resolve, nlohmann::json* value) const;
  // Evaluate, then a non-negative integer / a boolean, or an error saying what it got.
  Status EvaluateCount(const Resolver& resolve, uint64_t* value) const;
  Status EvaluateBool(const Resolver& resolve, bool* value) const;

  const std::string& text() const { return text_; }
  bool empty() const { return root_ == nullptr; }

 private:
  std::string text_;
  std::unique_ptr<ExprNode> root_;
};

}  // namespace ckptfs

#endif  // CKPTFS_MAP_MAP_EXPR_HPP_
