// http:// and https:// sources as an Env: files are fetched by range from any web server
// that answers Range requests (nginx, a CDN, a model hub). Plain HTTP has no folder
// listing: a URL ending in '/' is a folder that cannot be listed, and the folder reader
// finds its files by the names an index or the Hugging Face layout gives.
#include "remote/remote_envs.hpp"

#include <cerrno>
#include <map>
#include <mutex>

#include "remote/remote_file.hpp"

namespace ckptfs {
namespace {

class HttpEnv final : public Env {
 public:
  explicit HttpEnv(const RemoteOptions& options) : context_(std::make_shared<RemoteContext>(options)) {}

  ~HttpEnv() override {
    context_->client.Abort();
    context_->pool.Stop();
  }

  Status Open(const std::string& path, std::unique_ptr<SourceFile>* out) override {
    RemoteObject object;
    object.display = path;
    object.request_url = path;
    if (!TakeStatted(path, &object)) CKPTFS_RETURN_IF_ERROR(HeadObject(*context_, &object));
    return RemoteFile::Open(context_, std::move(object), out);
  }

  Status Stat(const std::string& path, PathType* type) override {
    if (!path.empty() && path.back() == '/') {
      *type = PathType::kFolder;
      return Status::OK();
    }
    RemoteObject object;
    object.display = path;
    object.request_url = path;
    Status s = HeadObject(*context_, &object);
    if (s.code() == Status::Code::kNotFound) {
      *type = PathType::kMissing;
      return Status::OK();
    }
    CKPTFS_RETURN_IF_ERROR(s);
    *type = PathType::kFile;
    std::lock_guard<std::mutex> lock(mu_);
    statted_[path] = object.identity;
    return Status::OK();
  }

  Status ListFolder(const std::string& path, std::vector<FolderEntry>* out) override {
    return FolderNotListable(path);
  }

  // Remote files read ahead themselves (RemoteOptions::readahead_bytes), and their identity
  // is no local file's.
  EnvTraits traits() const override { return EnvTraits{}; }
  bool fetch_counters(FetchCounters* out) const override {
    *out = RemoteCountersNow();
    return true;
  }

 private:
  // A reader stats a file and then opens it: the open takes the identity the stat's HEAD
  // found instead of sending a second one (once; a later open asks the server again).
  bool TakeStatted(const std::string& path, RemoteObject* object) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = statted_.find(path);
    if (it == statted_.end()) return false;
    object->identity = it->second;
    statted_.erase(it);
    return true;
  }

  std::shared_ptr<RemoteContext> context_;
  std::mutex mu_;
  std::map<std::string, FileIdentity> statted_;
};

}  // namespace

std::shared_ptr<Env> MakeHttpEnv(const RemoteOptions& options) { return std::make_shared<HttpEnv>(options); }

}  // namespace ckptfs
