// s3://BUCKET/KEY sources as an Env: objects are fetched by signed range GETs (SigV4 by
// libcurl), "folders" are key prefixes listed with ListObjectsV2, so ZeRO, DCP and Hugging
// Face folders in a bucket read as they do on disk. Requests go path-style to the endpoint
// of AWS_ENDPOINT_URL (S3-compatible stores), or virtual-hosted to AWS itself.
#include <algorithm>
#include <cerrno>
#include <map>
#include <mutex>
#include <set>

#include "remote/remote_envs.hpp"
#include "remote/remote_file.hpp"
#include "remote/s3_listing.hpp"
#include "remote/url.hpp"

namespace ckptfs {
namespace {

// Bounds one listing: a folder of a checkpoint has thousands of files, not millions.
constexpr size_t kMaxListingPages = 1000;
constexpr size_t kMaxListingBodyBytes = 16 << 20;

class S3Env final : public Env {
 public:
  S3Env(const RemoteOptions& options, const S3Settings& settings)
      : context_(std::make_shared<RemoteContext>(options)), settings_(settings) {}

  ~S3Env() override {
    context_->client.Abort();
    context_->pool.Stop();
  }

  // Remote files read ahead themselves (RemoteOptions::readahead_bytes), and their identity
  // is no local file's.
  EnvTraits traits() const override { return EnvTraits{}; }
  bool fetch_counters(FetchCounters* out) const override {
    *out = RemoteCountersNow();
    return true;
  }

  Status Open(const std::string& path, std::unique_ptr<SourceFile>* out) override {
    RemoteObject object;
    CKPTFS_RETURN_IF_ERROR(ObjectOf(path, &object));
    if (!TakeKnown(path, &object.identity)) CKPTFS_RETURN_IF_ERROR(HeadObject(*context_, &object));
    return RemoteFile::Open(context_, std::move(object), out);
  }

  Status Stat(const std::string& path, PathType* type) override {
    std::string bucket, key;
    if (!SplitS3Url(path, &bucket, &key)) return Status::InvalidArgument(path, "not an s3://BUCKET/KEY URL");
    if (!key.empty()) {
      RemoteObject object;
      CKPTFS_RETURN_IF_ERROR(ObjectOf(path, &object));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (known_.count(path)) {
          *type = PathType::kFile;
          return Status::OK();
        }
      }
      Status s = HeadObject(*context_, &object);
      if (s.ok()) {
        *type = PathType::kFile;
        Remember(path, object.identity);
        return Status::OK();
      }
      if (s.code() != Status::Code::kNotFound) return s;
    }
    // A "folder" is a prefix under which some key exists.
    S3ListingPage page;
    CKPTFS_RETURN_IF_ERROR(ListPage(path, bucket, key.empty() ? "" : key + "/", "", 1, &page));
    *type = page.objects.empty() && page.prefixes.empty() ? PathType::kMissing : PathType::kFolder;
    return Status::OK();
  }

  Status ListFolder(const std::string& path, std::vector<FolderEntry>* out) override {
    out->clear();
    std::string bucket, key;
    if (!SplitS3Url(path, &bucket, &key)) return Status::InvalidArgument(path, "not an s3://BUCKET/KEY URL");
    const std::string prefix = key.empty() ? "" : key + "/";
    std::string token;
    std::set<std::string> files, folders;
    for (size_t pages = 0;; ++pages) {
      if (pages == kMaxListingPages)
        return Status::Refused(path, "folder has more than " + std::to_string(kMaxListingPages) + " pages of keys");
      S3ListingPage page;
      CKPTFS_RETURN_IF_ERROR(ListPage(path, bucket, prefix, token, 1000, &page));
      for (const S3Object& o : page.objects) {
        if (o.key.size() <= prefix.size() || !StartsWith(o.key, prefix)) continue;
        const std::string name = o.key.substr(prefix.size());
        if (name.find('/') != std::string::npos) continue;
        files.insert(name);
        // The listing says what a HEAD would: opening the file needs no request of its own.
        FileIdentity identity;
        identity.size = o.size;
        identity.mtime_ns = o.last_modified * 1000000000;
        identity.version = o.etag;
        Remember(JoinPath(path, name), identity);
      }
      for (const std::string& p : page.prefixes) {
        if (p.size() <= prefix.size() + 1 || !StartsWith(p, prefix)) continue;
        folders.insert(p.substr(prefix.size(), p.size() - prefix.size() - 1));
      }
      if (!page.truncated || page.next_token.empty()) break;
      token = page.next_token;
    }
    for (const std::string& f : files) out->push_back(FolderEntry{f, PathType::kFile});
    for (const std::string& d : folders)
      if (!files.count(d)) out->push_back(FolderEntry{d, PathType::kFolder});
    std::sort(out->begin(), out->end(), [](const FolderEntry& a, const FolderEntry& b) { return a.name < b.name; });
    return Status::OK();
  }

 private:
  // What a HEAD or a listing found for a file, taken by the Open that follows (once: a
  // later open asks again), so a file costs one request at mount, not two.
  void Remember(const std::string& path, const FileIdentity& identity) {
    std::lock_guard<std::mutex> lock(mu_);
    known_[path] = identity;
  }
  bool TakeKnown(const std::string& path, FileIdentity* identity) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = known_.find(path);
    if (it == known_.end()) return false;
    *identity = it->second;
    known_.erase(it);
    return true;
  }

  // The URL of the bucket itself (no trailing slash).
  std::string BucketUrl(const std::string& bucket) const {
    if (!settings_.endpoint.empty()) return settings_.endpoint + "/" + PercentEncode(bucket, false);
    return "https://" + bucket + ".s3." + settings_.signing.region + ".amazonaws.com";
  }

  Status ObjectOf(const std::string& path, RemoteObject* object) const {
    std::string bucket, key;
    if (!SplitS3Url(path, &bucket, &key) || key.empty())
      return Status::InvalidArgument(path, "not an s3://BUCKET/KEY URL of an object");
    object->display = path;
    object->request_url = BucketUrl(bucket) + "/" + PercentEncode(key, true);
    object->signing = &settings_.signing;
    object->follow_redirects = false;
    return Status::OK();
  }

  Status ListPage(const std::string& path, const std::string& bucket, const std::string& prefix,
                  const std::string& token, int max_keys, S3ListingPage* page) {
    // Parameters in name order: SigV4 signs the canonical (sorted) query.
    std::string query = "?";
    if (!token.empty()) query += "continuation-token=" + PercentEncode(token, false) + "&";
    query += "delimiter=%2F&list-type=2&max-keys=" + std::to_string(max_keys);
    query += "&prefix=" + PercentEncode(prefix, false);
    HttpRequest req;
    req.url = BucketUrl(bucket) + "/" + query;
    req.display = path;
    std::string body;
    req.body = &body;
    req.body_limit = kMaxListingBodyBytes;
    req.signing = &settings_.signing;
    req.follow_redirects = false;
    HttpResponse resp;
    CKPTFS_RETURN_IF_ERROR(context_->client.Send(req, &resp));
    if (resp.status != 200) {
      const std::string code = S3ErrorCode(body);
      const std::string what = "cannot list (HTTP " + std::to_string(resp.status) + (code.empty() ? "" : " " + code) + ")";
      if (resp.status == 404) return Status::FromErrno(path, what, ENOENT);
      if (resp.status == 401 || resp.status == 403)
        return Status::FromErrno(path, what + ": check the AWS credentials and region", EACCES);
      return Status::FromErrno(path, what, EIO);
    }
    if (!ParseListObjectsV2(body, page)) return Status::Corruption(path, "the listing is not a ListBucketResult");
    return Status::OK();
  }

  std::shared_ptr<RemoteContext> context_;
  S3Settings settings_;
  std::mutex mu_;
  std::map<std::string, FileIdentity> known_;
};

}  // namespace

std::shared_ptr<Env> MakeS3Env(const RemoteOptions& options, const S3Settings& settings) {
  return std::make_shared<S3Env>(options, settings);
}

}  // namespace ckptfs
