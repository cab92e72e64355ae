// The libfuse3 low-level handlers that put a View behind a mount point.
//
// Handlers only translate: look up nodes, fill attributes, copy bytes out of
// View::Read, map Status to errno. The tree is immutable, so inode numbers are node
// ids + 1 (FUSE_ROOT_ID is the root), entries and attributes are cached for a day, and
// forget is a no-op.
#ifndef CKPTFS_FUSE_FILESYSTEM_HPP_
#define CKPTFS_FUSE_FILESYSTEM_HPP_

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "ckptfs/view.hpp"

namespace ckptfs::fuse {

// Largest read the kernel is asked to send in one request (max_pages = 256).
constexpr unsigned kMaxRequestBytes = 1u << 20;

class PushAhead;
class Passthrough;

struct Filesystem {
  std::unique_ptr<View> view;
  // Owner and group of what the mount serves where the source's files say none (remote).
  uid_t uid = 0;
  gid_t gid = 0;
  // The most restrictive owner, group and mode of all the source's files (those that have
  // them), for files made of several and for folders; made on first request.
  std::optional<FileAccess> tree_access;
  std::once_flag tree_access_once;
  uint64_t total_bytes = 0;  // sum of file sizes, for statfs, summed on the first
  std::once_flag total_bytes_once;
  // user.ckptfs.xxh3 values, computed on first request and kept for the mount's life.
  std::mutex hash_mutex;
  std::unordered_map<View::NodeId, uint64_t> hashes;
  // The kernel sizes buffered FUSE reads by the mount's readahead window, 128 KiB by
  // default; a daemon can only lower it at INIT, and the kernel applies INIT's value after the
  // reply, overwriting any earlier change. Raising the window through sysfs (this file; root
  // only) after INIT lets sequential readers get 1 MiB requests (a quarter of the round trips):
  // the first LOOKUP, GETATTR or OPEN does it, before any READ can come.
  std::string readahead_knob;
  std::once_flag readahead_raised;
  // Pushes bytes ahead of readers into the kernel's cache (push_ahead.hpp); null when off.
  PushAhead* push_ahead = nullptr;
  // Serves the files that are source files unchanged by the kernel (passthrough.hpp); null
  // when the mount has no hooks.
  Passthrough* passthrough = nullptr;
};

// Inode numbers are node ids shifted by one so the root is FUSE_ROOT_ID.
inline View::NodeId NodeOf(fuse_ino_t ino) { return static_cast<View::NodeId>(ino - FUSE_ROOT_ID); }
inline fuse_ino_t InodeOf(View::NodeId id) { return static_cast<fuse_ino_t>(id) + FUSE_ROOT_ID; }

// The operations table; session userdata must be a Filesystem*.
const fuse_lowlevel_ops& Operations();

}  // namespace ckptfs::fuse

#endif  // CKPTFS_FUSE_FILESYSTEM_HPP_
