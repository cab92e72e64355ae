// The key-map expression parser and evaluator (map_expr.hpp): a recursive-descent parser
// over a bounded text, a tree evaluated with checked integer arithmetic.
#include "map/map_expr.hpp"

#include <cctype>
#include <charconv>
#include <initializer_list>
#include <vector>

namespace ckptfs {

using json = nlohmann::json;

struct ExprNode {
  enum class Kind { kLiteral, kName, kHas, kUnary, kBinary, kTernary };
  Kind kind = Kind::kLiteral;
  json literal;
  std::string name;  // kName, kHas; kUnary and kBinary: the operator
  std::unique_ptr<ExprNode> a, b, c;
};

namespace {

constexpr size_t kMaxText = 1000;
constexpr int kMaxDepth = 64;

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Status Parse(std::unique_ptr<ExprNode>* out) {
    CKPTFS_RETURN_IF_ERROR(Ternary(out, 0));
    Skip();
    if (at_ != text_.size()) return Bad("unexpected '" + std::string(text_.substr(at_, 1)) + "'");
    return Status::OK();
  }

 private:
  Status Bad(const std::string& what) const {
    return Status::InvalidArgument("expression '" + std::string(text_) + "'", what + " at character " + std::to_string(at_ + 1));
  }
  void Skip() {
    while (at_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[at_]))) ++at_;
  }
  bool Eat(std::string_view token) {
    Skip();
    if (text_.substr(at_, token.size()) != token) return false;
    at_ += token.size();
    return true;
  }
  static std::unique_ptr<ExprNode> Binary(std::string op, std::unique_ptr<ExprNode> a, std::unique_ptr<ExprNode> b) {
    auto n = std::make_unique<ExprNode>();
    n->kind = ExprNode::Kind::kBinary;
    n->name = std::move(op);
    n->a = std::move(a);
    n->b = std::move(b);
    return n;
  }

  Status Ternary(std::unique_ptr<ExprNode>* out, int depth) {
    if (depth > kMaxDepth) return Bad("nested too deep");
    CKPTFS_RETURN_IF_ERROR(Coalesce(out, depth + 1));
    if (!Eat("?")) return Status::OK();
    if (at_ < text_.size() && text_[at_] == '?') return Bad("unexpected '?'");
    auto n = std::make_unique<ExprNode>();
    n->kind = ExprNode::Kind::kTernary;
    n->a = std::move(*out);
    CKPTFS_RETURN_IF_ERROR(Ternary(&n->b, depth + 1));
    if (!Eat(":")) return Bad("expected ':'");
    CKPTFS_RETURN_IF_ERROR(Ternary(&n->c, depth + 1));
    *out = std::move(n);
    return Status::OK();
  }
  // Operands of the next tighter level joined by any of `ops`, left to right.
  using Level = Status (Parser::*)(std::unique_ptr<ExprNode>*, int);
  Status Chain(std::initializer_list<const char*> ops, Level next, std::unique_ptr<ExprNode>* out, int depth) {
    CKPTFS_RETURN_IF_ERROR((this->*next)(out, depth));
    for (;;) {
      const char* op = nullptr;
      for (const char* o : ops)
        if (!op && Eat(o)) op = o;
      if (!op) return Status::OK();
      std::unique_ptr<ExprNode> rhs;
      CKPTFS_RETURN_IF_ERROR((this->*next)(&rhs, depth));
      *out = Binary(op, std::move(*out), std::move(rhs));
    }
  }
  Status Coalesce(std::unique_ptr<ExprNode>* out, int depth) { return Chain({"??"}, &Parser::Or, out, depth); }
  Status Or(std::unique_ptr<ExprNode>* out, int depth) { return Chain({"||"}, &Parser::And, out, depth); }
  Status And(std::unique_ptr<ExprNode>* out, int depth) { return Chain({"&&"}, &Parser::Compare, out, depth); }
  Status Compare(std::unique_ptr<ExprNode>* out, int depth) {
    CKPTFS_RETURN_IF_ERROR(Sum(out, depth));
    for (const char* op : {"==", "!=", "<=", ">=", "<", ">"}) {
      if (!Eat(op)) continue;
      std::unique_ptr<ExprNode> rhs;
      CKPTFS_RETURN_IF_ERROR(Sum(&rhs, depth));
      *out = Binary(op, std::move(*out), std::move(rhs));
      break;
    }
    return Status::OK();
  }
  Status Sum(std::unique_ptr<ExprNode>* out, int depth) { return Chain({"+", "-"}, &Parser::Product, out, depth); }
  Status Product(std::unique_ptr<ExprNode>* out, int depth) { return Chain({"*", "/"}, &Parser::Unary, out, depth); }
  Status Unary(std::unique_ptr<ExprNode>* out, int depth) {
    if (depth > kMaxDepth) return Bad("nested too deep");
    Skip();
    if (at_ < text_.size() && (text_[at_] == '!' || text_[at_] == '-') &&
        !(text_[at_] == '!' && at_ + 1 < text_.size() && text_[at_ + 1] == '=')) {
      auto n = std::make_unique<ExprNode>();
      n->kind = ExprNode::Kind::kUnary;
      n->name = std::string(1, text_[at_++]);
      CKPTFS_RETURN_IF_ERROR(Unary(&n->a, depth + 1));
      *out = std::move(n);
      return Status::OK();
    }
    return Primary(out, depth);
  }
  Status Primary(std::unique_ptr<ExprNode>* out, int depth) {
    Skip();
    if (at_ >= text_.size()) return Bad("unexpected end");
    const char c = text_[at_];
    auto n = std::make_unique<ExprNode>();
    if (c == '(') {
      ++at_;
      CKPTFS_RETURN_IF_ERROR(Ternary(out, depth + 1));
      if (!Eat(")")) return Bad("expected ')'");
      return Status::OK();
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      auto digits = [&](size_t from) {
        while (from < text_.size() && std::isdigit(static_cast<unsigned char>(text_[from]))) ++from;
        return from;
      };
      size_t end = digits(at_);
      bool real = false;
      // A number with a fraction or an exponent is a real (a value to write, e.g. 1e-5).
      if (end + 1 < text_.size() && text_[end] == '.' && std::isdigit(static_cast<unsigned char>(text_[end + 1]))) {
        end = digits(end + 1);
        real = true;
      }
      if (end < text_.size() && (text_[end] == 'e' || text_[end] == 'E')) {
        size_t e = end + 1;
        if (e < text_.size() && (text_[e] == '-' || text_[e] == '+')) ++e;
        if (e < text_.size() && std::isdigit(static_cast<unsigned char>(text_[e]))) {
          end = digits(e);
          real = true;
        }
      }
      if (real) {
        double v = 0;
        auto [ptr, ec] = std::from_chars(text_.data() + at_, text_.data() + end, v);
        if (ec != std::errc() || ptr != text_.data() + end) return Bad("not a number");
        n->literal = v;
      } else {
        int64_t v = 0;
        auto [ptr, ec] = std::from_chars(text_.data() + at_, text_.data() + end, v);
        if (ec != std::errc()) return Bad("integer out of range");
        n->literal = v;
      }
      at_ = end;
    } else if (c == '\'') {
      const size_t end = text_.find('\'', at_ + 1);
      if (end == std::string_view::npos) return Bad("unterminated text");
      n->literal = std::string(text_.substr(at_ + 1, end - at_ - 1));
      at_ = end + 1;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = at_;
      while (end < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[end])) || text_[end] == '_')) ++end;
      const std::string word(text_.substr(at_, end - at_));
      at_ = end;
      if (word == "true") n->literal = true;
      else if (word == "false") n->literal = false;
      else if (word == "null") n->literal = nullptr;
      else if (word == "has") {
        if (!Eat("(")) return Bad("has needs (NAME)");
        Skip();
        size_t e = at_;
        while (e < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[e])) || text_[e] == '_')) ++e;
        if (e == at_) return Bad("has needs a name");
        n->kind = ExprNode::Kind::kHas;
        n->name = std::string(text_.substr(at_, e - at_));
        at_ = e;
        if (!Eat(")")) return Bad("expected ')'");
      } else {
        n->kind = ExprNode::Kind::kName;
        n->name = word;
      }
    } else {
      return Bad("unexpected '" + std::string(1, c) + "'");
    }
    *out = std::move(n);
    return Status::OK();
  }

  std::string_view text_;
  size_t at_ = 0;
};

// A value, or a name that is missing (kept for ?? and reported by anything else).
struct Val {
  json v;
  std::string missing;  // the missing name, or empty
};

Status Fail(const std::string& expr, const std::string& what) { return Status::InvalidArgument("expression '" + expr + "'", what); }

std::string Shown(const json& v) { return v.dump(-1, ' ', false, json::error_handler_t::replace); }

class Evaluator {
 public:
  Evaluator(const std::string& text, const Expr::Resolver& resolve) : text_(text), resolve_(resolve) {}

  Status Eval(const ExprNode& n, Val* out) {
    switch (n.kind) {
      case ExprNode::Kind::kLiteral: out->v = n.literal; return Status::OK();
      case ExprNode::Kind::kName: {
        bool found = false;
        CKPTFS_RETURN_IF_ERROR(resolve_(n.name, &out->v, &found));
        if (!found) out->missing = n.name;
        return Status::OK();
      }
      case ExprNode::Kind::kHas: {
        bool found = false;
        json ignored;
        CKPTFS_RETURN_IF_ERROR(resolve_(n.name, &ignored, &found));
        out->v = found && !ignored.is_null();
        return Status::OK();
      }
      case ExprNode::Kind::kUnary: {
        Val a;
        CKPTFS_RETURN_IF_ERROR(Present(*n.a, &a));
        if (n.name == "!") {
          if (!a.v.is_boolean()) return Fail(text_, "! of " + Shown(a.v) + ", not a boolean");
          out->v = !a.v.get<bool>();
        } else {
          int64_t x;
          CKPTFS_RETURN_IF_ERROR(Integer(a.v, &x));
          if (x == INT64_MIN) return Fail(text_, "overflow");
          out->v = -x;
        }
        return Status::OK();
      }
      case ExprNode::Kind::kTernary: {
        Val c;
        CKPTFS_RETURN_IF_ERROR(Present(*n.a, &c));
        if (!c.v.is_boolean()) return Fail(text_, "the condition is " + Shown(c.v) + ", not a boolean");
        return Eval(c.v.get<bool>() ? *n.b : *n.c, out);
      }
      case ExprNode::Kind::kBinary: return Binary(n, out);
    }
    return Status::OK();
  }

  Status Present(const ExprNode& n, Val* out) {
    CKPTFS_RETURN_IF_ERROR(Eval(n, out));
    if (!out->missing.empty())
      return Status::InvalidArgument("", "'" + out->missing + "'" +
                                     " is neither a map parameter nor in the checkpoint's model_config (give it with -o map." +
                                         out->missing + "=VALUE)");
    return Status::OK();
  }

 private:
  Status Integer(const json& v, int64_t* out) {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}) return Fail(text_, "integer out of range");
      *out = v.get<int64_t>();
      return Status::OK();
    }
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (d == static_cast<double>(static_cast<int64_t>(d)) && d > -9e18 && d < 9e18) {
        *out = static_cast<int64_t>(d);
        return Status::OK();
      }
    }
    return Fail(text_, Shown(v) + " is not an integer");
  }

  Status Binary(const ExprNode& n, Val* out) {
    const std::string& op = n.name;
    if (op == "??") {
      Val a;
      CKPTFS_RETURN_IF_ERROR(Eval(*n.a, &a));
      if (a.missing.empty() && !a.v.is_null()) {
        *out = std::move(a);
        return Status::OK();
      }
      return Eval(*n.b, out);
    }
    if (op == "&&" || op == "||") {
      Val a;
      CKPTFS_RETURN_IF_ERROR(Present(*n.a, &a));
      if (!a.v.is_boolean()) return Fail(text_, op + " of " + Shown(a.v) + ", not a boolean");
      if (a.v.get<bool>() == (op == "||")) {
        out->v = a.v;
        return Status::OK();
      }
      Val b;
      CKPTFS_RETURN_IF_ERROR(Present(*n.b, &b));
      if (!b.v.is_boolean()) return Fail(text_, op + " of " + Shown(b.v) + ", not a boolean");
      out->v = b.v;
      return Status::OK();
    }
    Val a, b;
    CKPTFS_RETURN_IF_ERROR(Present(*n.a, &a));
    CKPTFS_RETURN_IF_ERROR(Present(*n.b, &b));
    if (op == "==" || op == "!=") {
      const bool equal = a.v.is_number() && b.v.is_number() ? a.v.get<double>() == b.v.get<double>() : a.v == b.v;
      out->v = (op == "==") == equal;
      return Status::OK();
    }
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      if (!a.v.is_number() || !b.v.is_number()) return Fail(text_, "compares " + Shown(a.v) + " and " + Shown(b.v));
      const double x = a.v.get<double>(), y = b.v.get<double>();
      out->v = op == "<" ? x < y : op == "<=" ? x <= y : op == ">" ? x > y : x >= y;
      return Status::OK();
    }
    int64_t x, y, r = 0;
    CKPTFS_RETURN_IF_ERROR(Integer(a.v, &x));
    CKPTFS_RETURN_IF_ERROR(Integer(b.v, &y));
    bool overflow = false;
    if (op == "+") overflow = __builtin_add_overflow(x, y, &r);
    else if (op == "-") overflow = __builtin_sub_overflow(x, y, &r);
    else if (op == "*") overflow = __builtin_mul_overflow(x, y, &r);
    else {
      if (y == 0 || (x == INT64_MIN && y == -1)) return Fail(text_, "divides " + std::to_string(x) + " by " + std::to_string(y));
      if (x % y != 0)
        return Fail(text_, std::to_string(x) + " / " + std::to_string(y) + " is not a whole number");
      r = x / y;
    }
    if (overflow) return Fail(text_, "overflow");
    out->v = r;
    return Status::OK();
  }

  const std::string& text_;
  const Expr::Resolver& resolve_;
};

}  // namespace

Expr::Expr() = default;
Expr::~Expr() = default;
Expr::Expr(Expr&&) noexcept = default;
Expr& Expr::operator=(Expr&&) noexcept = default;

Status Expr::Parse(std::string_view text, Expr* out) {
  if (text.size() > kMaxText)
    return Status::InvalidArgument("an expression", "longer than " + std::to_string(kMaxText) + " characters");
  Parser parser(text);
  std::unique_ptr<ExprNode> root;
  CKPTFS_RETURN_IF_ERROR(parser.Parse(&root));
  out->text_.assign(text);
  out->root_ = std::move(root);
  return Status::OK();
}

Expr Expr::Constant(json value) {
  Expr e;
  e.text_ = value.dump();
  e.root_ = std::make_unique<ExprNode>();
  e.root_->literal = std::move(value);
  return e;
}

Status Expr::Evaluate(const Resolver& resolve, json* value) const {
  if (!root_) return Status::InvalidArgument("an expression", "is empty");
  Evaluator evaluator(text_, resolve);
  Val v;
  CKPTFS_RETURN_IF_ERROR(evaluator.Present(*root_, &v));
  *value = std::move(v.v);
  return Status::OK();
}

Status Expr::EvaluateCount(const Resolver& resolve, uint64_t* value) const {
  json v;
  CKPTFS_RETURN_IF_ERROR(Evaluate(resolve, &v));
  if (v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0)) {
    *value = v.get<uint64_t>();
    return Status::OK();
  }
  return Status::InvalidArgument("expression '" + text_ + "'", "is " + Shown(v) + ", not a count");
}

Status Expr::EvaluateBool(const Resolver& resolve, bool* value) const {
  json v;
  CKPTFS_RETURN_IF_ERROR(Evaluate(resolve, &v));
  if (!v.is_boolean()) return Status::InvalidArgument("expression '" + text_ + "'", "is " + Shown(v) + ", not true or false");
  *value = v.get<bool>();
  return Status::OK();
}

}  // namespace ckptfs
