// S3's answers are small, flat XML documents of known elements: a scan for those elements
// is all ckptfs needs (no XML library, no DTDs, no entities beyond the five predefined).
#include "remote/s3_listing.hpp"

#include <cstdlib>
#include <ctime>

namespace ckptfs {
namespace {

std::string Unescape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out.push_back(s[i]);
      continue;
    }
    static const std::pair<std::string_view, char> kEntities[] = {
        {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    bool matched = false;
    for (const auto& [name, c] : kEntities) {
      if (s.substr(i, name.size()) == name) {
        out.push_back(c);
        i += name.size() - 1;
        matched = true;
        break;
      }
    }
    if (!matched && s.substr(i, 2) == "&#") {
      // A numeric reference (&#34; &#x22;): the ASCII ones listings use for quotes.
      const size_t semi = s.find(';', i);
      const bool hex = s.substr(i, 3) == "&#x";
      const std::string digits(s.substr(i + (hex ? 3 : 2), semi == std::string_view::npos ? 0 : semi - i - (hex ? 3 : 2)));
      char* end = nullptr;
      const unsigned long code = std::strtoul(digits.c_str(), &end, hex ? 16 : 10);
      if (semi != std::string_view::npos && !digits.empty() && end && *end == '\0' && code > 0 && code < 128) {
        out.push_back(static_cast<char>(code));
        i = semi;
        matched = true;
      }
    }
    if (!matched) out.push_back('&');
  }
  return out;
}

// The text of each <tag>...</tag> inside `xml`, in order.
std::vector<std::string_view> Elements(std::string_view xml, std::string_view tag) {
  std::vector<std::string_view> found;
  const std::string open = "<" + std::string(tag) + ">";
  const std::string close = "</" + std::string(tag) + ">";
  size_t pos = 0;
  while ((pos = xml.find(open, pos)) != std::string_view::npos) {
    const size_t start = pos + open.size();
    const size_t end = xml.find(close, start);
    if (end == std::string_view::npos) break;
    found.push_back(xml.substr(start, end - start));
    pos = end + close.size();
  }
  return found;
}

}  // namespace

bool ParseListObjectsV2(std::string_view xml, S3ListingPage* out) {
  *out = S3ListingPage{};
  if (xml.find("<ListBucketResult") == std::string_view::npos) return false;
  for (std::string_view contents : Elements(xml, "Contents")) {
    const auto key = Elements(contents, "Key");
    if (key.empty()) continue;
    S3Object object;
    object.key = Unescape(key.front());
    const auto size = Elements(contents, "Size");
    if (!size.empty()) object.size = std::strtoull(std::string(size.front()).c_str(), nullptr, 10);
    const auto etag = Elements(contents, "ETag");
    if (!etag.empty()) object.etag = Unescape(etag.front());
    const auto modified = Elements(contents, "LastModified");
    if (!modified.empty()) {
      struct tm tm {};
      if (::strptime(std::string(modified.front()).c_str(), "%Y-%m-%dT%H:%M:%S", &tm))
        object.last_modified = static_cast<int64_t>(::timegm(&tm));
    }
    out->objects.push_back(std::move(object));
  }
  for (std::string_view common : Elements(xml, "CommonPrefixes"))
    for (std::string_view prefix : Elements(common, "Prefix")) out->prefixes.push_back(Unescape(prefix));
  const auto truncated = Elements(xml, "IsTruncated");
  out->truncated = !truncated.empty() && truncated.front() == "true";
  const auto token = Elements(xml, "NextContinuationToken");
  if (!token.empty()) out->next_token = Unescape(token.front());
  return true;
}

std::string S3ErrorCode(std::string_view xml) {
  const auto code = Elements(xml, "Code");
  return code.empty() ? std::string() : Unescape(code.front());
}

}  // namespace ckptfs
