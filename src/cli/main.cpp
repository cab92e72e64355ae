// ckptfs: the command line front end. `ckptfs SOURCE MOUNTPOINT` (or `ckptfs mount ...`)
// mounts through the FUSE daemon; the other subcommands work without FUSE.
#include <cstdio>
#include <algorithm>
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

bool WantsHelp(const Args& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

const char kReadOptionsHelp[] =
    "  --dtype T         serve floating tensors as T (bf16, fp16, fp32)\n"
    "  --root PREFIX     only the tensors under PREFIX (e.g. model), prefix removed\n"
    "  --shard-size S    Hugging Face shards of at most S (5GB, 2GiB) instead of model.safetensors\n"
    "  --checksums       manifest.json lists each tensor file's XXH3-64\n"
    "  --moments         DeepSpeed ZeRO: also the Adam moments (exp_avg.*, exp_avg_sq.*)\n"
    "  --max-pickle S, --max-pickle-memory S, --max-header S, --max-tensors N\n"
    "                    raise the limits on untrusted metadata (defaults 1GiB, 4GiB, 100MB,\n"
    "                    10000000; see README, Limits)\n";

int ParseReadArgs(const Args& args, const char* usage, bool allow_json, ReadOptions* options,
                  std::vector<std::string>* positional) {
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
    if (a == "--json" && allow_json) {
      options->json = true;
      continue;
    }
    // --dtype T, --dtype=T and the like map onto the mount's -o dtype=T.
    std::string key = a.substr(2), value;
    if (size_t eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key.resize(eq);
    } else if (key != "checksums" && key != "moments") {
      if (i + 1 >= args.size()) return UsageError("option '" + a + "' needs a value", usage);
      value = args[++i];
    }
    std::replace(key.begin(), key.end(), '-', '_');
    bool known = false;
    Status s = ParseViewOption(key, value, &options->view, &known);
    if (!known) s = ParseSourceOption(key, value, &options->source, &known);
    if (!known) return UsageError("unknown option '" + a + "'", usage);
    if (!s.ok()) return UsageError(s.message(), usage);
  }
  return -1;
}

Status OpenPresented(const std::string& source, const ReadOptions& options, std::shared_ptr<const Catalog>* out) {
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
    "  hash SOURCE      XXH3-64 of every tensor file, as xxhsum -H3 prints them\n"
    "  load SOURCE      stream every tensor into GPU memory (pinned buffers or cuFile)\n"
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
  if (command == "hash") return RunHash(args);
  if (command == "load") return RunLoad(args);
  if (command == "mount") return ckptfs::fuse::RunMount(argc - 2, argv + 2, false);
  return ckptfs::fuse::RunMount(argc - 1, argv + 1, false);
}
