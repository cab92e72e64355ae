// The URL forms ckptfs takes as a SOURCE, and the encoding of S3 keys in request URLs.
#ifndef CKPTFS_REMOTE_URL_HPP_
#define CKPTFS_REMOTE_URL_HPP_

#include <string>
#include <string_view>

#include "ckptfs/status.hpp"

namespace ckptfs {

bool StartsWith(std::string_view s, std::string_view prefix);

// Refuses what must not be in a SOURCE URL: user:password@ (it would show in /proc/mounts,
// logs and the manifest), a query string (a presigned URL's signature, likewise) and a
// fragment; and an http(s) URL without a host.
Status CheckSourceUrl(const std::string& url);

// Percent-encodes everything but unreserved characters (RFC 3986) and, when `keep_slash`,
// '/': S3 keys in paths and query values, as SigV4 canonicalizes them.
std::string PercentEncode(std::string_view text, bool keep_slash);

// "s3://bucket/key/parts" -> bucket, key ("" for the bucket itself); false when malformed.
bool SplitS3Url(const std::string& url, std::string* bucket, std::string* key);

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_URL_HPP_
