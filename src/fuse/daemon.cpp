// Mount start-up, in the order libfuse 3.14 expects: parse options, open and index the
// source while stderr still reaches the user, create the session, mount, daemonize,
// run the loop, unmount. A source that cannot be read is refused before anything is
// mounted.
#include "fuse/daemon.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <syslog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ckptfs/open.hpp"
#include "ckptfs/options.hpp"
#include "fuse/filesystem.hpp"
#include "fuse/passthrough.hpp"
#include "fuse/push_ahead.hpp"
#include "fuse/source_watcher.hpp"

namespace ckptfs::fuse {
namespace {

constexpr char kUsageHead[] =
    "usage: ckptfs SOURCE MOUNTPOINT [-o OPTION,...] [-f] [-d] [-s]\n"
    "       ckptfs mount SOURCE MOUNTPOINT [...]\n"
    "\n"
    "Mounts the checkpoint SOURCE (a file or folder of a format below, on disk, at an\n"
    "http(s):// URL or at s3://BUCKET/KEY) read-only at MOUNTPOINT: model.safetensors,\n"
    "tensors/<key>.safetensors, manifest.json, metadata.json and the folder's other files.\n"
    "Returns once the mount is ready; unmount with 'fusermount3 -u MOUNTPOINT'.\n"
    "\n"
    "formats:\n";
constexpr char kUsageFlags[] =
    "\n"
    "  -f                stay in the foreground\n"
    "  -d                debug output (implies -f)\n"
    "  -s                single-threaded\n";
constexpr char kUsageTail[] = "  -o allow_other, -o auto_unmount, -o max_threads=N, ...  see below\n\n";

// Options mount(8) and fstab hand to helpers that mean nothing to a FUSE daemon.
bool IsMountOnlyOption(const std::string& opt) {
  static const char* const kIgnored[] = {"auto", "noauto", "user", "nouser", "users", "_netdev",
                                         "nofail", "defaults", "rw", "ro"};
  for (const char* k : kIgnored)
    if (opt == k) return true;
  return opt.rfind("x-", 0) == 0 || opt.rfind("comment=", 0) == 0;
}

// fuse_opt treats ',' and '\' specially inside -o values.
std::string EscapeOptionValue(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == ',' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

void SyslogLog(enum fuse_log_level level, const char* fmt, va_list ap) { vsyslog(level, fmt, ap); }

// fuse_daemonize points fds 0-2 at /dev/null; make sure none of our own descriptors
// can land there first and be clobbered.
void OccupyStandardFds() {
  for (;;) {
    int fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (fd < 0) return;
    if (fd > 2) {
      ::close(fd);
      return;
    }
  }
}

// "major:minor" of the file system mounted at `mountpoint` (absolute), from the last
// /proc/self/mountinfo line that names it (the topmost mount there); empty if none does.
std::string MountedDevice(const std::string& mountpoint) {
  std::string device;
  FILE* f = std::fopen("/proc/self/mountinfo", "re");
  if (!f) return device;
  char* line = nullptr;
  size_t cap = 0;
  while (::getline(&line, &cap, f) > 0) {
    // Fields: mount id, parent id, major:minor, root, mount point, ... ; mount points escape
    // space, tab, newline and backslash as \ooo.
    char dev[64], root[8], point[4096];
    if (std::sscanf(line, "%*d %*d %63s %7s %4095s", dev, root, point) != 3) continue;
    std::string unescaped;
    for (const char* c = point; *c; ++c) {
      if (c[0] == '\\' && c[1] >= '0' && c[1] <= '3' && c[2] >= '0' && c[2] <= '7' && c[3] >= '0' && c[3] <= '7') {
        unescaped += static_cast<char>((c[1] - '0') * 64 + (c[2] - '0') * 8 + (c[3] - '0'));
        c += 3;
      } else {
        unescaped += *c;
      }
    }
    if (unescaped == mountpoint) device = dev;
  }
  std::free(line);
  std::fclose(f);
  return device;
}

// The sysfs file of the mount's readahead window (see Filesystem::readahead_knob), found
// through mountinfo, not stat() of the mountpoint, which would wait for this daemon's own
// answer (and, done from a thread, hold the mount busy whenever an unmount came first).
// Empty when the mount is not found.
std::string ReadaheadKnob(const std::string& mountpoint) {
  char resolved[PATH_MAX];
  const std::string device = MountedDevice(::realpath(mountpoint.c_str(), resolved) ? resolved : mountpoint);
  return device.empty() ? std::string() : "/sys/class/bdi/" + device + "/read_ahead_kb";
}

// Bytes pushed ahead of each reader of a served file (push_ahead.hpp): 256 MiB unless
// CKPTFS_PUSH_AHEAD_MIB says otherwise (0: off). On a quiet 2-vCPU machine
// (tests/bench/README.md, "Mapped loaders"), mapped loaders gain 11-13 % (`from_pretrained` +
// touch 0.65 s instead of 0.75 s, `load_file` 0.58 instead of 0.65 s) and `dd` of the mount
// stays within noise (1.04x its time; 1.06x its rate in bench_read_throughput). On a loaded
// machine `dd`/`cp` can lose up to 20 %: the pushes cost the daemon about 0.26 CPU-seconds
// per 2.2 GB, and a reader that catches up with them waits for a READ the kernel's readahead
// would have sent ahead. Loaders are what the mount is mostly read by, hence on by default.
// Only where the source's Env asks for it (EnvTraits::push_ahead): a remote Env has its own
// readahead, and a push would fetch bytes nobody may read.
uint64_t PushAheadWindow(const Env& env) {
  if (!env.traits().push_ahead) return 0;
  constexpr uint64_t kDefaultMib = 256;
  const char* mib = std::getenv("CKPTFS_PUSH_AHEAD_MIB");
  const uint64_t window_mib = (mib && *mib) ? std::strtoull(mib, nullptr, 10) : kDefaultMib;
  // Bounded: a window beyond the cache's reach only costs the daemon's CPU.
  return std::min<uint64_t>(window_mib, 4096) << 20;
}

struct ParsedCommandLine {
  std::string source;
  std::string mountpoint;
  std::vector<std::string> flags;    // passed to libfuse as they are
  std::vector<std::string> options;  // -o values for libfuse, one per entry
  OptionValues values;               // ckptfs's own -o values (the option table)
  bool help = false;
  bool bad_value = false;  // an option with an invalid value: bad input (exit 1), not usage
};

bool Parse(int argc, char** argv, bool as_mount_helper, ParsedCommandLine* cl) {
  std::vector<std::string> positional;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-o" || (a.rfind("-o", 0) == 0 && a.size() > 2)) {
      std::string list = a.size() > 2 ? a.substr(2) : (i + 1 < argc ? argv[++i] : "");
      size_t start = 0;
      while (start <= list.size()) {
        size_t comma = list.find(',', start);
        std::string opt = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        bool known = false;
        if (Status s = ParseMountOption(opt, kMountGroups, &cl->values, &known); !s.ok()) {
          std::fprintf(stderr, "ckptfs: %s\n", s.message().c_str());
          cl->bad_value = true;
          return false;
        }
        if (!known && !opt.empty() && !IsMountOnlyOption(opt)) cl->options.push_back(opt);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (a == "-h" || a == "--help") {
      cl->help = true;
    } else if (!a.empty() && a[0] == '-') {
      // mount(8) passes -s (sloppy), -f (fake), -n, -v to helpers: not libfuse's -s/-f.
      if (!as_mount_helper) cl->flags.push_back(a);
    } else {
      positional.push_back(a);
    }
  }
  if (cl->help) return true;
  if (positional.size() != 2) {
    std::fprintf(stderr, "ckptfs: expected SOURCE and MOUNTPOINT (see --help)\n");
    return false;
  }
  cl->source = positional[0];
  cl->mountpoint = positional[1];
  return true;
}

// A FUSE argument vector that owns its strings.
struct FuseArgs {
  std::vector<std::string> storage;
  std::vector<char*> argv;
  fuse_args args = FUSE_ARGS_INIT(0, nullptr);

  explicit FuseArgs(std::vector<std::string> a) : storage(std::move(a)) {
    for (auto& s : storage) argv.push_back(s.data());
    argv.push_back(nullptr);
    args.argc = static_cast<int>(storage.size());
    args.argv = argv.data();
    args.allocated = 0;
  }
  ~FuseArgs() { fuse_opt_free_args(&args); }
};

}  // namespace

// The View the mount serves of `source`, into fs->view; its notes go to `note` (stderr before
// the daemon is detached, the log after).
static Status OpenForMount(const std::string& source, const OpenRequest& request, Filesystem* fs,
                           void (*note)(const std::string&)) {
  OpenedSource opened;
  Status s = OpenSource(source, request, &opened);
  for (const std::string& line : opened.notes) note(line);
  if (s.ok()) fs->view = std::move(opened.view);
  return s;
}

static void NoteOnStderr(const std::string& line) { std::fprintf(stderr, "ckptfs: %s\n", line.c_str()); }
static void NoteInLog(const std::string& line) { fuse_log(FUSE_LOG_WARNING, "ckptfs: %s\n", line.c_str()); }

static void PrintMountHelp() {
  std::fputs(kUsageHead, stdout);
  std::fputs(FormatsHelp().c_str(), stdout);
  std::fputs(kUsageFlags, stdout);
  std::fputs(MountHelp(kMountGroups).c_str(), stdout);
  std::fputs(kUsageTail, stdout);
  fuse_cmdline_help();
  fuse_lowlevel_help();
}

// libfuse's arguments: the mountpoint, the flags given, and the mount options (read-only, the
// file system's name, then those given).
static std::vector<std::string> FuseArgvOf(const ParsedCommandLine& cl, const std::string& source) {
  std::vector<std::string> fuse_argv = {"ckptfs", cl.mountpoint};
  for (auto& f : cl.flags) fuse_argv.push_back(f);
  std::string opts = "ro,default_permissions,subtype=ckptfs,fsname=" + EscapeOptionValue(source);
  for (auto& o : cl.options) opts += "," + o;
  fuse_argv.push_back("-o");
  fuse_argv.push_back(opts);
  return fuse_argv;
}

// The kernel accepts a regular file as a FUSE mountpoint, which leaves an unusable mount;
// libfuse's /dev/fd/N form is checked by libfuse itself. Prints why not.
static bool MountpointUsable(const char* mountpoint) {
  if (std::strncmp(mountpoint, "/dev/fd/", 8) == 0) return true;
  struct stat mst;
  if (::stat(mountpoint, &mst) != 0) {
    std::fprintf(stderr, "ckptfs: %s: %s\n", mountpoint, std::strerror(errno));
    return false;
  }
  if (!S_ISDIR(mst.st_mode)) {
    std::fprintf(stderr, "ckptfs: %s: mountpoint is not a directory\n", mountpoint);
    return false;
  }
  return true;
}

// The request loop, with what runs beside it: pushing data ahead into the page cache and
// watching the source files, both stopped when the loop ends. Returns the loop's status.
static int ServeRequests(fuse_session* se, const fuse_cmdline_opts& fopts, Env& env, Filesystem* fs) {
  PushAhead push_ahead(PushAheadWindow(env), kMaxRequestBytes, 4 * kMaxRequestBytes,
                       std::getenv("CKPTFS_TEST_PUSH_REFUSED") != nullptr);
  if (push_ahead.window() > 0) {
    push_ahead.Start(se, fs);
    fs->push_ahead = &push_ahead;
  }
  SourceWatcher watcher;
  if (!watcher.Start(se, fs))
    fuse_log(FUSE_LOG_WARNING, "ckptfs: cannot watch the source files; changes are caught on read only\n");
  int status;
  if (fopts.singlethread) {
    status = fuse_session_loop(se);
  } else {
    fuse_loop_config* config = fuse_loop_cfg_create();
    fuse_loop_cfg_set_clone_fd(config, static_cast<unsigned>(fopts.clone_fd));
    fuse_loop_cfg_set_max_threads(config, fopts.max_threads);
    status = fuse_session_loop_mt(se, config);
    fuse_loop_cfg_destroy(config);
  }
  watcher.Stop();
  fs->push_ahead = nullptr;
  push_ahead.Stop();
  if (push_ahead.window() > 0) {
    const PushAhead::Counters c = push_ahead.counters();
    fuse_log(FUSE_LOG_INFO, "ckptfs: pushed %llu bytes in %llu stores%s\n", (unsigned long long)c.pushed_bytes,
             (unsigned long long)c.stores, c.refused ? " (the kernel refused one; pushing stopped)" : "");
  }
  return status;
}

// A status for "the loop did not run": the loop reports 0, a negative errno, or the number of
// the signal that ended it (SIGHUP is 1).
constexpr int kNotServed = -1;

// Mounts, detaches from the terminal (unless in the foreground), opens the source where that
// was left to the daemon, serves until unmounted, and unmounts. Returns the loop's status
// (kNotServed when it did not run).
static int MountAndServe(fuse_session* se, const fuse_cmdline_opts& fopts, const char* mountpoint,
                         const std::string& source, const OpenRequest& request, bool open_in_daemon,
                         bool passthrough_enabled, Filesystem* fs) {
  if (fuse_session_mount(se, mountpoint) != 0) return kNotServed;
  int status = kNotServed;
  fs->readahead_knob = ReadaheadKnob(mountpoint);
  if (!fopts.foreground) fuse_set_log_func(SyslogLog);
  // In the background case the parent exits only after the child is set up, and the mount
  // already exists: the command returns with the mount ready (when the catalog is opened in
  // the daemon, requests wait in the kernel until it is).
  Status opened;
  const bool daemonized = fuse_daemonize(fopts.foreground) == 0;
  if (daemonized && open_in_daemon) {
    opened = OpenForMount(source, request, fs, NoteInLog);
    // Not expected after the checks before the mount (the entry could be replaced in between,
    // and is then read like any source): the mount must not stay with nothing behind it.
    if (!opened.ok())
      fuse_log(FUSE_LOG_ERR, "ckptfs: %s; unmounting\n", StatusText(opened, OptionSpelling::kMount).c_str());
  }
  if (daemonized && opened.ok()) {
    Passthrough passthrough(passthrough_enabled);
    // Tests only: run the daemon as one started without CAP_SYS_ADMIN ("1"), or so and still
    // ask the kernel for passthrough ("ask"), whose refusal then comes at the first open.
    if (const char* drop = std::getenv("CKPTFS_TEST_DROP_SYS_ADMIN"); drop && *drop) {
      if (!Passthrough::DropSysAdmin()) fuse_log(FUSE_LOG_ERR, "ckptfs: could not drop CAP_SYS_ADMIN\n");
      if (std::strcmp(drop, "ask") == 0) passthrough.AskWithoutPrivilege();
    }
    passthrough.Prepare(*fs->view);
    passthrough.Install(se);
    fs->passthrough = &passthrough;  // also where it serves nothing: the xattr says why
    status = ServeRequests(se, fopts, *request.source.env, fs);
    fs->passthrough = nullptr;
  }
  fuse_session_unmount(se);
  if (FetchCounters c; request.source.env->fetch_counters(&c)) {
    fuse_log(FUSE_LOG_INFO, "ckptfs: unmounted %s: fetched %llu bytes in %llu requests (%llu retries)\n",
             source.c_str(), static_cast<unsigned long long>(c.bytes), static_cast<unsigned long long>(c.requests),
             static_cast<unsigned long long>(c.retries));
  }
  return status;
}

int RunMount(int argc, char** argv, bool as_mount_helper) {
  ParsedCommandLine cl;
  if (!Parse(argc, argv, as_mount_helper, &cl)) return cl.bad_value ? 1 : 2;
  if (cl.help) {
    PrintMountHelp();
    return 0;
  }

  // The Env is chosen once, here, for the name the mount shows (its canonical name: a local
  // path resolved) and for what the daemon does with it; a SOURCE it refuses is reported
  // where the open would have reported it, after the mountpoint's checks.
  OpenRequest request{cl.values.source, cl.values.view, OpenStage::kView, /*trim_heap=*/true};
  const Status env_status = ChooseEnv(cl.source, cl.values.source, &request.source.env);
  const std::string source = request.source.env ? request.source.env->CanonicalName(cl.source) : cl.source;
  FuseArgs args(FuseArgvOf(cl, source));

  fuse_cmdline_opts fopts{};
  if (fuse_parse_cmdline(&args.args, &fopts) != 0) return 2;
  std::unique_ptr<char, decltype(&std::free)> mountpoint(fopts.mountpoint, &std::free);
  if (fopts.show_version) {
    std::printf("ckptfs %s\n", CKPTFS_VERSION);
    fuse_lowlevel_version();
    return 0;
  }
  if (!MountpointUsable(mountpoint.get())) return 1;

  OccupyStandardFds();
  Filesystem fs;
  fs.uid = ::getuid();
  fs.gid = ::getgid();
  if (!env_status.ok()) {
    std::fprintf(stderr, "ckptfs: %s\n", StatusText(env_status, OptionSpelling::kMount).c_str());
    return 1;
  }
  // With a usable catalog cache entry the catalog and View are made in the daemon, after
  // the mount: the command returns once the entry is checked (~0.1 s for a million tensors
  // instead of ~0.5 s), and the first request waits for the rest. Only where nothing left
  // can fail for a reason the user must see: the entry is intact, its files unchanged, its
  // keys distinct (no two files of one name), and no root= prefix (which may match nothing)
  // or checksums (which read every tensor) are asked for.
  const ViewOptions& view_options = request.view;
  const bool open_in_daemon =
      view_options.root.empty() && !view_options.checksums && CatalogCacheHit(source, request.source);
  if (!open_in_daemon) {
    if (Status s = OpenForMount(source, request, &fs, NoteOnStderr); !s.ok()) {
      std::fprintf(stderr, "ckptfs: %s\n", StatusText(s, OptionSpelling::kMount).c_str());
      return 1;
    }
  }

  fuse_session* se = fuse_session_new(&args.args, &Operations(), sizeof(fuse_lowlevel_ops), &fs);
  if (!se) return 1;
  int status = kNotServed;
  if (fuse_set_signal_handlers(se) == 0) {
    status = MountAndServe(se, fopts, mountpoint.get(), source, request, open_in_daemon, cl.values.passthrough, &fs);
    fuse_remove_signal_handlers(se);
  }
  fuse_session_destroy(se);
  // libfuse reports the signal that ended the loop; stopping on one is a clean exit.
  return (status == 0 || status == SIGTERM || status == SIGINT || status == SIGHUP) ? 0 : 1;
}

}  // namespace ckptfs::fuse
