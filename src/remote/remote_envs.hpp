// The Envs of remote sources, made by EnvForSource (remote_env.cpp).
#ifndef CKPTFS_REMOTE_REMOTE_ENVS_HPP_
#define CKPTFS_REMOTE_REMOTE_ENVS_HPP_

#include <memory>

#include "ckptfs/env.hpp"
#include "ckptfs/remote.hpp"
#include "remote/aws_credentials.hpp"

namespace ckptfs {

// http:// and https:// URLs (http_env.cpp).
std::shared_ptr<Env> MakeHttpEnv(const RemoteOptions& options);
// s3://BUCKET/KEY URLs (s3_env.cpp).
std::shared_ptr<Env> MakeS3Env(const RemoteOptions& options, const S3Settings& settings);

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_REMOTE_ENVS_HPP_
