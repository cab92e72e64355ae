// FUSE passthrough (Linux 6.9+): a served file whose bytes are one source file's, whole and
// unchanged (View::SameAsSourceFile), is opened so that the kernel reads and maps it straight
// from the source file, at that file's speed, with ckptfs out of its data path. Every other
// file, and every file where the kernel, the privileges or the option do not allow it, is
// read through the copy path (View::Read).
//
// libfuse 3.14 has no API for it, so this file speaks the few words of the protocol itself,
// through the session's custom I/O (fuse_session_custom_io): the `read` hook sees each request
// as the kernel wrote it (only the INIT request says whether the kernel offers passthrough),
// and the `writev` hook patches two kinds of reply in place before the kernel reads them: the
// INIT reply (FUSE_PASSTHROUGH, max_stack_depth) and the OPEN reply of a passthrough file
// (FOPEN_PASSTHROUGH, the backing id; page-cache flags cleared). The kernel facts this relies
// on are in doc/MOUNT.md, "Passthrough".
//
// Which reply to patch is known without parsing replies: libfuse sends a request's reply from
// the thread that handles it, inside the handler's fuse_reply_* call, so the handler marks its
// thread (thread-local) just before replying.
#ifndef CKPTFS_FUSE_PASSTHROUGH_HPP_
#define CKPTFS_FUSE_PASSTHROUGH_HPP_

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "ckptfs/view.hpp"

namespace ckptfs::fuse {

class Passthrough {
 public:
  // `enabled`: -o passthrough=auto (true) or off.
  explicit Passthrough(bool enabled) : enabled_(enabled) {}
  Passthrough(const Passthrough&) = delete;
  Passthrough& operator=(const Passthrough&) = delete;
  ~Passthrough();

  // Counts the files of `view` that passthrough could serve and decides whether to ask the
  // kernel for it at all (the option, the source's kind, the daemon's privileges). Call once,
  // before Install.
  void Prepare(const View& view);
  // Puts the hooks on mounted session `se` (its descriptor), where Prepare decided to ask the
  // kernel. False when libfuse refuses them; the copy path then serves everything.
  bool Install(fuse_session* se);

  // From the init handler: asks for passthrough in the INIT reply about to be sent, when the
  // kernel offered it and Prepare found a reason to.
  void OnInit();

  // What an OPEN of file `node` (inode `ino`) gets.
  enum class OpenMode { kCopy, kPassthrough, kFailed };
  // For an open of a file whose bytes are source file `file` of `files`: kPassthrough with
  // *backing_id set (reply with ReplyOpen), kCopy (serve it through View::Read), or kFailed with
  // *error the errno to reply (the source changed since it was indexed: EIO, logged).
  OpenMode Open(fuse_ino_t ino, const SourceFiles& files, uint32_t file, int* backing_id, int* error);
  // Replies to an OPEN that Open gave kPassthrough; undoes the open when the reply fails.
  int ReplyOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi, int backing_id);
  // From the release handler, for every file.
  void Release(fuse_ino_t ino);

  // Drops CAP_SYS_ADMIN from the daemon for good: the tests' way to run a mount as one that
  // was started without it (where /dev/fuse is root's, no other user can mount at all).
  static bool DropSysAdmin();
  // Asks the kernel even without CAP_SYS_ADMIN, so that its refusal is met at the first open
  // (a test of the fallback).
  void AskWithoutPrivilege() { ask_without_privilege_ = true; }

  // How the mount stands, as JSON: {"mode", "active", "files", "opened_files", "why"} ("why"
  // when no file can be served by passthrough, or why some fell back).
  std::string StatusJson() const;
  // One line for the log.
  std::string StatusLine() const;

 private:
  struct Backing {
    int id = 0;
    uint32_t opens = 0;
  };
  static ssize_t ReadHook(int fd, void* buf, size_t len, void* userdata);
  static ssize_t WritevHook(int fd, struct iovec* iov, int count, void* userdata);
  void TurnOff(const std::string& why);
  void CloseBacking(const Backing& b);

  const bool enabled_;
  int dev_fd_ = -1;             // the session's /dev/fuse descriptor
  uint32_t stack_depth_ = 1;    // max_stack_depth asked for (2 when a source is on overlayfs)
  uint64_t eligible_files_ = 0;  // files whose bytes are a source file's
  bool ask_ = false;            // Prepare: worth asking the kernel
  bool ask_without_privilege_ = false;
  std::atomic<bool> kernel_offers_{false};  // the INIT request had FUSE_PASSTHROUGH
  std::atomic<bool> asked_{false};          // asked for in the INIT reply
  std::atomic<bool> active_{false};         // and not turned off since
  mutable std::mutex mutex_;
  std::string why_;  // why none, or why one fell back
  std::unordered_map<fuse_ino_t, Backing> backings_;
  std::unordered_set<fuse_ino_t> copy_only_;  // fell back once: every later open too
  std::unordered_set<fuse_ino_t> ever_opened_;  // files opened in passthrough at least once
};

}  // namespace ckptfs::fuse

#endif  // CKPTFS_FUSE_PASSTHROUGH_HPP_
