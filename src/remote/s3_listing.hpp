// The parts of S3's XML answers ckptfs uses: a ListObjectsV2 page and an error's code.
#ifndef CKPTFS_REMOTE_S3_LISTING_HPP_
#define CKPTFS_REMOTE_S3_LISTING_HPP_

#include <string>
#include <cstdint>
#include <string_view>
#include <vector>

namespace ckptfs {

struct S3Object {
  std::string key;            // <Key>
  uint64_t size = 0;          // <Size>
  std::string etag;           // <ETag>, quotes included as a GET answers it
  int64_t last_modified = 0;  // <LastModified>, seconds since the epoch (0 when unreadable)
};

struct S3ListingPage {
  std::vector<S3Object> objects;      // <Contents>
  std::vector<std::string> prefixes;  // <CommonPrefixes><Prefix>
  bool truncated = false;
  std::string next_token;  // <NextContinuationToken>
};

// False when `xml` is not a ListBucketResult.
bool ParseListObjectsV2(std::string_view xml, S3ListingPage* out);

// The <Code> of an S3 <Error> document ("SignatureDoesNotMatch"), or "".
std::string S3ErrorCode(std::string_view xml);

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_S3_LISTING_HPP_
