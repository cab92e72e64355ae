// The ckptfs subcommands. Each takes its arguments (after the subcommand name) and
// returns the process exit status: 0 success, 1 failure, 2 usage error.
#ifndef CKPTFS_CLI_COMMANDS_HPP_
#define CKPTFS_CLI_COMMANDS_HPP_

#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/status.hpp"
#include "ckptfs/view.hpp"

namespace ckptfs::cli {

using Args = std::vector<std::string>;

int RunLs(const Args& args);
int RunInfo(const Args& args);
int RunCat(const Args& args);
int RunExport(const Args& args);
int RunHash(const Args& args);
int RunLoad(const Args& args);  // src/cli/load.cpp: stream tensors to a GPU

// Shared helpers.
int Fail(const Status& status);                  // prints "ckptfs: MESSAGE", returns 1
int UsageError(const std::string& what, const char* usage);  // returns 2
bool WantsHelp(const Args& args);

// The options every reading command takes: --moments, and the view options --dtype T,
// --root PREFIX, --shard-size SIZE, --checksums (as the mount's -o options); --json where
// `allow_json`.
struct ReadOptions {
  SourceOptions source;
  ViewOptions view;
  bool json = false;
};
extern const char kReadOptionsHelp[];

// Parses `args` into options and positional arguments. Returns -1 to go on, or the exit
// status to return (after printing a usage error).
int ParseReadArgs(const Args& args, const char* usage, bool allow_json, ReadOptions* options,
                  std::vector<std::string>* positional);

// OpenCatalog + ApplyViewOptions, for commands that list rather than read.
Status OpenPresented(const std::string& source, const ReadOptions& options, std::shared_ptr<const Catalog>* out);
// The view of `source` with `options`.
Status OpenView(const std::string& source, const ReadOptions& options, std::unique_ptr<View>* out);

}  // namespace ckptfs::cli

#endif  // CKPTFS_CLI_COMMANDS_HPP_
