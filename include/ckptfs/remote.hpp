// Remote sources: checkpoints on an HTTP(S) server or in an S3-compatible object store.
//
// A remote source is one more Env (include/ckptfs/env.hpp): its paths are URLs
// ("https://host/dir/model.pt", "s3://bucket/prefix/step_100"), JoinPath appends names to
// them, and its SourceFiles fetch byte ranges on demand through a bounded block cache. The
// format readers, the View and the front ends never know which Env they read. EnvForSource is
// the one place that picks the Env for a SOURCE argument; the open layer (include/ckptfs/open.hpp)
// calls it for every front end.
#ifndef CKPTFS_REMOTE_HPP_
#define CKPTFS_REMOTE_HPP_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "ckptfs/env.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// How remote objects are fetched and cached (the source options cache_size, cache_dir,
// cache_dir_size, remote_timeout, remote_retries, readahead).
struct RemoteOptions {
  // Bytes of fetched blocks kept in memory, shared by all files of the source.
  uint64_t cache_bytes = uint64_t{256} << 20;
  // A folder for fetched blocks on disk, keyed by URL, ETag and size; empty: none.
  std::string cache_dir;
  // At most this many bytes of blocks in cache_dir, least recently used evicted first, among
  // all processes sharing the folder; 0: unbounded.
  uint64_t cache_dir_bytes = 0;
  // A request that moves no byte for this long (or cannot connect) is abandoned and retried.
  int timeout_seconds = 30;
  // Further tries of a request that failed transiently (timeouts, resets, 5xx, short or
  // mislabelled bodies) before the read fails with EIO.
  int retries = 4;
  // How far ahead of a sequential reader blocks are fetched, in parallel requests.
  uint64_t readahead_bytes = uint64_t{64} << 20;
  // A PEM file of the certificate authorities HTTPS servers are checked against, instead of
  // the system's (the ca_file option); empty: EnvForSource takes it from $CURL_CA_BUNDLE (for s3:// sources
  // $AWS_CA_BUNDLE first), as curl and the AWS tools do.
  std::string ca_file;
};

// What this process fetched from remote sources so far (all Envs together); a remote Env's
// fetch_counters.
using RemoteCounters = FetchCounters;
RemoteCounters RemoteCountersNow();

// Whether `source` names a remote source (http://, https:// or s3://).
bool IsRemoteSource(std::string_view source);

// The Env that reads `source`: a remote Env for URLs, the local file system otherwise.
// A URL with credentials or a query string in it is refused (they would show in
// /proc/mounts, logs and the manifest).
Status EnvForSource(const std::string& source, const RemoteOptions& options, std::shared_ptr<Env>* out);

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_HPP_
