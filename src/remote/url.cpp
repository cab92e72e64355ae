#include "remote/url.hpp"

namespace ckptfs {

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.substr(0, prefix.size()) == prefix;
}

Status CheckSourceUrl(const std::string& url) {
  const size_t scheme_end = url.find("://");
  const size_t authority_start = scheme_end == std::string::npos ? 0 : scheme_end + 3;
  const size_t authority_end = url.find('/', authority_start);
  const std::string authority = url.substr(authority_start, authority_end - authority_start);
  // Never echo the URL itself here: it holds the secret being refused.
  const std::string where = url.substr(0, authority_start) + "...";
  if (authority.find('@') != std::string::npos)
    return Status::InvalidArgument(where, "credentials in the URL are not accepted (they would show in /proc/mounts "
                                          "and logs); S3 takes them from AWS_* variables or ~/.aws/credentials");
  if (url.find('?') != std::string::npos)
    return Status::InvalidArgument(where, "URLs with a query string (e.g. presigned URLs) are not accepted: the "
                                          "signature would show in /proc/mounts and logs");
  if (url.find('#') != std::string::npos) return Status::InvalidArgument(url, "a URL fragment (#...) is not accepted");
  if (authority.empty()) return Status::InvalidArgument(url, "the URL names no host (or bucket)");
  return Status::OK();
}

std::string PercentEncode(std::string_view text, bool keep_slash) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    const bool unreserved = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
                            c == '_' || c == '.' || c == '~';
    if (unreserved || (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

bool SplitS3Url(const std::string& url, std::string* bucket, std::string* key) {
  if (!StartsWith(url, "s3://")) return false;
  const std::string rest = url.substr(5);
  const size_t slash = rest.find('/');
  *bucket = rest.substr(0, slash);
  *key = slash == std::string::npos ? std::string() : rest.substr(slash + 1);
  while (!key->empty() && key->back() == '/') key->pop_back();
  return !bucket->empty();
}

}  // namespace ckptfs
