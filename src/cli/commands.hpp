// The ckptfs subcommands. Each takes its arguments (after the subcommand name) and
// returns the process exit status: 0 success, 1 failure, 2 usage error.
#ifndef CKPTFS_CLI_COMMANDS_HPP_
#define CKPTFS_CLI_COMMANDS_HPP_

#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/open.hpp"
#include "ckptfs/options.hpp"
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
int RunDiff(const Args& args);  // src/cli/diff.cpp: compare two checkpoints

// Shared helpers.
int Fail(const Status& status);  // prints "ckptfs: MESSAGE" (options in the command line's spelling), returns 1
int UsageError(const std::string& what, const char* usage);  // returns 2

// A command's options: those of the option table it takes (include/ckptfs/options.hpp:
// every reading command the source and view groups, `load` its own too), and --json.
struct ReadOptions : OptionValues {
  bool json = false;
};

// How a command starts: what it takes besides the table options of `groups`.
struct CommandLine {
  const char* usage;
  bool allow_json;         // --json
  unsigned groups;         // OptionGroup bits: kReadCommandGroups, kLoadCommandGroups
  size_t positional;       // how many positional arguments
  const char* wrong_count; // the usage error otherwise: "cat takes SOURCE and PATH"
};

// --help (the usage and the help lines of the command's options), else the options and
// positional arguments of `args`. Returns -1 to go on, or the exit status to return (after
// printing the help or a usage error).
int StartCommand(const Args& args, const CommandLine& command, ReadOptions* options,
                 std::vector<std::string>* positional);

// The tensors `source` serves with the view options, for commands that list rather than read
// (OpenSource up to OpenStage::kServedTensors).
Status OpenPresented(const std::string& source, const ReadOptions& options, ServedTensors* out);
// The view of `source` with `options` (OpenSource).
Status OpenView(const std::string& source, const ReadOptions& options, std::unique_ptr<View>* out);

}  // namespace ckptfs::cli

#endif  // CKPTFS_CLI_COMMANDS_HPP_
