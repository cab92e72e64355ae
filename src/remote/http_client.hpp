// HttpClient: one HTTP request at a time per calling thread, over a pool of libcurl handles
// that keep their connections open between requests, with the retry policy of every remote
// read: timeouts, connection resets, 5xx answers and bodies that are short or label another
// range than the one asked for are tried again with backoff; the last failure becomes one
// error naming the URL. Credentials never enter a message.
// Thread-safety: Send may be called concurrently.
#ifndef CKPTFS_REMOTE_HTTP_CLIENT_HPP_
#define CKPTFS_REMOTE_HTTP_CLIENT_HPP_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckptfs/remote.hpp"
#include "ckptfs/status.hpp"
#include "remote/aws_credentials.hpp"

namespace ckptfs {

struct HttpRequest {
  std::string url;      // what is sent (an S3 request carries its query here)
  std::string display;  // how messages name it (a URL the user wrote, never a credential)
  bool head = false;
  // A ranged GET of [offset, offset+length): the answer must be 206 with exactly that
  // Content-Range (of an object of `object_size` bytes) and exactly that many bytes.
  bool ranged = false;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t object_size = 0;
  char* out = nullptr;  // where the range's bytes go (length bytes)
  // A small whole body (an S3 listing, an error document), up to body_limit bytes.
  std::string* body = nullptr;
  size_t body_limit = 0;
  // The identity the object had at open: a ranged GET sends If-Match and any other ETag
  // or a 412 answer is kSourceChanged.
  std::string if_match;
  // Sign with AWS SigV4 (S3); null: unsigned.
  const AwsSigning* signing = nullptr;
  bool follow_redirects = true;
};

struct HttpResponse {
  long status = 0;
  std::string etag;
  std::string last_modified;
  int64_t content_length = -1;
  std::string content_range;
};

class HttpClient {
 public:
  explicit HttpClient(const RemoteOptions& options);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Sends `request`, retrying transient failures. Any final HTTP status is returned in
  // *response with an OK status for the caller to judge (HEAD, listings), except for
  // ranged GETs, which succeed only with the exact bytes asked for.
  Status Send(const HttpRequest& request, HttpResponse* response);

  // Ends every transfer in flight and fails every later request at once: the source is
  // going away (unmount), and nothing may wait out a timeout for it.
  void Abort() { aborted_.store(true); }

 private:
  void* Acquire();
  void Release(void* handle);
  Status TryOnce(const HttpRequest& request, HttpResponse* response, bool* transient, std::string* reason);

  RemoteOptions options_;
  std::atomic<bool> aborted_{false};
  std::mutex mu_;
  std::vector<void*> idle_;  // CURL* handles with live connections
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_HTTP_CLIENT_HPP_
