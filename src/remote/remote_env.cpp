// EnvForSource: the one place a SOURCE argument becomes an Env.
#include "ckptfs/remote.hpp"
#include "remote/remote_envs.hpp"
#include "remote/url.hpp"

namespace ckptfs {

bool IsRemoteSource(std::string_view source) {
  return StartsWith(source, "http://") || StartsWith(source, "https://") || StartsWith(source, "s3://");
}

Status EnvForSource(const std::string& source, const RemoteOptions& options, std::shared_ptr<Env>* out) {
  if (!IsRemoteSource(source)) {
    *out = Env::Local();
    return Status::OK();
  }
  CKPTFS_RETURN_IF_ERROR(CheckSourceUrl(source));
  if (StartsWith(source, "s3://")) {
    S3Settings settings;
    CKPTFS_RETURN_IF_ERROR(LoadS3Settings(&settings));
    *out = MakeS3Env(options, settings);
  } else {
    *out = MakeHttpEnv(options);
  }
  return Status::OK();
}

}  // namespace ckptfs
