#include "ckptfs/names.hpp"

#include <xxhash.h>

#include <cstdio>

namespace ckptfs {

std::string TensorFileName(std::string_view key, bool* shortened) {
  std::string escaped;
  escaped.reserve(key.size() + kTensorFileSuffix.size());
  for (char c : key) {
    if (c == '%') escaped += "%25";
    else if (c == '/') escaped += "%2F";
    else if (c == '\0') escaped += "%00";  // file names end at NUL
    else escaped += c;
  }
  const bool too_long = escaped.size() + kTensorFileSuffix.size() > kMaxFileName;
  if (shortened) *shortened = too_long;
  if (!too_long) return escaped + std::string(kTensorFileSuffix);

  char tag[18];
  std::snprintf(tag, sizeof tag, "~%016llx",
                static_cast<unsigned long long>(XXH3_64bits(key.data(), key.size())));
  size_t keep = kMaxFileName - kTensorFileSuffix.size() - (sizeof tag - 1);
  // Do not split a UTF-8 sequence or a %XX escape.
  while (keep > 0 && (static_cast<unsigned char>(escaped[keep]) & 0xC0) == 0x80) --keep;
  if (keep >= 1 && escaped[keep - 1] == '%') keep -= 1;
  else if (keep >= 2 && escaped[keep - 2] == '%') keep -= 2;
  return escaped.substr(0, keep) + tag + std::string(kTensorFileSuffix);
}

std::optional<std::string> UnescapeKey(std::string_view escaped) {
  std::string key;
  key.reserve(escaped.size());
  for (size_t i = 0; i < escaped.size(); ++i) {
    if (escaped[i] != '%') {
      key += escaped[i];
      continue;
    }
    std::string_view code = escaped.substr(i + 1, 2);
    if (code == "25") key += '%';
    else if (code == "2F") key += '/';
    else if (code == "00") key += '\0';
    else return std::nullopt;
    i += 2;
  }
  return key;
}

}  // namespace ckptfs
