// ckptfs: the command line front end. `ckptfs SOURCE MOUNTPOINT` (or `ckptfs mount ...`)
// mounts through the FUSE daemon; the other subcommands work without FUSE.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.hpp"
#include "fuse/daemon.hpp"

namespace ckptfs::cli {

int Fail(const Status& status) {
  std::fprintf(stderr, "ckptfs: %s\n", StatusText(status, OptionSpelling::kCommandLine).c_str());
  return 1;
}

int UsageError(const std::string& what, const char* usage) {
  // One line, like every other error; the usage is one --help away.
  (void)usage;
  std::fprintf(stderr, "ckptfs: %s (see --help)\n", what.c_str());
  return 2;
}

namespace {

bool WantsHelp(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

}  // namespace

int StartCommand(const Args& args, const CommandLine& command, ReadOptions* options,
                 std::vector<std::string>* positional) {
  if (WantsHelp(args)) {
    std::fputs(command.usage, stdout);
    std::fputs(CommandLineHelp(command.groups).c_str(), stdout);
    return 0;
  }
  bool only_positional = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (only_positional || a.size() < 2 || a[0] != '-') {
      positional->push_back(a);
      continue;
    }
    if (a == "--") {
      only_positional = true;
      continue;
    }
    if (a == "--json" && command.allow_json) {
      options->json = true;
      continue;
    }
    bool known = false;
    Status s = ParseCommandLineOption(args, &i, command.groups, options, &known);
    if (!known) return UsageError("unknown option '" + a + "'", command.usage);
    if (!s.ok()) return UsageError(s.message(), command.usage);
  }
  if (positional->size() != command.positional) return UsageError(command.wrong_count, command.usage);
  return -1;
}

namespace {

// The one call of the open layer: its notes go to stderr as they would at a mount's start.
Status OpenForCommand(const std::string& source, const ReadOptions& options, OpenStage stage, OpenedSource* out) {
  Status s = OpenSource(source, OpenRequest{options.source, options.view, stage}, out);
  for (const std::string& note : out->notes) std::fprintf(stderr, "ckptfs: %s\n", note.c_str());
  return s;
}

}  // namespace

Status OpenPresented(const std::string& source, const ReadOptions& options, ServedTensors* out) {
  OpenedSource opened;
  CKPTFS_RETURN_IF_ERROR(OpenForCommand(source, options, OpenStage::kServedTensors, &opened));
  *out = std::move(opened.served);
  return Status::OK();
}

Status OpenView(const std::string& source, const ReadOptions& options, std::unique_ptr<View>* out) {
  OpenedSource opened;
  CKPTFS_RETURN_IF_ERROR(OpenForCommand(source, options, OpenStage::kView, &opened));
  *out = std::move(opened.view);
  return Status::OK();
}

}  // namespace ckptfs::cli

namespace {

constexpr char kUsageHead[] =
    "usage: ckptfs SOURCE MOUNTPOINT [-o OPTION,...] [-f] [-d] [-s]\n"
    "       ckptfs COMMAND [OPTIONS] ...\n"
    "\n"
    "Presents a machine-learning checkpoint (a file or folder of a format below) as\n"
    "safetensors files, reading tensor bytes lazily from the source. SOURCE is a local path,\n"
    "an http(s):// URL or s3://BUCKET/KEY.\n"
    "\n"
    "formats:\n";
constexpr char kUsageCommands[] =
    "\n"
    "commands:\n"
    "  mount SOURCE MOUNTPOINT\n"
    "                   mount SOURCE read-only (the default command); see 'ckptfs mount --help'\n"
    "  ls SOURCE        list tensors: key, dtype, shape, bytes (--json for JSON)\n"
    "  info SOURCE      format, source files, tensor count, total bytes, metadata\n"
    "  cat SOURCE PATH  write one virtual file (e.g. model.safetensors) to stdout\n"
    "  export SOURCE OUTDIR\n"
    "                   write model.safetensors (or the shards) and the small files as real\n"
    "                   files; --write model,tensors,files,all picks what\n"
    "  hash SOURCE      XXH3-64 of every tensor file, as xxhsum -H3 prints them\n"
    "  load SOURCE      stream every tensor into GPU memory (pinned buffers or cuFile)\n"
    "  diff A B         compare two checkpoints tensor by tensor (exit 0 equal, 1 different)\n"
    "\n"
    "Run 'ckptfs COMMAND --help' for the options of a command; 'ckptfs --version' prints\n"
    "the version.\n";

std::string Usage() { return kUsageHead + ckptfs::FormatsHelp() + kUsageCommands; }

}  // namespace

int main(int argc, char** argv) {
  using namespace ckptfs::cli;
  // mount(8) runs "mount.ckptfs SOURCE DIR -o ..." for the bare fstab type "ckptfs".
  const std::string self = argv[0];
  if (self.substr(self.rfind('/') + 1) == "mount.ckptfs") return ckptfs::fuse::RunMount(argc - 1, argv + 1, true);
  if (argc < 2) {
    std::fputs(Usage().c_str(), stderr);
    return 2;
  }
  const std::string command = argv[1];
  Args args(argv + 2, argv + argc);
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(Usage().c_str(), stdout);
    return 0;
  }
  if (command == "--version" || command == "-V") {
    std::printf("ckptfs %s\n", CKPTFS_VERSION);
    return 0;
  }
  if (command == "ls") return RunLs(args);
  if (command == "info") return RunInfo(args);
  if (command == "cat") return RunCat(args);
  if (command == "export") return RunExport(args);
  if (command == "hash") return RunHash(args);
  if (command == "load") return RunLoad(args);
  if (command == "diff") return RunDiff(args);
  if (command == "mount") return ckptfs::fuse::RunMount(argc - 2, argv + 2, false);
  return ckptfs::fuse::RunMount(argc - 1, argv + 1, false);
}
