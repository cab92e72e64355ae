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

Status OpenPresented(const std::string& source, const ReadOptions& options, ServedTensors* out) {
  std::shared_ptr<const Catalog> catalog;
  CKPTFS_RETURN_IF_ERROR(OpenCatalog(source, options.source, &catalog));
  return ApplyViewOptions(std::move(catalog), options.view, out);
}

Status OpenView(const std::string& source, const ReadOptions& options, std::unique_ptr<View>* out) {
  std::shared_ptr<const Catalog> catalog;
  CKPTFS_RETURN_IF_ERROR(OpenCatalog(source, options.source, &catalog));
  return View::Build(std::move(catalog), options.view, out);
}

}  // namespace ckptfs::cli

namespace {

constexpr char kUsage[] =
    "usage: ckptfs SOURCE MOUNTPOINT [-o OPTION,...] [-f] [-d] [-s]\n"
    "       ckptfs COMMAND [OPTIONS] ...\n"
    "\n"
    "Presents a machine-learning checkpoint (torch .pt/.bin, legacy torch.save stream,\n"
    "TorchScript archive, torch.export package, safetensors file or folder, DeepSpeed ZeRO\n"
    "folder, torch.distributed.checkpoint folder) as safetensors files, reading tensor bytes\n"
    "lazily from the source. SOURCE is a local path, an http(s):// URL or s3://BUCKET/KEY.\n"
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
