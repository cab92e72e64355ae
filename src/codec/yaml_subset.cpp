// The YAML subset reader (codec/yaml_subset.hpp). The text is cut into lines (indentation,
// content); a block node is parsed from its first line by the indentation rules, and a
// sequence entry that holds a mapping (`- key: v`) becomes a line of its own at the column of
// its content, so that one mapping parser serves both forms.
#include "codec/yaml_subset.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace ckptfs {
namespace {

using json = nlohmann::json;

struct Line {
  uint32_t number;  // 1-based
  uint32_t indent;
  std::string text;  // after the indentation, trailing spaces removed
};

std::string_view TrimRight(std::string_view s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::string_view TrimLeft(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  return s;
}

// `s` without a trailing comment (a '#' at the start or after a space, outside quotes).
std::string_view StripComment(std::string_view s) {
  char quote = 0;
  for (size_t k = 0; k < s.size(); ++k) {
    const char ch = s[k];
    if (quote == '"' && ch == '\\') {
      ++k;
    } else if (quote) {
      if (ch == quote) quote = 0;
    } else if (ch == '"' || ch == '\'') {
      // A quote opens a quoted scalar only where one can start: after a separator.
      if (k == 0 || s[k - 1] == ' ' || s[k - 1] == '[' || s[k - 1] == '{' || s[k - 1] == ',') quote = ch;
    } else if (ch == '#' && (k == 0 || s[k - 1] == ' ')) {
      return TrimRight(s.substr(0, k));
    }
  }
  return TrimRight(s);
}

bool IsSequenceEntry(std::string_view c) { return c == "-" || (c.size() >= 2 && c[0] == '-' && c[1] == ' '); }

// Where the quoted scalar `c` starts with (at c[0], ' or ") closes: the index of its closing
// quote, past "\x" escapes of a double-quoted one and '' pairs of a single-quoted one; npos
// when it does not close on this text. The scan starts at *from (at least 1) and leaves there
// where it stopped: text appended to `c` continues the scan instead of repeating it (a quoted
// scalar folded over many lines is read in linear time).
size_t ClosingQuoteFrom(std::string_view c, size_t* from) {
  const char q = c[0];
  size_t k = std::max<size_t>(*from, 1);
  for (; k < c.size(); ++k) {
    if (q == '"' && c[k] == '\\') {
      ++k;  // past the end when the text ends in a backslash: the next line's break is escaped
    } else if (c[k] == q) {
      if (q == '\'' && k + 1 < c.size() && c[k + 1] == '\'') {
        ++k;
        continue;
      }
      *from = k;
      return k;
    }
  }
  *from = k;
  return std::string_view::npos;
}

size_t ClosingQuote(std::string_view c) {
  size_t from = 1;
  return ClosingQuoteFrom(c, &from);
}

// Where the ':' that ends a plain mapping key is (followed by a space or the end), outside
// quotes and before any flow collection; npos when `c` is no `key: value` line.
size_t KeyColon(std::string_view c) {
  if (c.empty() || c[0] == '[' || c[0] == '{' || c[0] == '-' || c[0] == '#') return std::string_view::npos;
  size_t k = 0;
  if (c[0] == '"' || c[0] == '\'') {
    k = ClosingQuote(c);
    if (k == std::string_view::npos) return std::string_view::npos;
    ++k;
    return k < c.size() && c[k] == ':' && (k + 1 == c.size() || c[k + 1] == ' ') ? k : std::string_view::npos;
  }
  for (; k < c.size(); ++k)
    if (c[k] == ':' && (k + 1 == c.size() || c[k + 1] == ' ')) return k;
  return std::string_view::npos;
}

bool AllDigits(std::string_view s, bool (*ok)(char)) {
  if (s.empty()) return false;
  bool digit = false;
  for (char ch : s) {
    if (ch == '_') continue;
    if (!ok(ch)) return false;
    digit = true;
  }
  return digit;
}

bool Dec(char ch) { return ch >= '0' && ch <= '9'; }
bool Hex(char ch) { return Dec(ch) || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F'); }
bool Oct(char ch) { return ch >= '0' && ch <= '7'; }

std::string NoUnderscores(std::string_view s) {
  std::string out;
  for (char ch : s)
    if (ch != '_') out += ch;
  return out;
}

// YAML 1.1 float forms PyYAML resolves: digits with a dot (an exponent needs a sign), digits
// with a signed exponent, a leading dot.
bool IsFloat(std::string_view s) {
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.remove_prefix(1);
  size_t e = s.find_first_of("eE");
  std::string_view mantissa = s.substr(0, e);
  if (e != std::string_view::npos) {
    std::string_view exp = s.substr(e + 1);
    if (exp.size() < 2 || (exp[0] != '+' && exp[0] != '-') || !AllDigits(exp.substr(1), Dec)) return false;
  }
  const size_t dot = mantissa.find('.');
  if (dot == std::string_view::npos) return e != std::string_view::npos && AllDigits(mantissa, Dec) && Dec(mantissa[0]);
  std::string_view whole = mantissa.substr(0, dot), frac = mantissa.substr(dot + 1);
  if (frac.find('.') != std::string_view::npos) return false;
  if (whole.empty()) return AllDigits(frac, Dec);
  return Dec(whole[0]) && AllDigits(whole, Dec) && (frac.empty() || AllDigits(frac, Dec) || frac == "_");
}

bool ResolvePlain(std::string_view s, json* out) {
  if (s == "~" || s == "null" || s == "Null" || s == "NULL") return *out = nullptr, true;
  for (std::string_view t : {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"})
    if (s == t) return *out = true, true;
  for (std::string_view f : {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"})
    if (s == f) return *out = false, true;
  std::string_view body = s;
  const bool negative = !body.empty() && body[0] == '-';
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) body.remove_prefix(1);
  int base = 0;
  std::string_view digits;
  if (body.size() > 2 && body[0] == '0' && (body[1] == 'x' || body[1] == 'X') && AllDigits(body.substr(2), Hex)) {
    base = 16, digits = body.substr(2);
  } else if (body.size() > 1 && body[0] == '0' && AllDigits(body.substr(1), Oct)) {
    base = 8, digits = body.substr(1);
  } else if (body == "0" || (!body.empty() && body[0] >= '1' && body[0] <= '9' && AllDigits(body, Dec))) {
    base = 10, digits = body;
  }
  if (base) {
    const std::string text = NoUnderscores(digits);
    errno = 0;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(text.c_str(), &end, base);
    if (errno == ERANGE || *end || v > (negative ? 9223372036854775808ull : 9223372036854775807ull)) return false;
    if (negative)
      *out = v == 9223372036854775808ull ? INT64_MIN : -static_cast<int64_t>(v);
    else
      *out = static_cast<int64_t>(v);
    return true;
  }
  for (std::string_view inf : {".inf", ".Inf", ".INF"}) {
    if (body == inf) return *out = negative ? -HUGE_VAL : HUGE_VAL, true;
  }
  if (s == ".nan" || s == ".NaN" || s == ".NAN") return *out = std::nan(""), true;
  if (IsFloat(s)) {
    const std::string text = NoUnderscores(s);
    *out = std::strtod(text.c_str(), nullptr);
    return true;
  }
  *out = std::string(s);
  return true;
}

class YamlParser {
 public:
  YamlParser(const std::string& name, const YamlLimits& limits) : name_(name), limits_(limits) {}

  Status Parse(std::string_view text, json* out) {
    if (text.size() > limits_.bytes)
      return Status::Refused(name_, "is " + std::to_string(text.size()) + " bytes, over the limit of " +
                                        std::to_string(limits_.bytes) + " for a YAML file");
    if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
    CKPTFS_RETURN_IF_ERROR(Split(text));
    size_t i = 0;
    if (i < lines_.size() && (lines_[i].text == "---" || lines_[i].text.rfind("--- ", 0) == 0)) {
      if (lines_[i].text != "---") return Error(lines_[i], "content after the document start '---'");
      ++i;
    }
    if (i == lines_.size() || lines_[i].text == "...") {
      *out = nullptr;
    } else {
      CKPTFS_RETURN_IF_ERROR(Node(&i, 0, out));
    }
    if (i < lines_.size()) {
      const Line& l = lines_[i];
      if (l.text == "---") return Error(l, "a second document (one is read)");
      if (l.text != "...") return Error(l, "a line outside the document's structure (its indentation)");
      for (++i; i < lines_.size(); ++i)
        if (!StripComment(lines_[i].text).empty()) return Error(lines_[i], "content after the document end '...'");
    }
    return Status::OK();
  }

 private:
  Status Error(const Line& l, const std::string& what) const {
    return Status::Corruption(name_, "line " + std::to_string(l.number) + ": " + what);
  }

  Status Count(const Line& l, uint32_t depth) {
    if (++nodes_ > limits_.nodes) return Error(l, "more than " + std::to_string(limits_.nodes) + " values");
    if (depth > limits_.depth) return Error(l, "nested deeper than " + std::to_string(limits_.depth) + " levels");
    return Status::OK();
  }

  Status Split(std::string_view text) {
    uint32_t number = 0;
    while (!text.empty()) {
      const size_t nl = text.find('\n');
      std::string_view raw = text.substr(0, nl);
      text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
      ++number;
      size_t indent = 0;
      while (indent < raw.size() && raw[indent] == ' ') ++indent;
      std::string_view rest = TrimRight(raw.substr(indent));
      if (rest.empty()) continue;
      if (rest[0] == '\t') return Status::Corruption(name_, "line " + std::to_string(number) + ": a tab in the indentation");
      if (rest[0] == '#') continue;
      if (rest[0] == '%' && indent == 0)
        return Status::Corruption(name_, "line " + std::to_string(number) + ": a directive ('%') is not read");
      lines_.push_back({number, static_cast<uint32_t>(indent), std::string(rest)});
    }
    return Status::OK();
  }

  // The block node starting at lines_[*i] (its indentation is the node's).
  Status Node(size_t* i, uint32_t depth, json* out) {
    const Line& l = lines_[*i];
    CKPTFS_RETURN_IF_ERROR(Count(l, depth));
    const std::string_view c = StripComment(l.text);
    if (c.empty()) return Error(l, "an empty node");
    if (IsSequenceEntry(c)) return Sequence(i, l.indent, depth, out);
    if (c[0] == '?') return Error(l, "a complex mapping key ('?') is not read");
    if (KeyColon(c) != std::string_view::npos) return Mapping(i, l.indent, depth, out);
    const uint32_t indent = l.indent;
    ++*i;
    return Value(c, l, i, indent == 0 ? 0 : indent - 1, depth, out);
  }

  Status Mapping(size_t* i, uint32_t indent, uint32_t depth, json* out) {
    *out = json::object();
    while (*i < lines_.size() && lines_[*i].indent >= indent) {
      const Line& l = lines_[*i];
      if (l.indent > indent) return Error(l, "indented deeper than its mapping's keys");
      const std::string_view c = StripComment(l.text);
      if (IsSequenceEntry(c)) return Error(l, "a sequence entry among a mapping's keys");
      if (c == "..." || c == "---") break;
      if (!c.empty() && c[0] == '?') return Error(l, "a complex mapping key ('?') is not read");
      const size_t colon = KeyColon(c);
      if (colon == std::string_view::npos) return Error(l, "expected 'key: value'");
      std::string key;
      std::string_view key_text = TrimRight(c.substr(0, colon));
      if (!key_text.empty() && (key_text[0] == '"' || key_text[0] == '\'')) {
        CKPTFS_RETURN_IF_ERROR(Quoted(key_text, l, &key));
      } else {
        if (key_text.empty()) return Error(l, "an empty mapping key");
        if (std::string_view("&*!|>%@`[]{},").find(key_text[0]) != std::string_view::npos)
          return Error(l, "a mapping key starting with '" + std::string(1, key_text[0]) + "' is not read");
        key = std::string(key_text);
      }
      if (out->contains(key)) return Error(l, "the key '" + key + "' appears twice in one mapping");
      const std::string_view rest = TrimLeft(c.substr(colon + 1));
      ++*i;
      json value;
      if (rest.empty()) {
        if (*i < lines_.size() && lines_[*i].indent > indent) {
          CKPTFS_RETURN_IF_ERROR(Node(i, depth + 1, &value));
        } else if (*i < lines_.size() && lines_[*i].indent == indent &&
                   IsSequenceEntry(StripComment(lines_[*i].text))) {
          CKPTFS_RETURN_IF_ERROR(Sequence(i, indent, depth + 1, &value));  // PyYAML's "key:\n- a"
        } else {
          CKPTFS_RETURN_IF_ERROR(Count(l, depth + 1));
        }
      } else {
        CKPTFS_RETURN_IF_ERROR(Count(l, depth + 1));
        CKPTFS_RETURN_IF_ERROR(Value(rest, l, i, indent, depth + 1, &value));
      }
      (*out)[key] = std::move(value);
    }
    return Status::OK();
  }

  Status Sequence(size_t* i, uint32_t indent, uint32_t depth, json* out) {
    *out = json::array();
    while (*i < lines_.size() && lines_[*i].indent >= indent) {
      Line& l = lines_[*i];
      if (l.indent > indent) return Error(l, "indented deeper than its sequence's entries");
      const std::string_view c = StripComment(l.text);
      if (!IsSequenceEntry(c)) break;  // the mapping this sequence is a value of goes on
      std::string_view rest = c.substr(1);
      const size_t pad = rest.size() - TrimLeft(rest).size();
      rest = TrimLeft(rest);
      json value;
      if (rest.empty()) {
        ++*i;
        if (*i < lines_.size() && lines_[*i].indent > indent) {
          CKPTFS_RETURN_IF_ERROR(Node(i, depth + 1, &value));
        } else {
          CKPTFS_RETURN_IF_ERROR(Count(l, depth + 1));
        }
      } else if (IsSequenceEntry(rest) || KeyColon(rest) != std::string_view::npos) {
        // "- key: v" / "- - v": the entry is a block node whose first line starts at `rest`.
        l.indent = indent + 1 + static_cast<uint32_t>(pad);
        l.text = std::string(rest);
        CKPTFS_RETURN_IF_ERROR(Node(i, depth + 1, &value));
      } else {
        ++*i;
        CKPTFS_RETURN_IF_ERROR(Count(l, depth + 1));
        CKPTFS_RETURN_IF_ERROR(Value(rest, l, i, indent, depth + 1, &value));
      }
      out->push_back(std::move(value));
    }
    return Status::OK();
  }

  // An inline value `text` of line `l` (after "key: " or "- "); lines after it indented
  // deeper than `indent` continue a scalar.
  Status Value(std::string_view text, const Line& l, size_t* i, uint32_t indent, uint32_t depth, json* out) {
    switch (text[0]) {
      case '&': return Error(l, "an anchor ('&') is not read");
      case '*': return Error(l, "an alias ('*') is not read");
      case '!': return Error(l, "a tag ('!') is not read");
      case '|':
      case '>': return Error(l, "a block scalar ('" + std::string(1, text[0]) + "') is not read");
      case '@':
      case '`': return Error(l, "a plain scalar cannot start with '" + std::string(1, text[0]) + "'");
      default: break;
    }
    if (text[0] == '[' || text[0] == '{') {
      size_t pos = 0;
      CKPTFS_RETURN_IF_ERROR(Flow(text, &pos, l, depth, out));
      if (pos != text.size()) return Error(l, "text after a flow collection");
      return Status::OK();
    }
    if (text[0] == '"' || text[0] == '\'') {
      // The raw text from the quote, continued over deeper-indented lines until it closes.
      // `text` views l.text, so the quote's offset in the line is where the raw text starts.
      std::string raw = l.text.substr(static_cast<size_t>(text.data() - l.text.data()));
      size_t scanned = 1;
      while (ClosingQuoteFrom(raw, &scanned) == std::string_view::npos) {
        if (*i >= lines_.size() || lines_[*i].indent <= indent) return Error(l, "a quoted scalar that does not end");
        raw += '\n';
        raw += lines_[*i].text;
        ++*i;
      }
      std::string value;
      size_t end = 0;
      CKPTFS_RETURN_IF_ERROR(QuotedPrefix(raw, l, &value, &end));
      if (!StripComment(std::string_view(raw).substr(end)).empty()) return Error(l, "text after a quoted scalar");
      *out = std::move(value);
      return Status::OK();
    }
    std::string plain(text);
    while (*i < lines_.size() && lines_[*i].indent > indent) {
      const std::string_view more = StripComment(lines_[*i].text);
      if (KeyColon(more) != std::string_view::npos || IsSequenceEntry(more))
        return Error(lines_[*i], "a mapping or sequence inside a scalar's continuation");
      plain += ' ';
      plain += more;
      ++*i;
    }
    if (!ResolvePlain(plain, out)) return Error(l, "an integer out of the 64-bit range");
    return Status::OK();
  }


  Status Quoted(std::string_view text, const Line& l, std::string* out) {
    size_t end = 0;
    CKPTFS_RETURN_IF_ERROR(QuotedPrefix(text, l, out, &end));
    if (end != text.size()) return Error(l, "text after a quoted key");
    return Status::OK();
  }

  // The quoted scalar at the start of `raw` (line breaks folded as YAML folds them); *end is
  // where it ends.
  Status QuotedPrefix(std::string_view raw, const Line& l, std::string* out, size_t* end) {
    const char q = raw[0];
    out->clear();
    size_t k = 1;
    for (; k < raw.size(); ++k) {
      const char ch = raw[k];
      if (ch == q) {
        if (q == '\'' && k + 1 < raw.size() && raw[k + 1] == '\'') {
          *out += '\'';
          ++k;
          continue;
        }
        *end = k + 1;
        return Status::OK();
      }
      if (ch == '\n') {
        // A line break folds into a space; empty lines in between are newlines.
        while (!out->empty() && out->back() == ' ') out->pop_back();
        size_t breaks = 0;
        while (k < raw.size() && (raw[k] == '\n' || raw[k] == ' ')) breaks += raw[k++] == '\n';
        --k;
        if (breaks == 1) {
          *out += ' ';
        } else {
          out->append(breaks - 1, '\n');
        }
        continue;
      }
      if (q == '"' && ch == '\\') {
        if (++k >= raw.size()) break;
        switch (raw[k]) {
          case '\\': *out += '\\'; break;
          case '"': *out += '"'; break;
          case '/': *out += '/'; break;
          case 'n': *out += '\n'; break;
          case 't': *out += '\t'; break;
          case 'r': *out += '\r'; break;
          case '0': *out += '\0'; break;
          case ' ': *out += ' '; break;
          case '\n':  // an escaped line break joins the lines
            while (k + 1 < raw.size() && raw[k + 1] == ' ') ++k;
            break;
          case 'x':
          case 'u':
          case 'U': {
            const size_t n = raw[k] == 'x' ? 2 : raw[k] == 'u' ? 4 : 8;
            if (k + n >= raw.size() || !AllDigits(raw.substr(k + 1, n), Hex) ||
                raw.substr(k + 1, n).find('_') != std::string_view::npos)
              return Error(l, "a bad escape in a double-quoted scalar");
            const uint32_t cp = static_cast<uint32_t>(std::stoul(std::string(raw.substr(k + 1, n)), nullptr, 16));
            k += n;
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return Error(l, "an escape that is no character");
            // UTF-8 of the code point.
            if (cp < 0x80) {
              *out += static_cast<char>(cp);
            } else if (cp < 0x800) {
              *out += static_cast<char>(0xC0 | (cp >> 6));
              *out += static_cast<char>(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
              *out += static_cast<char>(0xE0 | (cp >> 12));
              *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              *out += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
              *out += static_cast<char>(0xF0 | (cp >> 18));
              *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
              *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              *out += static_cast<char>(0x80 | (cp & 0x3F));
            }
            break;
          }
          default: return Error(l, std::string("the escape '\\") + raw[k] + "' is not read");
        }
        continue;
      }
      *out += ch;
    }
    return Error(l, "a quoted scalar that does not end");
  }

  // A flow collection or scalar at text[*pos] (on one line).
  Status Flow(std::string_view text, size_t* pos, const Line& l, uint32_t depth, json* out) {
    CKPTFS_RETURN_IF_ERROR(Count(l, depth));
    auto skip = [&] {
      while (*pos < text.size() && text[*pos] == ' ') ++*pos;
    };
    skip();
    if (*pos >= text.size()) return Error(l, "a flow collection that does not end on its line");
    const char open = text[*pos];
    if (open == '[' || open == '{') {
      const char close = open == '[' ? ']' : '}';
      *out = open == '[' ? json::array() : json::object();
      ++*pos;
      skip();
      if (*pos < text.size() && text[*pos] == close) return ++*pos, Status::OK();
      while (true) {
        json item;
        if (open == '{') {
          json key;
          CKPTFS_RETURN_IF_ERROR(FlowScalar(text, pos, l, true, &key));
          skip();
          if (*pos >= text.size() || text[*pos] != ':') return Error(l, "a flow mapping entry without ':'");
          ++*pos;
          CKPTFS_RETURN_IF_ERROR(Flow(text, pos, l, depth + 1, &item));
          const std::string k = key.is_string() ? key.get<std::string>() : key.dump();
          if (out->contains(k)) return Error(l, "the key '" + k + "' appears twice in one mapping");
          (*out)[k] = std::move(item);
        } else {
          CKPTFS_RETURN_IF_ERROR(Flow(text, pos, l, depth + 1, &item));
          out->push_back(std::move(item));
        }
        skip();
        if (*pos >= text.size()) return Error(l, "a flow collection that does not end on its line");
        if (text[*pos] == close) return ++*pos, Status::OK();
        if (text[*pos] != ',') return Error(l, "expected ',' or '" + std::string(1, close) + "' in a flow collection");
        ++*pos;
        skip();
        if (*pos < text.size() && text[*pos] == close) return ++*pos, Status::OK();
      }
    }
    CKPTFS_RETURN_IF_ERROR(FlowScalar(text, pos, l, false, out));
    skip();
    return Status::OK();
  }

  Status FlowScalar(std::string_view text, size_t* pos, const Line& l, bool key, json* out) {
    while (*pos < text.size() && text[*pos] == ' ') ++*pos;
    if (*pos >= text.size()) return Error(l, "a flow collection that does not end on its line");
    const char ch = text[*pos];
    if (ch == '"' || ch == '\'') {
      std::string value;
      size_t end = 0;
      CKPTFS_RETURN_IF_ERROR(QuotedPrefix(text.substr(*pos), l, &value, &end));
      *pos += end;
      *out = std::move(value);
      return Status::OK();
    }
    if (std::string_view("&*!|>[]{},#@`").find(ch) != std::string_view::npos)
      return Error(l, "'" + std::string(1, ch) + "' where a flow scalar was expected");
    const size_t begin = *pos;
    while (*pos < text.size() && text[*pos] != ',' && text[*pos] != ']' && text[*pos] != '}' &&
           !(text[*pos] == ':' && (key || *pos + 1 == text.size() || text[*pos + 1] == ' ')))
      ++*pos;
    const std::string_view plain = TrimRight(text.substr(begin, *pos - begin));
    if (!ResolvePlain(plain, out)) return Error(l, "an integer out of the 64-bit range");
    return Status::OK();
  }

  const std::string& name_;
  const YamlLimits limits_;
  std::vector<Line> lines_;
  uint64_t nodes_ = 0;
};

}  // namespace

Status ParseYamlSubset(std::string_view text, const std::string& name, json* out, const YamlLimits& limits) {
  YamlParser parser(name, limits);
  json value;
  CKPTFS_RETURN_IF_ERROR(parser.Parse(text, &value));
  *out = std::move(value);
  return Status::OK();
}

}  // namespace ckptfs
