// Where S3 requests go and how they are signed: the endpoint, region and credentials of the
// usual AWS environment variables and ~/.aws files.
#ifndef CKPTFS_REMOTE_AWS_CREDENTIALS_HPP_
#define CKPTFS_REMOTE_AWS_CREDENTIALS_HPP_

#include <string>

#include "ckptfs/status.hpp"

namespace ckptfs {

struct AwsSigning {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty unless temporary credentials
  std::string region;
  bool anonymous() const { return access_key_id.empty(); }
};

struct S3Settings {
  AwsSigning signing;
  // "http://127.0.0.1:9000" for an S3-compatible store (path-style requests); empty for
  // AWS itself (virtual-hosted requests to BUCKET.s3.REGION.amazonaws.com).
  std::string endpoint;
};

// From AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, else the profile
// AWS_PROFILE (default "default") of AWS_SHARED_CREDENTIALS_FILE (default
// ~/.aws/credentials); the region from AWS_REGION, AWS_DEFAULT_REGION or the profile in
// AWS_CONFIG_FILE (default ~/.aws/config), else us-east-1; the endpoint from
// AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL. No credentials at all means unsigned requests
// (public buckets). A credentials file that cannot be parsed is an error naming the file.
Status LoadS3Settings(S3Settings* out);

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_AWS_CREDENTIALS_HPP_
