// RemoteFile: a SourceFile whose bytes are fetched by range from an HTTP(S) or S3 object,
// through the source's BlockCache (and DiskCache), with sequential readahead on the
// FetchPool. The object's ETag, size and Last-Modified are recorded at open; every answer is
// checked against them, and once an answer shows another object the file fails every read
// (kSourceChanged), so no read mixes bytes of two versions.
#ifndef CKPTFS_REMOTE_REMOTE_FILE_HPP_
#define CKPTFS_REMOTE_REMOTE_FILE_HPP_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "ckptfs/env.hpp"
#include "ckptfs/remote.hpp"
#include "remote/aws_credentials.hpp"
#include "remote/block_cache.hpp"
#include "remote/buffer_pool.hpp"
#include "remote/disk_cache.hpp"
#include "remote/disk_cache_budget.hpp"
#include "remote/fetch_pool.hpp"
#include "remote/http_client.hpp"

namespace ckptfs {

// What the files of one remote source share. Declared last-destroyed-first: the pool stops
// (dropping queued readahead) before the cache and client it uses go away.
struct RemoteContext {
  explicit RemoteContext(const RemoteOptions& o);
  RemoteOptions options;
  HttpClient client;
  std::shared_ptr<BufferPool> buffers;  // before the cache: its blocks return buffers here
  BlockCache cache;
  std::unique_ptr<DiskCacheBudget> disk_budget;  // when cache_dir is set (files hold the context, so it outlives their DiskCaches)
  std::atomic<uint64_t> next_object_id{1};
  FetchPool pool;
};

// One object as the Env found it at open.
struct RemoteObject {
  std::string display;      // the URL the user knows it by
  std::string request_url;  // what a GET of it sends
  const AwsSigning* signing = nullptr;
  bool follow_redirects = true;
  FileIdentity identity;    // size, mtime_ns (Last-Modified), version (ETag)
};

// A HEAD of `object.request_url` filling its identity; 403 and 404 are clear errors.
Status HeadObject(RemoteContext& context, RemoteObject* object);

// Seconds since the epoch of an HTTP date ("Tue, 15 Nov 1994 08:12:31 GMT"), or 0.
int64_t ParseHttpDate(const std::string& text);

class RemoteFile final : public SourceFile {
 public:
  static Status Open(std::shared_ptr<RemoteContext> context, RemoteObject object, std::unique_ptr<SourceFile>* out);
  ~RemoteFile() override;

  const std::string& name() const override;
  const FileIdentity& identity() const override;
  Status Read(uint64_t offset, size_t length, void* out) const override;
  // Remote objects are checked on every answer, not by polling: kSourceChanged once an
  // answer has shown the object changed.
  Status CheckUnchanged() const override;

  struct State;  // shared with readahead jobs, which may outlive a read

 private:
  explicit RemoteFile(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_REMOTE_FILE_HPP_
