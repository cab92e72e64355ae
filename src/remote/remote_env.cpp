// EnvForSource: the one place a SOURCE argument becomes an Env.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "ckptfs/remote.hpp"
#include "remote/remote_envs.hpp"
#include "remote/url.hpp"

namespace ckptfs {
namespace {

// The CA file the options name, or the environment's; a file that cannot be read is a
// clear error at mount, not a TLS failure retried on every request.
Status ResolveCaFile(bool s3, RemoteOptions* options) {
  std::string origin = "ca_file";
  if (options->ca_file.empty()) {
    for (const char* name : {s3 ? "AWS_CA_BUNDLE" : "", "CURL_CA_BUNDLE"}) {
      const char* value = *name ? std::getenv(name) : nullptr;
      if (value && *value) {
        options->ca_file = value;
        origin = std::string("$") + name;
        break;
      }
    }
  }
  if (!options->ca_file.empty() && ::access(options->ca_file.c_str(), R_OK) != 0)
    return Status::FromErrno(options->ca_file, "cannot read the CA certificates named by " + origin, errno);
  return Status::OK();
}

}  // namespace

bool IsRemoteSource(std::string_view source) {
  return StartsWith(source, "http://") || StartsWith(source, "https://") || StartsWith(source, "s3://");
}

Status EnvForSource(const std::string& source, const RemoteOptions& options, std::shared_ptr<Env>* out) {
  if (!IsRemoteSource(source)) {
    *out = Env::Local();
    return Status::OK();
  }
  CKPTFS_RETURN_IF_ERROR(CheckSourceUrl(source));
  // A bound on a folder that is not there would be silently ignored.
  if (options.cache_dir_bytes != 0 && options.cache_dir.empty())
    return Status::InvalidArgument("cache_dir_size", "bounds the cache_dir folder: give cache_dir too");
  const bool s3 = StartsWith(source, "s3://");
  RemoteOptions resolved = options;
  CKPTFS_RETURN_IF_ERROR(ResolveCaFile(s3, &resolved));
  if (s3) {
    S3Settings settings;
    CKPTFS_RETURN_IF_ERROR(LoadS3Settings(&settings));
    *out = MakeS3Env(resolved, settings);
  } else {
    *out = MakeHttpEnv(resolved);
  }
  return Status::OK();
}

}  // namespace ckptfs
