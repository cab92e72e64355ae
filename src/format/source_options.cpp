// Source options: what a reader includes (moments) and the limits it works within.
#include <charconv>

#include "ckptfs/catalog.hpp"
#include "ckptfs/view.hpp"  // ParseSize
#include "format/limit_hint.hpp"

namespace ckptfs {

std::string LimitHint(std::string_view option) {
  std::string flag(option);
  for (char& c : flag)
    if (c == '_') c = '-';
  return " (raise it with -o " + std::string(option) + "=N or --" + flag + " N)";
}

Status ParseSourceOption(std::string_view key, std::string_view value, SourceOptions* options, bool* known) {
  *known = true;
  if (key == "moments") {
    if (!value.empty()) return Status::InvalidArgument("moments", "takes no value");
    options->zero_moments = true;
    return Status::OK();
  }
  ReadLimits& l = options->limits;
  uint64_t* size_limit = key == "max_pickle"          ? &l.pickle_bytes
                         : key == "max_pickle_memory" ? &l.pickle_memory
                         : key == "max_header"        ? &l.header_bytes
                                                      : nullptr;
  if (size_limit) {
    Status s = ParseSize(value, size_limit);
    if (!s.ok()) return Status::InvalidArgument(std::string(key) + "=" + std::string(value), s.message());
    return Status::OK();
  }
  if (key == "max_tensors") {
    uint64_t n = 0;
    auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
    if (ec != std::errc() || ptr != value.data() + value.size() || n == 0)
      return Status::InvalidArgument("max_tensors=" + std::string(value), "not a positive count");
    l.tensors = n;
    return Status::OK();
  }
  *known = false;
  return Status::OK();
}

}  // namespace ckptfs
