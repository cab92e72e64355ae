// ckptfs: the command line front end. `ckptfs SOURCE MOUNTPOINT` (or `ckptfs mount ...`)
// mounts through the FUSE daemon; the other subcommands work without FUSE.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.hpp"
#include "fuse/daemon.hpp"

namespace ckptfs::cli {

int Fail(const Status& status) {
  std::fprintf(stderr, "ckptfs: %s\n", status.message().c_str());
  return 1;
}

int UsageError(const std::string& what, const char* usage) {
  std::fprintf(stderr, "ckptfs: %s\n%s", what.c_str(), usage);
  return 2;
}

bool WantsHelp(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

bool SplitArgs(const Args& args, const std::vector<std::string>& known, const char* usage,
               std::vector<std::string>* flags, std::vector<std::string>* positional) {
  bool only_positional = false;
  for (const auto& a : args) {
    if (!only_positional && a == "--") {
      only_positional = true;
    } else if (!only_positional && a.size() > 1 && a[0] == '-') {
      bool ok = false;
      for (const auto& k : known) ok |= a == k;
      if (!ok) {
        UsageError("unknown option '" + a + "'", usage);
        return false;
      }
      flags->push_back(a);
    } else {
      positional->push_back(a);
    }
  }
  return true;
}

}  // namespace ckptfs::cli

namespace {

constexpr char kUsage[] =
    "usage: ckptfs SOURCE MOUNTPOINT [-o OPTION,...] [-f] [-d] [-s]\n"
    "       ckptfs COMMAND [OPTIONS] ...\n"
    "\n"
    "Presents a machine-learning checkpoint (torch .pt/.bin, safetensors file or folder)\n"
    "as safetensors files, reading tensor bytes lazily from the source.\n"
    "\n"
    "commands:\n"
    "  mount SOURCE MOUNTPOINT\n"
    "                   mount SOURCE read-only (the default command); see 'ckptfs mount --help'\n"
    "  ls SOURCE        list tensors: key, dtype, shape, bytes (--json for JSON)\n"
    "  info SOURCE      format, source files, tensor count, total bytes, metadata\n"
    "  cat SOURCE PATH  write one virtual file (e.g. model.safetensors) to stdout\n"
    "  export SOURCE OUTDIR\n"
    "                   write the whole virtual tree as real files\n"
    "\n"
    "Run 'ckptfs COMMAND --help' for the options of a command.\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace ckptfs::cli;
  // mount(8) runs "mount.ckptfs SOURCE DIR -o ..." for the bare fstab type "ckptfs".
  const std::string self = argv[0];
  if (self.substr(self.rfind('/') + 1) == "mount.ckptfs") return ckptfs::fuse::RunMount(argc - 1, argv + 1, true);
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string command = argv[1];
  Args args(argv + 2, argv + argc);
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (command == "ls") return RunLs(args);
  if (command == "info") return RunInfo(args);
  if (command == "cat") return RunCat(args);
  if (command == "export") return RunExport(args);
  if (command == "mount") return ckptfs::fuse::RunMount(argc - 2, argv + 2, false);
  return ckptfs::fuse::RunMount(argc - 1, argv + 1, false);
}
