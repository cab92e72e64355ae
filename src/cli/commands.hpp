// The ckptfs subcommands. Each takes its arguments (after the subcommand name) and
// returns the process exit status: 0 success, 1 failure, 2 usage error.
#ifndef CKPTFS_CLI_COMMANDS_HPP_
#define CKPTFS_CLI_COMMANDS_HPP_

#include <string>
#include <vector>

#include "ckptfs/status.hpp"

namespace ckptfs::cli {

using Args = std::vector<std::string>;

int RunLs(const Args& args);
int RunInfo(const Args& args);
int RunCat(const Args& args);
int RunExport(const Args& args);

// Shared helpers.
int Fail(const Status& status);                  // prints "ckptfs: MESSAGE", returns 1
int UsageError(const std::string& what, const char* usage);  // returns 2
bool WantsHelp(const Args& args);

// Splits `args` into flags (starting with "--") and positional arguments; returns false
// and prints a usage error for a flag not in `known`.
bool SplitArgs(const Args& args, const std::vector<std::string>& known, const char* usage,
               std::vector<std::string>* flags, std::vector<std::string>* positional);

}  // namespace ckptfs::cli

#endif  // CKPTFS_CLI_COMMANDS_HPP_
