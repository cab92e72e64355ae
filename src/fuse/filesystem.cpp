#include "fuse/filesystem.hpp"

#include "fuse/passthrough.hpp"
#include "fuse/push_ahead.hpp"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace ckptfs::fuse {
namespace {

// The tree never changes while mounted: let the kernel cache names and attributes.
constexpr double kCacheSeconds = 86400.0;
constexpr blksize_t kBlockSize = 1 << 20;
constexpr const char* kXattrDType = "user.ckptfs.dtype";
constexpr const char* kXattrShape = "user.ckptfs.shape";
constexpr const char* kXattrXxh3 = "user.ckptfs.xxh3";
// On the root: how the mount stands with passthrough (Passthrough::StatusJson).
constexpr const char* kXattrPassthrough = "user.ckptfs.passthrough";
// Directories with more entries than this are listed by the daemon every time instead of
// from the kernel's readdir cache. Filling that cache is the dearer part of a first listing
// (a million names: 0.63 s with it, 0.47 s without; a later listing 0.37 s from the cache,
// 0.42 s from the daemon) and it keeps ~64 bytes of page cache per name for as long as the
// mount lives, while the View answers a listing from tables it holds anyway.
constexpr size_t kMaxCachedListing = 65536;

Filesystem& Fs(fuse_req_t req) { return *static_cast<Filesystem*>(fuse_req_userdata(req)); }

bool Valid(const Filesystem& fs, fuse_ino_t ino) {
  return ino >= FUSE_ROOT_ID && NodeOf(ino) < fs.view->node_count();
}

// The access of a file made of all of `files` (doc/MOUNT.md, "Permissions"): the mode bits
// every one of them grants; their owner and group where they all share one, else the
// mount's (and no owner or group bits granted beyond what all grant others).
std::optional<FileAccess> MostRestrictive(const SourceFiles& files, uid_t mount_uid, gid_t mount_gid) {
  std::optional<FileAccess> out;
  bool same_uid = true, same_gid = true;
  for (uint32_t f = 0; f < files.count(); ++f) {
    const std::optional<FileAccess> a = files.file(f).access();
    if (!a) continue;
    if (!out) {
      out = a;
      continue;
    }
    out->mode &= a->mode;
    same_uid = same_uid && out->uid == a->uid;
    same_gid = same_gid && out->gid == a->gid;
  }
  if (!out) return out;
  if (!same_uid) {
    out->uid = mount_uid;
    out->mode &= ~(0700u & ~((out->mode & 07) << 6));  // the owner gets what others get
  }
  if (!same_gid) {
    out->gid = mount_gid;
    out->mode &= ~(070u & ~((out->mode & 07) << 3));
  }
  return out;
}

// What the mount serves of file or folder `id` may be read by whom its source allows: a file
// passed through has its source file's owner, group and mode, anything else the most
// restrictive of the source's; write bits cleared, and a folder searchable where readable.
// Remote sources (no access known): the mounting user's, 0444 and 0555.
void SetAccess(Filesystem& fs, View::NodeId id, bool is_dir, struct stat* st) {
  std::call_once(fs.tree_access_once,
                 [&fs] { fs.tree_access = MostRestrictive(*fs.view->source().files, fs.uid, fs.gid); });
  std::optional<FileAccess> access = fs.tree_access;
  if (!is_dir)
    if (const std::optional<uint32_t> file = fs.view->PassedSourceFile(id))
      if (std::optional<FileAccess> own = fs.view->source().files->file(*file).access()) access = own;
  st->st_uid = access ? access->uid : fs.uid;
  st->st_gid = access ? access->gid : fs.gid;
  if (!access) {
    st->st_mode = is_dir ? (S_IFDIR | 0555) : (S_IFREG | 0444);
    return;
  }
  uint32_t mode = access->mode & 0555 & ~static_cast<uint32_t>(S_ISUID | S_ISGID | S_ISVTX);
  if (is_dir) mode |= (mode & 0444) >> 2;  // r -> r-x
  st->st_mode = (is_dir ? S_IFDIR : S_IFREG) | mode;
}

struct stat AttrOf(Filesystem& fs, View::NodeId id) {
  const View::Node n = fs.view->node(id);
  struct stat st {};
  st.st_ino = InodeOf(id);
  SetAccess(fs, id, n.is_dir, &st);
  if (n.is_dir) {
    st.st_nlink = 2;
    const size_t children = fs.view->ChildCount(id);
    for (size_t k = 0; k < children; ++k) st.st_nlink += fs.view->IsDir(fs.view->ChildAt(id, k)) ? 1 : 0;
  } else {
    st.st_nlink = 1;
    st.st_size = static_cast<off_t>(n.size);
    st.st_blocks = static_cast<blkcnt_t>((n.size + 511) / 512);
  }
  st.st_blksize = kBlockSize;
  st.st_mtim.tv_sec = n.mtime_ns / 1000000000;
  st.st_mtim.tv_nsec = n.mtime_ns % 1000000000;
  st.st_ctim = st.st_mtim;
  st.st_atim = st.st_mtim;
  return st;
}

// No exception may cross into libfuse's C frames: any escapee becomes EIO.
template <typename Body>
void Guard(fuse_req_t req, Body body) {
  try {
    body();
  } catch (...) {
    fuse_log(FUSE_LOG_ERR, "ckptfs: internal error in a request handler\n");
    fuse_reply_err(req, EIO);
  }
}

// See Filesystem::readahead_knob. A failed write leaves the kernel's window.
void RaiseReadaheadAfterInit(Filesystem& fs) {
  std::call_once(fs.readahead_raised, [&] {
    if (fs.readahead_knob.empty()) return;
    if (FILE* f = std::fopen(fs.readahead_knob.c_str(), "we")) {
      std::fprintf(f, "%u\n", kMaxRequestBytes / 1024);
      std::fclose(f);
    }
  });
}

void OpInit(void* userdata, fuse_conn_info* conn) {
  // libfuse derives max_pages from max_write; 1 MiB requests cut per-request overhead.
  conn->max_write = kMaxRequestBytes;
  // Replies are copied from a per-thread buffer: splicing from the source descriptor is 2x
  // slower on a 2-core VM (tests/bench/README.md, "What bounds each missed goal").
  conn->want &= ~(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
  // libfuse asks for auto_inval_data by default: the kernel then re-fetches attributes on
  // reads once they expire and drops a file's cached pages when mtime or size differ. The
  // tree never changes while mounted, and when a source file does, the source watcher drops
  // the pages itself (source_watcher.hpp) and reads fail: nothing is left for it to catch.
  conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
  // Passthrough excludes the writeback cache, which a read-only tree never asks for.
  conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
  Filesystem& fs = *static_cast<Filesystem*>(userdata);
  if (fs.passthrough) fs.passthrough->OnInit();
}

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    RaiseReadaheadAfterInit(fs);
    if (!Valid(fs, parent)) return (void)fuse_reply_err(req, ENOENT);
    auto child = fs.view->Child(NodeOf(parent), name);
    if (!child) {
      fuse_entry_param e{};  // ino 0: a cacheable negative entry
      e.entry_timeout = kCacheSeconds;
      return (void)fuse_reply_entry(req, &e);
    }
    fuse_entry_param e{};
    e.ino = InodeOf(*child);
    e.attr = AttrOf(fs, *child);
    e.attr_timeout = kCacheSeconds;
    e.entry_timeout = kCacheSeconds;
    fuse_reply_entry(req, &e);
  });
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    RaiseReadaheadAfterInit(fs);
    if (!Valid(fs, ino)) return (void)fuse_reply_err(req, ENOENT);
    struct stat st = AttrOf(fs, NodeOf(ino));
    fuse_reply_attr(req, &st, kCacheSeconds);
  });
}

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    if (!Valid(fs, ino)) return (void)fuse_reply_err(req, ENOENT);
    if (!fs.view->IsDir(NodeOf(ino))) return (void)fuse_reply_err(req, ENOTDIR);
    const bool cached = fs.view->ChildCount(NodeOf(ino)) <= kMaxCachedListing;
    fi->cache_readdir = cached;
    fi->keep_cache = cached;
    fuse_reply_open(req, fi);
  });
}

void OpReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset, fuse_file_info*) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    if (!Valid(fs, ino)) return (void)fuse_reply_err(req, ENOENT);
    const View::NodeId dir = NodeOf(ino);
    if (!fs.view->IsDir(dir)) return (void)fuse_reply_err(req, ENOTDIR);
    const size_t children = fs.view->ChildCount(dir);
    // Entry k: 0 ".", 1 "..", k >= 2 the (sorted) children; the offset passed back is k + 1.
    // One reply buffer per thread: a listing of a million names is ~60 requests of 1 MiB.
    thread_local std::vector<char> buf;
    if (buf.size() < size) buf.resize(size);
    size_t used = 0;
    std::string name;
    for (size_t k = static_cast<size_t>(offset); k < children + 2; ++k) {
      struct stat st {};
      if (k == 0) {
        name = ".";
        st.st_ino = ino;
        st.st_mode = S_IFDIR;
      } else if (k == 1) {
        name = "..";
        st.st_ino = InodeOf(fs.view->ParentOf(dir));
        st.st_mode = S_IFDIR;
      } else {
        const View::NodeId c = fs.view->ChildAt(dir, k - 2);
        fs.view->NameOf(c, &name);
        st.st_ino = InodeOf(c);
        st.st_mode = fs.view->IsDir(c) ? S_IFDIR : S_IFREG;
      }
      size_t need = fuse_add_direntry(req, buf.data() + used, size - used, name.c_str(), &st, static_cast<off_t>(k + 1));
      if (need > size - used) break;
      used += need;
    }
    fuse_reply_buf(req, buf.data(), used);
  });
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    RaiseReadaheadAfterInit(fs);
    if (!Valid(fs, ino)) return (void)fuse_reply_err(req, ENOENT);
    if (fs.view->IsDir(NodeOf(ino))) return (void)fuse_reply_err(req, EISDIR);
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) return (void)fuse_reply_err(req, EROFS);
    // A file that is a source file unchanged may be read by the kernel from that file.
    if (fs.passthrough)
      if (const std::optional<uint32_t> file = fs.view->SameAsSourceFile(NodeOf(ino))) {
        int backing_id = 0, error = 0;
        switch (fs.passthrough->Open(ino, *fs.view->source().files, *file, &backing_id, &error)) {
          case Passthrough::OpenMode::kPassthrough:
            return (void)fs.passthrough->ReplyOpen(req, ino, fi, backing_id);
          case Passthrough::OpenMode::kFailed:
            return (void)fuse_reply_err(req, error);
          case Passthrough::OpenMode::kCopy:
            break;
        }
      }
    // Contents never change under an open file: keep the page cache across opens. No
    // direct_io, so shared and private mmap both work.
    fi->keep_cache = 1;
    if (fuse_reply_open(req, fi) == 0 && fs.push_ahead) fs.push_ahead->OnOpen(ino);
  });
}

void OpRelease(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Filesystem& fs = Fs(req);
  if (fs.push_ahead) fs.push_ahead->OnRelease(ino);
  if (fs.passthrough) fs.passthrough->Release(ino);
  fuse_reply_err(req, 0);
}

void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset, fuse_file_info*) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    if (!Valid(fs, ino) || offset < 0) return (void)fuse_reply_err(req, EINVAL);
    // One reusable buffer per worker thread: libfuse's workers live for the mount.
    // Before the bytes are read: the pusher then skips what this READ already covers.
    if (fs.push_ahead) fs.push_ahead->OnRead(ino, static_cast<uint64_t>(offset), size);
    thread_local std::vector<char> buf;
    if (buf.size() < size) buf.resize(size);
    size_t n = 0;
    Status s = fs.view->Read(NodeOf(ino), static_cast<uint64_t>(offset), size, buf.data(), &n);
    if (!s.ok()) {
      fuse_log(FUSE_LOG_ERR, "ckptfs: read of %s failed: %s\n", fs.view->PathOf(NodeOf(ino)).c_str(),
               s.message().c_str());
      return (void)fuse_reply_err(req, s.ToErrno());
    }
    fuse_reply_buf(req, buf.data(), n);
  });
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    // Summed on the first statfs: it sizes every file, which lays out the model files'
    // headers and manifest.json (a mount that is never asked does not pay for them).
    std::call_once(fs.total_bytes_once, [&] {
      for (View::NodeId id = 0; id < fs.view->node_count(); ++id)
        if (!fs.view->IsDir(id)) fs.total_bytes += fs.view->SizeOf(id);
    });
    const uint64_t bytes = fs.total_bytes;
    struct statvfs sv {};
    sv.f_bsize = kBlockSize;
    sv.f_frsize = kBlockSize;
    sv.f_blocks = (bytes + kBlockSize - 1) / kBlockSize;
    sv.f_files = fs.view->node_count();
    sv.f_namemax = 255;
    fuse_reply_statfs(req, &sv);
  });
}

// XXH3-64 of file `id`, read once (without holding the lock) and then cached.
Status CachedXxh3(Filesystem& fs, View::NodeId id, uint64_t* hash) {
  {
    std::lock_guard<std::mutex> lock(fs.hash_mutex);
    auto it = fs.hashes.find(id);
    if (it != fs.hashes.end()) {
      *hash = it->second;
      return Status::OK();
    }
  }
  CKPTFS_RETURN_IF_ERROR(fs.view->Xxh3(id, hash));
  std::lock_guard<std::mutex> lock(fs.hash_mutex);
  fs.hashes[id] = *hash;
  return Status::OK();
}

// The xattr value of `name` for node `id`: *found is false when it has none.
Status XattrValue(Filesystem& fs, View::NodeId id, std::string_view name, std::string* value, bool* found) {
  if (id == View::kRoot && name == kXattrPassthrough && fs.passthrough) {
    *value = fs.passthrough->StatusJson();
    *found = true;
    return Status::OK();
  }
  const View::Node n = fs.view->node(id);
  *found = n.tensor >= 0;
  if (!*found) return Status::OK();
  if (name == kXattrXxh3) {
    uint64_t hash = 0;
    CKPTFS_RETURN_IF_ERROR(CachedXxh3(fs, id, &hash));
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
    *value = hex;
    return Status::OK();
  }
  nlohmann::json summary = TensorSummary(fs.view->served()[static_cast<size_t>(n.tensor)]);
  if (name == kXattrDType) *value = summary["dtype"].get<std::string>();
  else if (name == kXattrShape) *value = summary["shape"].dump();
  else *found = false;
  return Status::OK();
}

void ReplyXattr(fuse_req_t req, const std::string& value, size_t size) {
  if (size == 0) fuse_reply_xattr(req, value.size());
  else if (size < value.size()) fuse_reply_err(req, ERANGE);
  else fuse_reply_buf(req, value.data(), value.size());
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    std::string value;
    bool found = false;
    if (!Valid(fs, ino)) return (void)fuse_reply_err(req, ENODATA);
    if (Status s = XattrValue(fs, NodeOf(ino), name, &value, &found); !s.ok()) {
      fuse_log(FUSE_LOG_ERR, "ckptfs: %s\n", s.message().c_str());
      return (void)fuse_reply_err(req, s.ToErrno());
    }
    if (!found) return (void)fuse_reply_err(req, ENODATA);
    ReplyXattr(req, value, size);
  });
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  Guard(req, [&] {
    Filesystem& fs = Fs(req);
    if (!Valid(fs, ino)) return (void)fuse_reply_err(req, ENOENT);
    std::string names;
    if (NodeOf(ino) == View::kRoot && fs.passthrough) names.append(kXattrPassthrough).push_back('\0');
    if (fs.view->node(NodeOf(ino)).tensor >= 0) {
      names.append(kXattrDType).push_back('\0');
      names.append(kXattrShape).push_back('\0');
      names.append(kXattrXxh3).push_back('\0');
    }
    ReplyXattr(req, names, size);
  });
}

// Every modifying operation: the tree is read-only.
void OpSetattr(fuse_req_t req, fuse_ino_t, struct stat*, int, fuse_file_info*) { fuse_reply_err(req, EROFS); }
void OpMknod(fuse_req_t req, fuse_ino_t, const char*, mode_t, dev_t) { fuse_reply_err(req, EROFS); }
void OpMkdir(fuse_req_t req, fuse_ino_t, const char*, mode_t) { fuse_reply_err(req, EROFS); }
void OpUnlink(fuse_req_t req, fuse_ino_t, const char*) { fuse_reply_err(req, EROFS); }
void OpSymlink(fuse_req_t req, const char*, fuse_ino_t, const char*) { fuse_reply_err(req, EROFS); }
void OpRename(fuse_req_t req, fuse_ino_t, const char*, fuse_ino_t, const char*, unsigned) { fuse_reply_err(req, EROFS); }
void OpLink(fuse_req_t req, fuse_ino_t, fuse_ino_t, const char*) { fuse_reply_err(req, EROFS); }
void OpCreate(fuse_req_t req, fuse_ino_t, const char*, mode_t, fuse_file_info*) { fuse_reply_err(req, EROFS); }
void OpSetxattr(fuse_req_t req, fuse_ino_t, const char*, const char*, size_t, int) { fuse_reply_err(req, EROFS); }
void OpRemovexattr(fuse_req_t req, fuse_ino_t, const char*) { fuse_reply_err(req, EROFS); }

fuse_lowlevel_ops MakeOperations() {
  fuse_lowlevel_ops ops{};
  ops.init = OpInit;
  ops.lookup = OpLookup;
  ops.getattr = OpGetattr;
  ops.opendir = OpOpendir;
  ops.readdir = OpReaddir;
  ops.open = OpOpen;
  ops.read = OpRead;
  ops.release = OpRelease;
  ops.statfs = OpStatfs;
  ops.getxattr = OpGetxattr;
  ops.listxattr = OpListxattr;
  ops.setattr = OpSetattr;
  ops.mknod = OpMknod;
  ops.mkdir = OpMkdir;
  ops.unlink = OpUnlink;
  ops.rmdir = OpUnlink;
  ops.symlink = OpSymlink;
  ops.rename = OpRename;
  ops.link = OpLink;
  ops.create = OpCreate;
  ops.setxattr = OpSetxattr;
  ops.removexattr = OpRemovexattr;
  return ops;
}

}  // namespace

const fuse_lowlevel_ops& Operations() {
  static const fuse_lowlevel_ops ops = MakeOperations();
  return ops;
}

}  // namespace ckptfs::fuse
