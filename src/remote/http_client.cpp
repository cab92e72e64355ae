#include "remote/http_client.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "remote/remote_counters.hpp"

namespace ckptfs {
namespace {

// libcurl's global state is set up once, before any thread makes a handle.
void InitCurlOnce() {
  static const bool done = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }();
  (void)done;
}

bool StartsWithNoCase(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(s[i])) != std::tolower(static_cast<unsigned char>(prefix[i])))
      return false;
  return true;
}

std::string Trim(std::string_view s) {
  while (!s.empty() && (s.back() == '\r' || s.back() == '\n' || s.back() == ' ' || s.back() == '\t'))
    s.remove_suffix(1);
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  return std::string(s);
}

// The state of one transfer, shared with libcurl's callbacks.
struct Attempt {
  const HttpRequest* request;
  HttpResponse* response;
  uint64_t received = 0;  // body bytes of the current response
  uint64_t counted = 0;   // body bytes of all responses (redirects too), counted once at the end
  bool overflow = false;  // more body than asked for: the transfer was cut
};

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  auto* a = static_cast<Attempt*>(user);
  const size_t n = size * count;
  std::string_view line(data, n);
  HttpResponse* r = a->response;
  if (StartsWithNoCase(line, "HTTP/")) {
    // A new response (after a redirect or a 100 Continue): forget the previous headers.
    *r = HttpResponse{};
    a->received = 0;
    if (a->request->body) a->request->body->clear();
  } else if (StartsWithNoCase(line, "etag:")) {
    r->etag = Trim(line.substr(5));
  } else if (StartsWithNoCase(line, "last-modified:")) {
    r->last_modified = Trim(line.substr(14));
  } else if (StartsWithNoCase(line, "content-length:")) {
    const std::string v = Trim(line.substr(15));
    char* end = nullptr;
    errno = 0;
    const unsigned long long len = std::strtoull(v.c_str(), &end, 10);
    if (errno == 0 && end && *end == '\0' && !v.empty()) r->content_length = static_cast<int64_t>(len);
  } else if (StartsWithNoCase(line, "content-range:")) {
    r->content_range = Trim(line.substr(14));
  }
  return n;
}

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  auto* a = static_cast<Attempt*>(user);
  const size_t n = size * count;
  const HttpRequest& req = *a->request;
  if (req.ranged && req.out) {
    // More than the range (an error page, a whole object from a server that ignored Range)
    // is cut off; what did arrive is judged after the transfer.
    if (a->received + n > req.length) {
      a->overflow = true;
      return 0;  // cuts the transfer: CURLE_WRITE_ERROR
    }
    std::memcpy(req.out + a->received, data, n);
  } else if (req.body) {
    if (a->received + n > req.body_limit) {
      a->overflow = true;
      return 0;
    }
    req.body->append(data, n);
  }
  a->received += n;
  a->counted += n;
  return n;
}

int OnProgress(void* aborted, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  return static_cast<const std::atomic<bool>*>(aborted)->load() ? 1 : 0;
}

}  // namespace

HttpClient::HttpClient(const RemoteOptions& options) : options_(options) { InitCurlOnce(); }

HttpClient::~HttpClient() {
  for (void* h : idle_) curl_easy_cleanup(static_cast<CURL*>(h));
}

void* HttpClient::Acquire() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      void* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  return curl_easy_init();
}

void HttpClient::Release(void* handle) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_.push_back(handle);
}

namespace {

// "bytes FIRST-LAST/TOTAL" as asked for?
bool ContentRangeIs(const std::string& header, uint64_t first, uint64_t last, uint64_t total) {
  const std::string expected =
      "bytes " + std::to_string(first) + "-" + std::to_string(last) + "/" + std::to_string(total);
  return header == expected;
}

Status Failed(const HttpRequest& req, std::string what, std::string* reason) {
  *reason = std::move(what);
  return Status::FromErrno(req.display, *reason, EIO);
}

// The handle's options for one request: callbacks into `a`, redirects, timeouts, the range,
// and the If-Match and S3 signing headers. Returns the header list, which the caller frees
// after the request; the handle points into `error`, `range` and `sigv4` until then.
curl_slist* SetRequestOptions(CURL* h, const HttpRequest& req, const RemoteOptions& options,
                              std::atomic<bool>* aborted, Attempt* a, char* error, std::string* range,
                              std::string* sigv4) {
  curl_slist* headers = nullptr;
  curl_easy_setopt(h, CURLOPT_URL, req.url.c_str());
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &OnHeader);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, a);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &OnBody);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, a);
  curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, req.follow_redirects ? 1L : 0L);
  curl_easy_setopt(h, CURLOPT_MAXREDIRS, 8L);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  // A server that stops sending is abandoned after timeout_seconds without a byte, so no
  // reader waits forever; a slow but moving transfer is never cut.
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, static_cast<long>(options.timeout_seconds));
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(options.timeout_seconds));
  curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  // The project's one version number (CMakeLists.txt), so a server's logs tell releases apart.
  curl_easy_setopt(h, CURLOPT_USERAGENT, "ckptfs/" CKPTFS_VERSION);
  if (!options.ca_file.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, options.ca_file.c_str());
  // Fewer, larger writes into the block buffers on fast links.
  curl_easy_setopt(h, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, &OnProgress);
  curl_easy_setopt(h, CURLOPT_XFERINFODATA, aborted);
  if (req.head) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  if (req.ranged) {
    *range = std::to_string(req.offset) + "-" + std::to_string(req.offset + req.length - 1);
    curl_easy_setopt(h, CURLOPT_RANGE, range->c_str());
  }
  if (!req.if_match.empty()) headers = curl_slist_append(headers, ("If-Match: " + req.if_match).c_str());
  if (req.signing && !req.signing->anonymous()) {
    *sigv4 = "aws:amz:" + req.signing->region + ":s3";
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4->c_str());
    curl_easy_setopt(h, CURLOPT_USERNAME, req.signing->access_key_id.c_str());
    curl_easy_setopt(h, CURLOPT_PASSWORD, req.signing->secret_access_key.c_str());
    // S3 wants the payload's hash named; a GET or HEAD has none to sign.
    headers = curl_slist_append(headers, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!req.signing->session_token.empty())
      headers = curl_slist_append(headers, ("x-amz-security-token: " + req.signing->session_token).c_str());
  }
  if (headers) curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  return headers;
}

// Whether a failed transfer may succeed when tried again: not after an abort, nor for a URL,
// protocol, host name, certificate or redirect chain that stays what it is.
bool TransientCurlError(CURLcode rc) {
  return rc != CURLE_ABORTED_BY_CALLBACK && rc != CURLE_UNSUPPORTED_PROTOCOL && rc != CURLE_URL_MALFORMAT &&
         rc != CURLE_COULDNT_RESOLVE_HOST && rc != CURLE_SSL_CACERT && rc != CURLE_SSL_CACERT_BADFILE &&
         rc != CURLE_PEER_FAILED_VERIFICATION && rc != CURLE_TOO_MANY_REDIRECTS;
}

// The answer to a ranged GET: the object must be the one that was opened, and the bytes
// exactly the range.
Status CheckRangedAnswer(const HttpRequest& req, const HttpResponse& resp, const Attempt& a, bool* transient,
                         std::string* reason) {
  const long status = resp.status;
  if (status == 412) return Status::SourceChanged(req.display, "object changed since it was indexed (ETag differs)");
  if (status == 404 || status == 410)
    return Status::SourceChanged(req.display, "object was removed since it was indexed");
  if (status == 200 && !req.if_match.empty() && !resp.etag.empty() && resp.etag != req.if_match)
    return Status::SourceChanged(req.display, "object changed since it was indexed (ETag differs)");
  // A server that ignores Range answers 200 with the whole object: that is the range
  // asked for when the range is the whole object (a small file).
  if (status == 200 && req.offset == 0 && req.length == req.object_size && !a.overflow &&
      a.received == req.length && (resp.content_length < 0 || static_cast<uint64_t>(resp.content_length) == req.length))
    return Status::OK();
  if (status != 206) {
    if (status == 200) {
      *transient = true;
      return Failed(req, "the server answered a range request with the whole object", reason);
    }
    return Failed(req, "HTTP " + std::to_string(status) + " for a range read", reason);
  }
  if (!req.if_match.empty() && !resp.etag.empty() && resp.etag != req.if_match)
    return Status::SourceChanged(req.display, "object changed since it was indexed (ETag differs)");
  const uint64_t last = req.offset + req.length - 1;
  if (!ContentRangeIs(resp.content_range, req.offset, last, req.object_size)) {
    // A different total is a different object; a different range is a faulty answer.
    const std::string total_suffix = "/" + std::to_string(req.object_size);
    const std::string& cr = resp.content_range;
    if (cr.size() > total_suffix.size() && cr.rfind('/') != std::string::npos &&
        cr.substr(cr.rfind('/')) != total_suffix && cr.substr(cr.rfind('/')) != "/*")
      return Status::SourceChanged(req.display, "object changed since it was indexed (size differs)");
    *transient = true;
    return Failed(req, "answer labelled '" + cr + "' for bytes " + std::to_string(req.offset) + "-" +
                           std::to_string(last), reason);
  }
  if (a.overflow || a.received != req.length) {
    *transient = true;
    return Failed(req, "body of " + std::to_string(a.received) + (a.overflow ? "+" : "") + " bytes for a range of " +
                           std::to_string(req.length), reason);
  }
  return Status::OK();
}

}  // namespace

Status HttpClient::TryOnce(const HttpRequest& req, HttpResponse* resp, bool* transient, std::string* reason) {
  *transient = false;
  *resp = HttpResponse{};
  CURL* h = static_cast<CURL*>(Acquire());
  if (!h) return Failed(req, "cannot start an HTTP request", reason);
  // reset keeps the handle's open connections, so the next request reuses one.
  curl_easy_reset(h);
  Attempt a{&req, resp};
  char error[CURL_ERROR_SIZE] = {0};
  std::string range, sigv4;
  curl_slist* headers = SetRequestOptions(h, req, options_, &aborted_, &a, error, &range, &sigv4);

  CountRequest();
  const CURLcode rc = curl_easy_perform(h);
  // Once per request: an atomic add per write callback contended between the fetching
  // threads (about 1 % of the daemon in a profile).
  CountBytes(a.counted);
  long status = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  resp->status = status;
  // The secret must not outlive the request in a pooled handle.
  curl_easy_setopt(h, CURLOPT_PASSWORD, "");
  curl_slist_free_all(headers);
  if (rc != CURLE_OK && !(rc == CURLE_WRITE_ERROR && a.overflow)) {
    // Leave a handle whose connection may be broken out of the pool.
    curl_easy_cleanup(h);
    *transient = TransientCurlError(rc);
    return Failed(req, error[0] ? std::string(error) : std::string(curl_easy_strerror(rc)), reason);
  }
  Release(h);

  if (status >= 500 || status == 429 || status == 408) {
    *transient = true;
    return Failed(req, "HTTP " + std::to_string(status) + " from the server", reason);
  }
  if (!req.ranged) return Status::OK();
  return CheckRangedAnswer(req, *resp, a, transient, reason);
}

Status HttpClient::Send(const HttpRequest& request, HttpResponse* response) {
  const int tries = 1 + std::max(0, options_.retries);
  Status last;
  std::string reason;
  for (int attempt = 0; attempt < tries; ++attempt) {
    if (aborted_.load()) return Status::FromErrno(request.display, "the source is closing", EIO);
    if (attempt > 0) {
      CountRetry();
      // 100 ms, 200 ms, 400 ms ... at most 2 s between tries.
      const int delay_ms = std::min(2000, 100 << std::min(attempt - 1, 5));
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    }
    bool transient = false;
    last = TryOnce(request, response, &transient, &reason);
    if (last.ok() || !transient) return last;
  }
  return Status::FromErrno(request.display, "gave up after " + std::to_string(tries) + " tries (last: " + reason + ")", EIO);
}

}  // namespace ckptfs
