// How each front end spells an option of the table: the mount's -o entries, the command
// line's flags and the C API's JSON keys. Every spelling ends in the table's own parser, so
// the same option means the same thing (and refuses the same values) everywhere.
#include <algorithm>
#include <string>

#include "ckptfs/options.hpp"

namespace ckptfs {
namespace {

// A bad value names the option as the mount writes it, whatever the front end: the one form
// the limit hints and the documentation use too.
std::string Where(std::string_view name, std::string_view value) {
  return std::string(name) + "=" + std::string(value);
}

// `name`: the option as given, which for a family ("map.") is the member ("map.num_layers").
Status SetValue(const OptionSpec& spec, std::string_view name, std::string_view value, OptionValues* out) {
  return spec.parse(Where(spec.family ? name : spec.name, value), value, out);
}

// The command line's member of a family: "--map.num-query-groups" -> "map.num_query_groups".
std::string FamilyMember(std::string_view flag) {
  std::string name(flag.substr(2));
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
}

}  // namespace

std::string CommandLineFlag(const OptionSpec& spec) {
  std::string flag = spec.on_by_default ? "--no-" : "--";
  for (char c : spec.name) flag += c == '_' ? '-' : c;
  return flag;
}

Status ParseMountOption(std::string_view entry, unsigned groups, OptionValues* out, bool* known) {
  const size_t eq = entry.find('=');
  const std::string_view name = entry.substr(0, eq);
  const OptionSpec* spec = FindOption(name);
  *known = spec != nullptr;
  if (!spec) return Status::OK();
  if (!(spec->groups & groups)) return Status::InvalidArgument(name, "not a mount option (see --help)");
  if (spec->kind == OptionKind::kSwitch) {
    if (eq != std::string_view::npos) return Status::InvalidArgument(name, "takes no value");
    spec->turn(out, !spec->on_by_default);
    return Status::OK();
  }
  if (eq == std::string_view::npos) return Status::InvalidArgument(name, "needs a value");
  return SetValue(*spec, name, entry.substr(eq + 1), out);
}

Status ParseCommandLineOption(const std::vector<std::string>& args, size_t* next, unsigned groups,
                              OptionValues* out, bool* known) {
  *known = false;
  const std::string_view arg = args[*next];
  if (arg.size() < 3 || arg.substr(0, 2) != "--") return Status::OK();
  const size_t eq = arg.find('=');
  const std::string_view flag = arg.substr(0, eq);
  const OptionSpec* spec = nullptr;
  for (const OptionSpec& candidate : OptionTable()) {
    if (!(candidate.groups & groups)) continue;
    const std::string candidate_flag = CommandLineFlag(candidate);
    if (candidate.family ? flag.size() > candidate_flag.size() && flag.starts_with(candidate_flag)
                         : candidate_flag == flag)
      spec = &candidate;
  }
  if (!spec) return Status::OK();
  const std::string name = FamilyMember(flag);
  *known = true;
  if (spec->kind == OptionKind::kSwitch) {
    if (eq != std::string_view::npos)
      return Status::InvalidArgument("", "option '" + std::string(flag) + "' takes no value");
    spec->turn(out, !spec->on_by_default);
    return Status::OK();
  }
  if (eq != std::string_view::npos) return SetValue(*spec, name, arg.substr(eq + 1), out);
  if (*next + 1 >= args.size())
    return Status::InvalidArgument("", "option '" + std::string(flag) + "' needs a value");
  return SetValue(*spec, name, args[++*next], out);
}

Status ParseJsonOptions(const nlohmann::json& options, unsigned groups, OptionValues* out) {
  if (!options.is_object()) return Status::InvalidArgument("options", "not a JSON object");
  for (auto it = options.begin(); it != options.end(); ++it) {
    const OptionSpec* spec = FindOption(it.key());
    if (!spec || !(spec->groups & groups))
      return Status::InvalidArgument("options", "unknown option '" + it.key() + "'");
    const nlohmann::json& v = it.value();
    if (v.is_null()) continue;  // not given: the default stays
    if (spec->kind == OptionKind::kSwitch) {
      if (!v.is_boolean()) return Status::InvalidArgument(it.key(), "takes true or false");
      spec->turn(out, v.get<bool>());
      continue;
    }
    if (!v.is_string() && !v.is_number()) return Status::InvalidArgument(it.key(), "needs a string or a number");
    CKPTFS_RETURN_IF_ERROR(SetValue(*spec, it.key(), v.is_string() ? v.get<std::string>() : v.dump(), out));
  }
  return Status::OK();
}

std::string StatusText(const Status& status, OptionSpelling spelling) {
  const std::string_view name = status.limit_option();
  const OptionSpec* spec = name.empty() ? nullptr : FindOption(name);
  if (!spec) return status.message();
  const std::string assignment = std::string(name) + "=N";
  std::string hint = " (raise it with ";
  switch (spelling) {
    case OptionSpelling::kMount: hint += "-o " + assignment; break;
    case OptionSpelling::kCommandLine: hint += "-o " + assignment + " or " + CommandLineFlag(*spec) + " N"; break;
    case OptionSpelling::kJson: hint += assignment; break;
  }
  hint += ")";
  std::string text = status.message();
  text.insert(std::min(status.limit_option_at(), text.size()), hint);
  return text;
}

}  // namespace ckptfs
