#include "ckptfs/names.hpp"

#include <xxhash.h>

#include <cstdio>

namespace ckptfs {

std::string TensorFileName(std::string_view key, bool* shortened) {
  std::string name;
  AppendTensorFileName(&name, key, shortened);
  return name;
}

void AppendTensorFileName(std::string* out, std::string_view key, bool* shortened) {
  const size_t start = out->size();
  // Runs without a character to escape are appended whole: a byte at a time, making the
  // names of a million tensors would be a tenth of a remount's View build.
  size_t done = 0;
  for (size_t i = 0; i < key.size(); ++i) {
    const char c = key[i];
    if (c != '%' && c != '/' && c != '\0') continue;
    out->append(key.data() + done, i - done);
    if (c == '%') *out += "%25";
    else if (c == '/') *out += "%2F";
    else *out += "%00";  // file names end at NUL
    done = i + 1;
  }
  out->append(key.data() + done, key.size() - done);
  const size_t escaped_size = out->size() - start;
  const bool too_long = escaped_size + kTensorFileSuffix.size() > kMaxFileName;
  if (shortened) *shortened = too_long;
  if (!too_long) {
    out->append(kTensorFileSuffix);
    return;
  }
  char tag[18];
  std::snprintf(tag, sizeof tag, "~%016llx",
                static_cast<unsigned long long>(XXH3_64bits(key.data(), key.size())));
  size_t keep = kMaxFileName - kTensorFileSuffix.size() - (sizeof tag - 1);
  const char* escaped = out->data() + start;
  // Do not split a UTF-8 sequence or a %XX escape.
  while (keep > 0 && (static_cast<unsigned char>(escaped[keep]) & 0xC0) == 0x80) --keep;
  if (keep >= 1 && escaped[keep - 1] == '%') keep -= 1;
  else if (keep >= 2 && escaped[keep - 2] == '%') keep -= 2;
  out->resize(start + keep);
  out->append(tag);
  out->append(kTensorFileSuffix);
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
