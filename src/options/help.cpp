// What the option table says of itself: the help lines of the command line and the mount,
// and the JSON description the C API hands out (ckptfs_options), all generated from the table.
#include <string>

#include "ckptfs/options.hpp"

namespace ckptfs {
namespace {

constexpr size_t kHelpColumn = 20;  // where descriptions start
constexpr size_t kHelpWidth = 94;   // where lines wrap

// "  LEFT    description", the description wrapped at word boundaries and indented to
// kHelpColumn; a LEFT too wide for the column gets a line of its own.
void AppendHelpLine(std::string* out, const std::string& left, std::string_view help) {
  std::string line = left;
  if (line.size() + 1 >= kHelpColumn) {
    *out += line + "\n";
    line.clear();
  }
  line.resize(kHelpColumn, ' ');
  size_t pos = 0;
  bool first_word = true;
  while (pos < help.size()) {
    size_t end = help.find(' ', pos);
    if (end == std::string_view::npos) end = help.size();
    const std::string_view word = help.substr(pos, end - pos);
    if (!first_word && line.size() + 1 + word.size() > kHelpWidth) {
      *out += line + "\n";
      line.assign(kHelpColumn, ' ');
      first_word = true;
    }
    if (!first_word) line += ' ';
    line += word;
    first_word = false;
    pos = end + 1;
  }
  *out += line + "\n";
}

struct FrontEnd {
  const char* name;
  unsigned groups;
};
constexpr FrontEnd kFrontEnds[] = {{"mount", kMountGroups},
                                   {"read_command", kReadCommandGroups},
                                   {"export_command", kExportCommandGroups},
                                   {"load_command", kLoadCommandGroups},
                                   {"diff_command", kDiffCommandGroups},
                                   {"open", kOpenGroups},
                                   {"load_into", kLoadIntoGroups},
                                   {"diff", kDiffGroups}};

constexpr std::pair<OptionGroup, const char*> kGroupNames[] = {{kSourceGroup, "source"},
                                                               {kViewGroup, "view"},
                                                               {kDeviceLoadGroup, "device_load"},
                                                               {kLoadTargetGroup, "load_target"},
                                                               {kExportGroup, "export"},
                                                               {kDiffGroup, "diff"},
                                                               {kDiffSummaryGroup, "diff_summary"},
                                                               {kMountOnlyGroup, "mount"}};

}  // namespace

std::string CommandLineHelp(unsigned groups) {
  std::string out;
  for (const OptionSpec& spec : OptionTable()) {
    if (!(spec.groups & groups)) continue;
    std::string left = "  " + CommandLineFlag(spec);
    if (spec.kind == OptionKind::kValue) left += (spec.family ? "" : " ") + std::string(spec.value_name);
    AppendHelpLine(&out, left, spec.help);
  }
  return out;
}

std::string MountHelp(unsigned groups) {
  std::string out;
  for (const OptionSpec& spec : OptionTable()) {
    if (!(spec.groups & groups)) continue;
    std::string left = "  -o " + std::string(spec.name);
    if (spec.kind == OptionKind::kValue) left += (spec.family ? "" : "=") + std::string(spec.value_name);
    AppendHelpLine(&out, left, spec.help);
  }
  return out;
}

nlohmann::json DescribeOptions() {
  nlohmann::json table = nlohmann::json::array();
  for (const OptionSpec& spec : OptionTable()) {
    nlohmann::json groups = nlohmann::json::array(), front_ends = nlohmann::json::array();
    for (const auto& [group, name] : kGroupNames)
      if (spec.groups & group) groups.push_back(name);
    for (const FrontEnd& front_end : kFrontEnds)
      if (spec.groups & front_end.groups) front_ends.push_back(front_end.name);
    const bool is_switch = spec.kind == OptionKind::kSwitch;
    table.push_back({{"name", spec.name},
                     {"kind", is_switch ? "switch" : "value"},
                     {"on_by_default", spec.on_by_default},
                     {"family", spec.family},
                     {"groups", groups},
                     {"flag", CommandLineFlag(spec)},
                     {"value_name", spec.value_name},
                     {"help", spec.help},
                     {"front_ends", front_ends}});
  }
  return table;
}

std::string FormatsHelp() {
  std::string out;
  for (const ReaderDescription& reader : DescribeReaders()) {
    std::string formats;
    for (std::string_view format : reader.formats) formats += (formats.empty() ? "" : ", ") + std::string(format);
    AppendHelpLine(&out, "  " + formats, reader.description);
  }
  return out;
}

}  // namespace ckptfs
