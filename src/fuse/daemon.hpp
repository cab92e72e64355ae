// `ckptfs SOURCE MOUNTPOINT [-o opt,...] [-f] [-d] [-s]`: mount a checkpoint.
#ifndef CKPTFS_FUSE_DAEMON_HPP_
#define CKPTFS_FUSE_DAEMON_HPP_

namespace ckptfs::fuse {

// Runs the mount; `args` excludes the program name. `as_mount_helper` is set when the
// binary was started as mount.ckptfs by mount(8), whose arguments need filtering.
// Returns the process exit status.
int RunMount(int argc, char** argv, bool as_mount_helper);

}  // namespace ckptfs::fuse

#endif  // CKPTFS_FUSE_DAEMON_HPP_
