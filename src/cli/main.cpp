// ckptfs: the command line front end. The FUSE-free subcommands live here; the mount
// (`ckptfs SOURCE MOUNTPOINT`) is provided by the FUSE daemon.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.hpp"

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
    "usage: ckptfs COMMAND [OPTIONS] ...\n"
    "\n"
    "Presents a machine-learning checkpoint (torch .pt/.bin, safetensors file or folder)\n"
    "as safetensors files, reading tensor bytes lazily from the source.\n"
    "\n"
    "commands:\n"
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
  std::fprintf(stderr, "ckptfs: unknown command '%s'\n%s", command.c_str(), kUsage);
  return 2;
}
