#include "fuse/source_watcher.hpp"

#include "fuse/push_ahead.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <set>
#include <string>

namespace ckptfs::fuse {
namespace {

constexpr uint32_t kFileEvents = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF;
// A file replaced by rename or re-created shows up as events on its folder.
constexpr uint32_t kDirEvents = IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE;

}  // namespace

bool SourceWatcher::Start(fuse_session* session, const Filesystem* fs) {
  session_ = session;
  fs_ = fs;
  inotify_fd_ = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (inotify_fd_ < 0 || stop_fd_ < 0) return false;
  const SourceFiles& files = *fs->view->source().files;
  std::set<std::string> dirs;
  for (uint32_t f = 0; f < files.count(); ++f) {
    // Sources that are not local files cannot be watched: their reads' identity checks
    // are all there is.
    const std::string& path = files.file(f).local_path();
    if (path.empty()) continue;
    ::inotify_add_watch(inotify_fd_, path.c_str(), kFileEvents);
    size_t slash = path.rfind('/');
    dirs.insert(slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash)));
  }
  for (const auto& d : dirs) ::inotify_add_watch(inotify_fd_, d.c_str(), kDirEvents);
  thread_ = std::thread([this] { Run(); });
  return true;
}

void SourceWatcher::Stop() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof one);
    thread_.join();
  }
  if (inotify_fd_ >= 0) ::close(inotify_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
  inotify_fd_ = stop_fd_ = -1;
}

void SourceWatcher::Run() {
  const SourceFiles& files = *fs_->view->source().files;
  std::set<std::string> names;  // base names of source files, to filter folder events
  for (uint32_t f = 0; f < files.count(); ++f) {
    const std::string& path = files.file(f).local_path();
    if (!path.empty()) names.insert(path.substr(path.rfind('/') + 1));
  }
  alignas(inotify_event) char buf[16384];
  for (;;) {
    pollfd fds[2] = {{inotify_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;
    if (fds[1].revents) return;
    bool changed = false;
    ssize_t n;
    while ((n = ::read(inotify_fd_, buf, sizeof buf)) > 0) {
      for (ssize_t off = 0; off < n;) {
        const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
        off += static_cast<ssize_t>(sizeof(inotify_event) + ev->len);
        // Folder events name a child; only those about our files matter.
        if (ev->len > 0 && !names.count(ev->name)) continue;
        changed = true;
      }
    }
    if (changed) InvalidateAll();
  }
}

void SourceWatcher::InvalidateAll() {
  fuse_log(FUSE_LOG_WARNING, "ckptfs: a source file changed; dropping cached pages, reads of it now fail\n");
  // No push may land after the pages are dropped.
  if (fs_->push_ahead) fs_->push_ahead->Disable();
  for (View::NodeId id = 0; id < fs_->view->node_count(); ++id) {
    if (fs_->view->IsDir(id)) continue;
    // Offset 0, length 0: all cached pages of the inode.
    fuse_lowlevel_notify_inval_inode(session_, InodeOf(id), 0, 0);
  }
}

}  // namespace ckptfs::fuse
