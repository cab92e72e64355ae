// Options: the one table of every option ckptfs takes, and the spellings its front ends use.
//
// Each option is declared once (src/options/table.cpp): its name, whether it is a switch or
// takes a value, how the value parses, its help line and the groups it belongs to. Every
// front end parses through the table in its own spelling and takes the groups it serves:
//
//   mount               -o name=value, -o switch             source, view, mount
//   ckptfs ls|info|cat|hash
//                       --name value, --name=value, --switch  source, view
//   ckptfs export       (the same)                            source, view, export
//   ckptfs load         (the same)                            source, view, device load, load target
//   ckptfs diff         (the same)                            source, view, diff, diff summary
//   ckptfs_open         {"name": value, "switch": true}       source, view
//   ckptfs_load_into    (the same)                            device load
//   ckptfs_diff         (the same)                            diff
//
// The command line writes '-' for '_' (--shard-size); a switch that is on by default is
// spelled --no-NAME there (--no-direct-io). Help texts and the C API's description of the
// table (ckptfs_options) are generated from it, so no front end can drift from the others.
#ifndef CKPTFS_OPTIONS_HPP_
#define CKPTFS_OPTIONS_HPP_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/catalog.hpp"
#include "ckptfs/device.hpp"
#include "ckptfs/diff.hpp"
#include "ckptfs/source.hpp"
#include "ckptfs/status.hpp"
#include "ckptfs/view.hpp"

namespace ckptfs {

// What `ckptfs export` writes (the write option), as bits of OptionValues::export_parts.
enum ExportPart : unsigned {
  kExportModel = 1u << 0,    // model.safetensors, or the Hugging Face shards and their index
  kExportTensors = 1u << 1,  // tensors/: one safetensors file per tensor
  kExportFiles = 1u << 2,    // manifest.json, metadata.json and the source folder's other files
};

// What the table fills.
struct OptionValues {
  SourceOptions source;    // moments, max_pickle, max_pickle_memory, max_header, max_tensors
  ViewOptions view;        // dtype, root, shard_size, checksums
  DeviceLoadOptions load;  // buffer_size, buffers, io_threads, direct_io, select
  bool verify = false;     // verify: read every loaded tensor back and compare with the view
  std::string backend = "auto";  // backend: host, cuda, cufile or auto
  int device = 0;                // device: the CUDA device number
  // write: what export writes. The model and the small files by default: the per-tensor
  // files would double the bytes written, and a model folder is what loaders open.
  unsigned export_parts = kExportModel | kExportFiles;
  DiffOptions diff;            // atol, rtol, threads
  unsigned diff_rows = 20;     // rows: of `ckptfs diff`'s summary table
  // passthrough: auto (true), let the kernel serve the files that are source files unchanged
  // straight from them where it can; off (false), every read through ckptfs.
  bool passthrough = true;
};

enum class OptionKind : uint8_t {
  kSwitch,  // on or off, no value
  kValue,   // takes one value
};

// What an option is about; a front end takes whole groups.
enum OptionGroup : unsigned {
  kSourceGroup = 1u << 0,      // how a source is read (SourceOptions)
  kViewGroup = 1u << 1,        // how the view presents it (ViewOptions)
  kDeviceLoadGroup = 1u << 2,  // how a load to device memory runs (DeviceLoadOptions, verify)
  // What `ckptfs load` loads and where. The C API takes these as ckptfs_load_into's
  // arguments (backend, device, the tensor indices), not as options.
  kLoadTargetGroup = 1u << 3,
  kExportGroup = 1u << 4,  // what `ckptfs export` writes (export_parts)
  kDiffGroup = 1u << 5,    // how two views are compared (DiffOptions)
  kDiffSummaryGroup = 1u << 6,  // what `ckptfs diff` prints
  kMountOnlyGroup = 1u << 7,    // how a mount serves its files (passthrough)
};

// The groups each front end takes.
inline constexpr unsigned kMountGroups = kSourceGroup | kViewGroup | kMountOnlyGroup;
inline constexpr unsigned kReadCommandGroups = kSourceGroup | kViewGroup;  // ls, info, cat, hash
inline constexpr unsigned kExportCommandGroups = kReadCommandGroups | kExportGroup;
inline constexpr unsigned kLoadCommandGroups = kSourceGroup | kViewGroup | kDeviceLoadGroup | kLoadTargetGroup;
inline constexpr unsigned kOpenGroups = kSourceGroup | kViewGroup;  // ckptfs_open
inline constexpr unsigned kLoadIntoGroups = kDeviceLoadGroup;       // ckptfs_load_into
// ckptfs diff: its own options, and those of both sides (--NAME, -a/-b lists, --NAME-a).
inline constexpr unsigned kDiffOwnGroups = kDiffGroup | kDiffSummaryGroup;
inline constexpr unsigned kDiffCommandGroups = kReadCommandGroups | kDiffOwnGroups;
inline constexpr unsigned kDiffGroups = kDiffGroup;  // ckptfs_diff

struct OptionSpec {
  std::string_view name;  // the mount's -o name and the JSON key; the command line writes '-' for '_'
  OptionKind kind = OptionKind::kValue;
  unsigned groups = 0;          // OptionGroup bits
  std::string_view value_name;  // kValue: the value's placeholder in help ("SIZE")
  std::string_view help;        // what it does, for --help (the command line's spelling)
  // kValue: parses `value` into `out`; a bad value is an InvalidArgument error whose message
  // starts with `where` (the option as the user wrote it, e.g. "dtype=int8").
  Status (*parse)(std::string_view where, std::string_view value, OptionValues* out) = nullptr;
  // kSwitch: turns it on or off.
  void (*turn)(OptionValues* out, bool on) = nullptr;
  // kSwitch: on unless turned off. The command line spells it --no-NAME, which turns it off.
  bool on_by_default = false;
  // A family of options: `name` ends in '.', and every "NAME.X" is one of them ("map.X"). The
  // parser's `where` is then always "NAME.X=VALUE", X as the user wrote it with '-' read as '_'.
  bool family = false;
};

// Every option, in help order.
std::span<const OptionSpec> OptionTable();
// The table entry named `name` ("shard_size"; "map.num_layers" finds the family "map."), or nullptr.
const OptionSpec* FindOption(std::string_view name);

// "5GB" (decimal), "2GiB" (binary), "100MB", "512KiB", "123" (bytes); case-insensitive.
Status ParseSize(std::string_view text, uint64_t* bytes);

// The command line's spelling of `spec`: "--shard-size", "--no-direct-io".
std::string CommandLineFlag(const OptionSpec& spec);

// Mount: one entry of an -o list, "name=value" or "name". *known is false for names not in
// the table (libfuse's and mount(8)'s options, left to the caller). A table option outside
// `groups`, a switch given a value or a bad value is an error.
Status ParseMountOption(std::string_view entry, unsigned groups, OptionValues* out, bool* known);

// Command line: args[*next] is "--name", "--name=value", or "--name" followed by its value.
// On success *next is the index of the last argument used. *known is false when args[*next]
// is no table option of `groups` (the caller's own flags, or an unknown option); errors
// ("option '--root' needs a value", a bad value) are for the caller to report as usage errors.
Status ParseCommandLineOption(const std::vector<std::string>& args, size_t* next, unsigned groups,
                              OptionValues* out, bool* known);

// C API: a JSON object of options. Keys are table names in `groups`; values are strings or
// numbers for value options, true or false for switches; null means not given.
Status ParseJsonOptions(const nlohmann::json& options, unsigned groups, OptionValues* out);

// The spelling a front end gives an option in its messages.
enum class OptionSpelling : uint8_t {
  kMount,        // -o max_pickle=N
  kCommandLine,  // the ckptfs command: --max-pickle N (and -o max_pickle=N, its mount's)
  kJson,         // the C API and the Python package: max_pickle=N
};

// status.message() with, for a refusal over a read limit (Status::limit_option), how to raise
// the limit in `spelling`: "...: more than 5 tensors (raise it with -o max_tensors=N)".
std::string StatusText(const Status& status, OptionSpelling spelling);

// Help lines for the options of `groups`: "  --dtype T         serve ...".
std::string CommandLineHelp(unsigned groups);
// The same for the mount: "  -o dtype=T        serve ...".
std::string MountHelp(unsigned groups);
// The table as JSON, for ckptfs_options(): [{"name", "kind", "groups", "flag", "value_name",
// "help", "front_ends"}], front ends named mount, read_command, export_command, load_command,
// diff_command, open, load_into, diff.
nlohmann::json DescribeOptions();
// The formats ckptfs reads, one help line per reader of the registry: the formats `ckptfs
// info` names its catalogs by, and what it reads ("  torch-zip         torch .pt/.bin: ...").
std::string FormatsHelp();

}  // namespace ckptfs

#endif  // CKPTFS_OPTIONS_HPP_
