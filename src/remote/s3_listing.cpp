// S3's answers are small, flat XML documents of known elements: a scan for those elements
// is all ckptfs needs (no XML library, no DTDs, no entities beyond the five predefined).
#include "remote/s3_listing.hpp"

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
  for (std::string_view contents : Elements(xml, "Contents"))
    for (std::string_view key : Elements(contents, "Key")) out->keys.push_back(Unescape(key));
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
