// The option table (src/options/): its entries, and the same option through each front end's
// spelling (mount -o entries, command-line flags, C API JSON).
#define BOOST_TEST_MODULE options_test
#include <boost/test/unit_test.hpp>

#include <set>
#include <string>
#include <vector>

#include "ckptfs/options.hpp"

using ckptfs::DType;
using ckptfs::OptionKind;
using ckptfs::OptionSpec;
using ckptfs::OptionTable;
using ckptfs::OptionValues;
using ckptfs::Status;

namespace {

Status Mount(std::string_view entry, OptionValues* out, bool* known) {
  return ckptfs::ParseMountOption(entry, ckptfs::kMountGroups, out, known);
}

// Parses the whole of `args` as command-line options of `groups`; false on an unknown one.
Status CommandLine(std::vector<std::string> args, unsigned groups, OptionValues* out, bool* known) {
  for (size_t i = 0; i < args.size(); ++i) {
    Status s = ckptfs::ParseCommandLineOption(args, &i, groups, out, known);
    if (!s.ok() || !*known) return s;
  }
  return Status::OK();
}

Status Json(const char* text, unsigned groups, OptionValues* out) {
  return ckptfs::ParseJsonOptions(nlohmann::json::parse(text), groups, out);
}

}  // namespace

BOOST_AUTO_TEST_CASE(sizes_parse_with_decimal_and_binary_units) {
  uint64_t n = 0;
  BOOST_TEST(ckptfs::ParseSize("5GB", &n).ok());
  BOOST_TEST(n == 5000000000ull);
  BOOST_TEST(ckptfs::ParseSize("2gib", &n).ok());
  BOOST_TEST(n == 2147483648ull);
  BOOST_TEST(ckptfs::ParseSize("123", &n).ok());
  BOOST_TEST(n == 123u);
  BOOST_TEST(!ckptfs::ParseSize("0", &n).ok());
  BOOST_TEST(!ckptfs::ParseSize("abc", &n).ok());
  BOOST_TEST(!ckptfs::ParseSize("5XB", &n).ok());
  BOOST_TEST(!ckptfs::ParseSize("99999999999999TB", &n).ok());
  BOOST_TEST(ckptfs::ParseSize("abc", &n).message() == "abc: not a size (e.g. 5GB, 2GiB, 500MB)");
}

BOOST_AUTO_TEST_CASE(every_entry_is_complete_and_unique) {
  std::set<std::string> names, flags;
  for (const OptionSpec& spec : OptionTable()) {
    BOOST_TEST_CONTEXT(spec.name) {
      BOOST_TEST(names.insert(std::string(spec.name)).second);
      BOOST_TEST(flags.insert(ckptfs::CommandLineFlag(spec)).second);
      BOOST_TEST(spec.groups != 0u);
      BOOST_TEST(!spec.help.empty());
      // A family ("map.") is found by its members' names.
      BOOST_TEST(ckptfs::FindOption(spec.family ? std::string(spec.name) + "x" : std::string(spec.name)) == &spec);
      if (spec.family) BOOST_TEST(ckptfs::FindOption(spec.name) == nullptr);
      if (spec.kind == OptionKind::kValue) {
        BOOST_TEST(spec.parse != nullptr);
        BOOST_TEST(!spec.value_name.empty());
        BOOST_TEST(!spec.on_by_default);
      } else {
        BOOST_TEST(spec.turn != nullptr);
        BOOST_TEST(spec.value_name.empty());
      }
      // The mount and JSON names are the command line's with '_': one rule, no exceptions.
      BOOST_TEST(spec.name.find('-') == std::string_view::npos);
    }
  }
  BOOST_TEST(ckptfs::FindOption("allow_other") == nullptr);
}

BOOST_AUTO_TEST_CASE(limit_hints_name_the_table_spellings) {
  using ckptfs::OptionSpelling;
  for (const char* name : {"max_pickle", "max_pickle_memory", "max_header", "max_tensors"}) {
    const OptionSpec* spec = ckptfs::FindOption(name);
    BOOST_TEST_REQUIRE(spec != nullptr);
    BOOST_TEST((spec->groups & ckptfs::kSourceGroup) != 0u);
    // The hint goes where the reader named the option, before context added after it.
    const Status s = Status::Refused("ck.pt", "too big").WithLimitOption(name);
    const Status annotated = Status::Refused(s.message(), "while reading 'x'").WithLimitOptionOf(s);
    const std::string n(name);
    BOOST_TEST(ckptfs::StatusText(s, OptionSpelling::kMount) == "ck.pt: too big (raise it with -o " + n + "=N)");
    BOOST_TEST(ckptfs::StatusText(s, OptionSpelling::kJson) == "ck.pt: too big (raise it with " + n + "=N)");
    BOOST_TEST(ckptfs::StatusText(annotated, OptionSpelling::kCommandLine) ==
               "ck.pt: too big (raise it with -o " + n + "=N or " + ckptfs::CommandLineFlag(*spec) +
                   " N): while reading 'x'");
  }
  const Status plain = Status::Refused("ck.pt", "too big");
  BOOST_TEST(ckptfs::StatusText(plain, OptionSpelling::kMount) == plain.message());
}

BOOST_AUTO_TEST_CASE(mount_entries) {
  OptionValues o;
  bool known = false;
  BOOST_TEST(Mount("dtype=bf16", &o, &known).ok());
  BOOST_TEST(known);
  BOOST_TEST((o.view.dtype == DType::kBF16));
  BOOST_TEST(Mount("checksums", &o, &known).ok());
  BOOST_TEST(o.view.checksums);
  BOOST_TEST(Mount("max_tensors=12", &o, &known).ok());
  BOOST_TEST(o.source.limits.tensors == 12u);
  BOOST_TEST(Mount("allow_other", &o, &known).ok());
  BOOST_TEST(!known);
  BOOST_TEST(Mount("dtype=int8", &o, &known).message() == "dtype=int8: the target dtype must be bf16, fp16 or fp32");
  BOOST_TEST(Mount("max_tensors=0", &o, &known).message() == "max_tensors=0: not a positive count");
  BOOST_TEST(Mount("max_pickle=abc", &o, &known).message() == "max_pickle=abc: not a size (e.g. 5GB, 2GiB, 500MB)");
  BOOST_TEST(Mount("moments=1", &o, &known).message() == "moments: takes no value");
  BOOST_TEST(Mount("root", &o, &known).message() == "root: needs a value");
  BOOST_TEST(!Mount("buffers=4", &o, &known).ok());  // ckptfs load's, not the mount's
  BOOST_TEST(known);
}

BOOST_AUTO_TEST_CASE(command_line_flags) {
  OptionValues o;
  bool known = false;
  BOOST_TEST(CommandLine({"--shard-size", "2GiB", "--max-pickle-memory=1MiB", "--moments"}, ckptfs::kReadCommandGroups,
                         &o, &known)
                 .ok());
  BOOST_TEST(known);
  BOOST_TEST(o.view.shard_size == (uint64_t{2} << 30));
  BOOST_TEST(o.source.limits.pickle_memory == (uint64_t{1} << 20));
  BOOST_TEST(o.source.zero_moments);

  BOOST_TEST(CommandLine({"--no-direct-io"}, ckptfs::kReadCommandGroups, &o, &known).ok());
  BOOST_TEST(!known);  // a load option: unknown to ls, cat, ...
  BOOST_TEST(CommandLine({"--no-direct-io", "--select", "a.*", "--select=b", "--buffers", "3", "--verify"},
                         ckptfs::kLoadCommandGroups, &o, &known)
                 .ok());
  BOOST_TEST(known);
  BOOST_TEST(!o.load.direct_io);
  BOOST_TEST((o.load.select == std::vector<std::string>{"a.*", "b"}));
  BOOST_TEST(o.load.buffers == 3);
  BOOST_TEST(o.verify);
  BOOST_TEST(CommandLine({"--direct-io"}, ckptfs::kLoadCommandGroups, &o, &known).ok());
  BOOST_TEST(!known);  // spelled --no-direct-io only

  BOOST_TEST(CommandLine({"--root"}, ckptfs::kReadCommandGroups, &o, &known).message() ==
             "option '--root' needs a value");
  BOOST_TEST(CommandLine({"--checksums=yes"}, ckptfs::kReadCommandGroups, &o, &known).message() ==
             "option '--checksums' takes no value");
  BOOST_TEST(CommandLine({"--buffers", "0"}, ckptfs::kLoadCommandGroups, &o, &known).message() ==
             "buffers=0: not a count from 1 to 1048576");
  BOOST_TEST(!CommandLine({"--buffer-size", "1KiB"}, ckptfs::kLoadCommandGroups, &o, &known).ok());
  BOOST_TEST(!CommandLine({"--backend", "tpu"}, ckptfs::kLoadCommandGroups, &o, &known).ok());
  BOOST_TEST(!CommandLine({"--device", "-1"}, ckptfs::kLoadCommandGroups, &o, &known).ok());
}

BOOST_AUTO_TEST_CASE(json_objects) {
  OptionValues o;
  BOOST_TEST(Json(R"({"moments": false, "checksums": true, "max_header": 1000, "root": null})", ckptfs::kOpenGroups, &o)
                 .ok());
  BOOST_TEST(!o.source.zero_moments);
  BOOST_TEST(o.view.checksums);
  BOOST_TEST(o.source.limits.header_bytes == 1000u);
  BOOST_TEST(o.view.root.empty());
  BOOST_TEST(Json(R"({"direct_io": false, "buffer_size": 65536, "io_threads": "3"})", ckptfs::kLoadIntoGroups, &o).ok());
  BOOST_TEST(!o.load.direct_io);
  BOOST_TEST(o.load.buffer_bytes == 65536u);
  BOOST_TEST(o.load.io_threads == 3);

  BOOST_TEST(Json(R"({"buffers": 4})", ckptfs::kOpenGroups, &o).message() == "options: unknown option 'buffers'");
  BOOST_TEST(Json(R"({"dtype": "bf16"})", ckptfs::kLoadIntoGroups, &o).message() == "options: unknown option 'dtype'");
  BOOST_TEST(Json(R"({"select": "a"})", ckptfs::kLoadIntoGroups, &o).message() == "options: unknown option 'select'");
  BOOST_TEST(Json(R"({"dtype": true})", ckptfs::kOpenGroups, &o).message() == "dtype: needs a string or a number");
  BOOST_TEST(Json(R"({"verify": "yes"})", ckptfs::kLoadIntoGroups, &o).message() == "verify: takes true or false");
  BOOST_TEST(Json(R"({"buffers": 2.5})", ckptfs::kLoadIntoGroups, &o).message() ==
             "buffers=2.5: not a count from 1 to 1048576");
  BOOST_TEST(!ckptfs::ParseJsonOptions(nlohmann::json::array(), ckptfs::kOpenGroups, &o).ok());
}

BOOST_AUTO_TEST_CASE(export_write_parts) {
  OptionValues o;
  bool known = false;
  BOOST_TEST(o.export_parts == (ckptfs::kExportModel | ckptfs::kExportFiles));  // the default
  BOOST_TEST(CommandLine({"--write", "tensors,MODEL"}, ckptfs::kExportCommandGroups, &o, &known).ok());
  BOOST_TEST(o.export_parts == (ckptfs::kExportModel | ckptfs::kExportTensors));
  BOOST_TEST(CommandLine({"--write=all"}, ckptfs::kExportCommandGroups, &o, &known).ok());
  BOOST_TEST(o.export_parts == (ckptfs::kExportModel | ckptfs::kExportTensors | ckptfs::kExportFiles));
  BOOST_TEST(CommandLine({"--write", "files"}, ckptfs::kExportCommandGroups, &o, &known).ok());
  BOOST_TEST(o.export_parts == ckptfs::kExportFiles);
  for (const char* bad : {"", "model,", ",model", "weights", "model;files"}) {
    BOOST_TEST_CONTEXT(bad) {
      BOOST_TEST(CommandLine({"--write", bad}, ckptfs::kExportCommandGroups, &o, &known).message() ==
                 "write=" + std::string(bad) + ": write takes model, tensors, files or all, comma-separated");
    }
  }
  BOOST_TEST(o.export_parts == ckptfs::kExportFiles);  // a bad value changes nothing
  // Only export takes it.
  BOOST_TEST(CommandLine({"--write", "all"}, ckptfs::kReadCommandGroups, &o, &known).ok());
  BOOST_TEST(!known);
}

BOOST_AUTO_TEST_CASE(help_lists_every_option_of_its_front_end) {
  // Every option is on some command's help (load's, export's (write) or diff's), but those
  // of the mount alone, which are on the mount's.
  const std::string cli = ckptfs::CommandLineHelp(ckptfs::kLoadCommandGroups | ckptfs::kExportCommandGroups |
                                                  ckptfs::kDiffCommandGroups);
  const std::string mount = ckptfs::MountHelp(ckptfs::kMountGroups);
  for (const OptionSpec& spec : OptionTable()) {
    BOOST_TEST_CONTEXT(spec.name) {
      const std::string left = ckptfs::CommandLineFlag(spec) + (spec.family ? std::string(spec.value_name) : " ");
      BOOST_TEST((cli.find("  " + left) != std::string::npos) == (spec.groups != ckptfs::kMountOnlyGroup));
      const bool mounts = (spec.groups & ckptfs::kMountGroups) != 0;
      BOOST_TEST((mount.find("  -o " + std::string(spec.name)) != std::string::npos) == mounts);
    }
  }
  size_t start = 0;
  while (start < cli.size()) {
    const size_t end = cli.find('\n', start);
    BOOST_TEST(end - start <= 94u, cli.substr(start, end - start));
    start = end + 1;
  }
}

BOOST_AUTO_TEST_CASE(diff_options_in_every_spelling) {
  OptionValues o;
  bool known = false;
  BOOST_TEST(CommandLine({"--atol", "0.5"}, ckptfs::kDiffCommandGroups, &o, &known).ok());
  BOOST_TEST(CommandLine({"--rtol=1e-3"}, ckptfs::kDiffCommandGroups, &o, &known).ok());
  BOOST_TEST(CommandLine({"--threads", "3"}, ckptfs::kDiffCommandGroups, &o, &known).ok());
  BOOST_TEST(CommandLine({"--rows", "0"}, ckptfs::kDiffCommandGroups, &o, &known).ok());
  BOOST_TEST(o.diff.atol == 0.5);
  BOOST_TEST(o.diff.rtol == 1e-3);
  BOOST_TEST(o.diff.threads == 3u);
  BOOST_TEST(o.diff_rows == 0u);
  for (const char* bad : {"-1", "nan", "inf", "", "1x"}) {
    BOOST_TEST_CONTEXT(bad) {
      BOOST_TEST(CommandLine({"--atol", bad}, ckptfs::kDiffCommandGroups, &o, &known).message() ==
                 "atol=" + std::string(bad) + ": needs a finite number >= 0");
    }
  }
  BOOST_TEST(CommandLine({"--rows", "4097"}, ckptfs::kDiffCommandGroups, &o, &known).message() ==
             "rows=4097: needs a whole number up to 4096");
  BOOST_TEST(o.diff.atol == 0.5);  // a bad value changes nothing
  // ckptfs_diff takes the comparison's options, not the summary's; no other front end takes them.
  BOOST_TEST(ckptfs::ParseJsonOptions({{"atol", 0.25}, {"threads", 2}}, ckptfs::kDiffGroups, &o).ok());
  BOOST_TEST(o.diff.atol == 0.25);
  BOOST_TEST(ckptfs::ParseJsonOptions({{"rows", 5}}, ckptfs::kDiffGroups, &o).message() ==
             "options: unknown option 'rows'");
  BOOST_TEST(CommandLine({"--atol", "1"}, ckptfs::kReadCommandGroups, &o, &known).ok());
  BOOST_TEST(!known);
  BOOST_TEST(ckptfs::ParseMountOption("atol=1", ckptfs::kMountGroups, &o, &known).message() ==
             "atol: not a mount option (see --help)");
}

BOOST_AUTO_TEST_CASE(map_settings_are_a_family_in_every_spelling) {
  ckptfs::OptionValues o;
  bool known = false;
  BOOST_TEST(ckptfs::ParseMountOption("map=auto", ckptfs::kMountGroups, &o, &known).ok());
  BOOST_TEST(ckptfs::ParseMountOption("map.num_layers=4", ckptfs::kMountGroups, &o, &known).ok());
  BOOST_TEST(known);
  std::vector<std::string> args = {"--map.num-query-groups", "8"};
  size_t next = 0;
  BOOST_TEST(ckptfs::ParseCommandLineOption(args, &next, ckptfs::kReadCommandGroups, &o, &known).ok());
  BOOST_TEST(known);
  BOOST_TEST(next == 1u);
  BOOST_TEST(ckptfs::ParseJsonOptions(nlohmann::json{{"map.vocab_size", 100}, {"map.num_layers", 6}}, ckptfs::kOpenGroups, &o).ok());
  BOOST_TEST(o.view.map == "auto");
  using Setting = std::pair<std::string, std::string>;
  BOOST_TEST((o.view.map_settings == std::vector<Setting>{{"num_layers", "6"}, {"num_query_groups", "8"}, {"vocab_size", "100"}}));
  BOOST_TEST(ckptfs::ParseMountOption("map.=4", ckptfs::kMountGroups, &o, &known).ok());
  BOOST_TEST(!known);  // no member name: not the family
  BOOST_TEST(ckptfs::ParseMountOption("map.bad-name=4", ckptfs::kMountGroups, &o, &known).message() ==
             "map.bad-name=4: map.NAME=VALUE needs a NAME of letters, digits and '_'");
  BOOST_TEST(!ckptfs::ParseMountOption("map.x=", ckptfs::kMountGroups, &o, &known).ok());
  BOOST_TEST(ckptfs::ParseMountOption("map=m.json", ckptfs::kMountGroups, &o, &known).message() ==
             "map=m.json: needs an absolute file path (a mount runs from /)");
  BOOST_TEST(ckptfs::ParseMountOption("map=none", ckptfs::kMountGroups, &o, &known).ok());
  BOOST_TEST(o.view.map.empty());
}
