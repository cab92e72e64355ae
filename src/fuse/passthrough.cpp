#include "fuse/passthrough.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "ckptfs/env.hpp"
#include "fuse/filesystem.hpp"

namespace ckptfs::fuse {
namespace {

// The kernel's FUSE protocol (uapi linux/fuse.h, 7.40 and later) where libfuse 3.14's copy of
// it (7.36) has no names. Offsets are of the structs' fields; the layouts are ABI.
constexpr uint32_t kOpcodeInit = 26;
constexpr size_t kInHeaderSize = 40;         // struct fuse_in_header
constexpr size_t kInitInFlags = 12;          // fuse_init_in.flags
constexpr size_t kInitInFlags2 = 16;         // fuse_init_in.flags2 (7.36)
constexpr size_t kInitOutSize = 64;          // struct fuse_init_out
constexpr size_t kInitOutFlags = 12;         // fuse_init_out.flags
constexpr size_t kInitOutFlags2 = 32;        // fuse_init_out.flags2
constexpr size_t kInitOutMaxStackDepth = 36;  // fuse_init_out.max_stack_depth (7.40)
constexpr uint32_t kInitExt = 1u << 30;          // FUSE_INIT_EXT: flags2 is meant
constexpr uint32_t kWritebackCache = 1u << 16;   // FUSE_WRITEBACK_CACHE: excludes passthrough
constexpr uint32_t kFlags2Passthrough = 1u << 5;  // FUSE_PASSTHROUGH (1ULL << 37) in flags2
constexpr size_t kOpenOutSize = 16;         // struct fuse_open_out
constexpr size_t kOpenOutFlags = 8;         // fuse_open_out.open_flags
constexpr size_t kOpenOutBackingId = 12;    // fuse_open_out.backing_id (7.40)
constexpr uint32_t kFopenPassthrough = 1u << 7;
// The only open flags the kernel takes beside FOPEN_PASSTHROUGH: DIRECT_IO, NOFLUSH and
// PARALLEL_DIRECT_WRITES; any other (KEEP_CACHE among them) fails the open.
constexpr uint32_t kFopenPassthroughAllowed = (1u << 0) | (1u << 5) | (1u << 6);
struct BackingMap {  // struct fuse_backing_map
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};
// _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t), on the /dev/fuse descriptor.
constexpr unsigned long kBackingOpen = _IOW(229, 1, BackingMap);
constexpr unsigned long kBackingClose = _IOW(229, 2, uint32_t);
static_assert(kBackingOpen == 0x4010E501 && kBackingClose == 0x4004E502);

constexpr long kOverlayfsMagic = 0x794c7630;
constexpr long kEcryptfsMagic = 0xf15f;

// What the next reply sent by this thread is to become (see the header): a passthrough OPEN
// reply with this backing id, or an INIT reply asking for passthrough.
thread_local int pending_backing_id = 0;
thread_local Passthrough* pending_init = nullptr;
thread_local bool open_reply_patched = false;

uint32_t LoadU32(const void* at) {
  uint32_t v;
  std::memcpy(&v, at, sizeof v);
  return v;
}
void StoreU32(void* at, uint32_t v) { std::memcpy(at, &v, sizeof v); }

// The daemon's capability sets, and the word and bit of CAP_SYS_ADMIN in them.
struct Capabilities {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  __user_cap_data_struct& sys_admin_word() { return data[CAP_SYS_ADMIN / 32]; }
  static constexpr uint32_t kSysAdminBit = 1u << (CAP_SYS_ADMIN % 32);
  bool Read() { return ::syscall(SYS_capget, &header, data) == 0; }
  bool Write() { return ::syscall(SYS_capset, &header, data) == 0; }
};

bool HasSysAdmin() {
  Capabilities caps;
  return caps.Read() && (caps.sys_admin_word().effective & Capabilities::kSysAdminBit) != 0;
}

}  // namespace

bool Passthrough::DropSysAdmin() {
  Capabilities caps;
  if (!caps.Read()) return false;
  caps.sys_admin_word().effective &= ~Capabilities::kSysAdminBit;
  caps.sys_admin_word().permitted &= ~Capabilities::kSysAdminBit;
  caps.sys_admin_word().inheritable &= ~Capabilities::kSysAdminBit;
  return caps.Write();
}

Passthrough::~Passthrough() {
  for (const auto& [ino, b] : backings_) CloseBacking(b);
}

void Passthrough::Prepare(const View& view) {
  std::set<std::string> folders;
  const SourceFiles& files = *view.source().files;
  for (View::NodeId id = 0; id < view.node_count(); ++id) {
    if (view.IsDir(id)) continue;
    if (const std::optional<uint32_t> f = view.SameAsSourceFile(id)) {
      ++eligible_files_;
      const std::string& path = files.path(*f);
      if (folders.size() < 64) folders.insert(path.substr(0, path.rfind('/') + 1));
    }
  }
  if (!enabled_) return TurnOff("-o passthrough=off");
  if (!files.env().traits().local_files) return TurnOff("the source is not on a local file system");
  if (eligible_files_ == 0) return TurnOff("no served file is a source file unchanged (the view transforms them all)");
  if (!HasSysAdmin() && !ask_without_privilege_) return TurnOff("the daemon lacks CAP_SYS_ADMIN, which the kernel requires for it");
  // A source on a stacking file system (overlayfs) needs a stack depth of 2; the mount itself
  // can then not be a layer of another overlay, so 1 where that is enough.
  for (const std::string& folder : folders) {
    struct statfs sf;
    if (::statfs(folder.empty() ? "." : folder.c_str(), &sf) == 0 &&
        (sf.f_type == kOverlayfsMagic || sf.f_type == kEcryptfsMagic))
      stack_depth_ = 2;
  }
  ask_ = true;
}

bool Passthrough::Install(fuse_session* se) {
  if (!ask_) return true;  // nothing to ask: libfuse's own I/O, as without passthrough
  dev_fd_ = fuse_session_fd(se);
  fuse_custom_io io{};
  io.read = ReadHook;
  io.writev = WritevHook;
  // Splice stays off (the init handler turns it off too): without splice hooks libfuse reads
  // and writes through ours only.
  if (fuse_session_custom_io(se, &io, dev_fd_) != 0) {
    TurnOff("libfuse refused the custom I/O hooks");
    return false;
  }
  return true;
}

ssize_t Passthrough::ReadHook(int fd, void* buf, size_t len, void* userdata) {
  const ssize_t n = ::read(fd, buf, len);
  Passthrough* self = static_cast<Filesystem*>(userdata)->passthrough;  // libfuse passes the session's userdata
  if (self != nullptr && n >= static_cast<ssize_t>(kInHeaderSize + kInitInFlags2 + 4)) {
    const char* in = static_cast<const char*>(buf);
    if (LoadU32(in + 4) == kOpcodeInit) {
      const uint32_t flags = LoadU32(in + kInHeaderSize + kInitInFlags);
      const uint32_t flags2 = (flags & kInitExt) ? LoadU32(in + kInHeaderSize + kInitInFlags2) : 0;
      self->kernel_offers_ = (flags2 & kFlags2Passthrough) != 0;
    }
  }
  return n;
}

ssize_t Passthrough::WritevHook(int fd, struct iovec* iov, int count, void* userdata) {
  (void)userdata;
  if (pending_init != nullptr) {
    Passthrough* self = pending_init;
    pending_init = nullptr;
    if (count == 2 && iov[1].iov_len == kInitOutSize) {
      char* out = static_cast<char*>(iov[1].iov_base);
      const uint32_t flags = LoadU32(out + kInitOutFlags);
      if (!(flags & kWritebackCache)) {
        StoreU32(out + kInitOutFlags, flags | kInitExt);
        StoreU32(out + kInitOutFlags2, LoadU32(out + kInitOutFlags2) | kFlags2Passthrough);
        StoreU32(out + kInitOutMaxStackDepth, self->stack_depth_);
        return ::writev(fd, iov, count);
      }
    }
    self->active_ = false;
    self->TurnOff("the INIT reply could not be extended");
  } else if (pending_backing_id != 0) {
    const int id = pending_backing_id;
    pending_backing_id = 0;
    if (count == 2 && iov[1].iov_len == kOpenOutSize) {
      char* out = static_cast<char*>(iov[1].iov_base);
      StoreU32(out + kOpenOutFlags, (LoadU32(out + kOpenOutFlags) & kFopenPassthroughAllowed) | kFopenPassthrough);
      StoreU32(out + kOpenOutBackingId, static_cast<uint32_t>(id));
      open_reply_patched = true;
    }
  }
  return ::writev(fd, iov, count);
}

void Passthrough::OnInit() {
  if (ask_ && !kernel_offers_) {
    TurnOff("the kernel does not offer it (Linux 6.9 or later with CONFIG_FUSE_PASSTHROUGH)");
  } else if (ask_) {
    pending_init = this;
    asked_ = true;
    active_ = true;  // unless the reply the hook patches is not an INIT reply (never seen)
  }
  fuse_log(FUSE_LOG_INFO, "ckptfs: %s\n", StatusLine().c_str());
}

void Passthrough::TurnOff(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  ask_ = false;
  if (why_.empty()) why_ = why;
}

void Passthrough::CloseBacking(const Backing& b) {
  uint32_t id = static_cast<uint32_t>(b.id);
  if (b.id > 0) ::ioctl(dev_fd_, kBackingClose, &id);
}

Passthrough::OpenMode Passthrough::Open(fuse_ino_t ino, const SourceFiles& files, uint32_t file, int* backing_id,
                                        int* error) {
  if (!asked_) return OpenMode::kCopy;
  // The copy path's own check first (the indexed file, through the daemon's descriptor, and
  // its path): a source that changed fails the open as it would fail a read.
  if (Status s = files.CheckUnchanged(file); !s.ok()) {
    fuse_log(FUSE_LOG_ERR, "ckptfs: open of a passthrough file failed: %s\n", s.message().c_str());
    *error = s.ToErrno();
    return OpenMode::kFailed;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (copy_only_.count(ino)) return OpenMode::kCopy;
    // The inode's opens must share one backing file, also after passthrough was turned off.
    if (auto it = backings_.find(ino); it != backings_.end()) {
      ++it->second.opens;
      *backing_id = it->second.id;
      return OpenMode::kPassthrough;
    }
    if (!active_) return OpenMode::kCopy;
  }
  // The kernel is given the file the daemon indexed and reads (its descriptor, just checked),
  // not a new open of the path, which could be another file by now.
  const int fd = files.file(file).descriptor();
  BackingMap map{fd, 0, 0};
  const int id = fd < 0 ? -1 : ::ioctl(dev_fd_, kBackingOpen, &map);
  const int err = fd < 0 ? EBADF : errno;
  std::lock_guard<std::mutex> lock(mutex_);
  if (id <= 0) {
    std::string why = "the kernel refused " + files.path(file) + " as a backing file: " + std::strerror(err);
    if (err == ELOOP) why += " (the source is on a stacked file system)";
    copy_only_.insert(ino);
    if (err == EPERM || err == ENOTTY) {
      // The connection or the privileges, not the file: no other file will do better.
      active_ = false;
      why_ = why;
    } else if (why_.empty()) {
      why_ = why;
    }
    fuse_log(FUSE_LOG_WARNING, "ckptfs: passthrough: %s; reading it through ckptfs\n", why.c_str());
    return OpenMode::kCopy;
  }
  auto [it, added] = backings_.try_emplace(ino, Backing{id, 0});
  if (!added) {  // another open of the inode registered it meanwhile: share that one
    uint32_t ours = static_cast<uint32_t>(id);
    ::ioctl(dev_fd_, kBackingClose, &ours);
  }
  ++it->second.opens;
  *backing_id = it->second.id;
  ever_opened_.insert(ino);
  return OpenMode::kPassthrough;
}

int Passthrough::ReplyOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi, int backing_id) {
  // The kernel refuses FOPEN_KEEP_CACHE with passthrough; the hook clears every flag it
  // refuses, these too so that libfuse's own state agrees.
  fi->keep_cache = 0;
  fi->direct_io = 0;
  pending_backing_id = backing_id;
  open_reply_patched = false;
  const int sent = fuse_reply_open(req, fi);
  pending_backing_id = 0;
  if (sent != 0) {
    Release(ino);  // the open was interrupted: no RELEASE will come for it
  } else if (!open_reply_patched) {
    // Sent as a cached open (a reply not shaped as libfuse 3.14 shapes it): its RELEASE will
    // come, but the inode stays on the copy path, whose opens exclude passthrough ones.
    std::lock_guard<std::mutex> lock(mutex_);
    copy_only_.insert(ino);
  }
  return sent;
}

void Passthrough::Release(fuse_ino_t ino) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = backings_.find(ino);
  if (it == backings_.end() || --it->second.opens > 0) return;
  // The kernel keeps the backing file while the inode is open; a later open takes a new one,
  // checked afresh.
  CloseBacking(it->second);
  backings_.erase(it);
}

std::string Passthrough::StatusJson() const {
  std::lock_guard<std::mutex> lock(mutex_);
  nlohmann::json j = {{"mode", enabled_ ? "auto" : "off"},
                      {"active", active_.load()},
                      {"files", active_ ? eligible_files_ : 0},
                      {"source_files_unchanged", eligible_files_},
                      {"opened_files", ever_opened_.size()}};
  if (!why_.empty()) j["why"] = why_;
  return j.dump();
}

std::string Passthrough::StatusLine() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (active_)
    return "passthrough: " + std::to_string(eligible_files_) +
           " files are served by the kernel straight from their source files" +
           (why_.empty() ? std::string() : " (some may fall back: " + why_ + ")");
  return "passthrough: no file is served by the kernel from its source file: " +
         (why_.empty() ? std::string("not asked for") : why_);
}

}  // namespace ckptfs::fuse
