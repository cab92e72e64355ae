// The hint a refusal over a read limit ends with: how to raise the limit.
#include <string>

#include "format/limit_hint.hpp"

namespace ckptfs {

std::string LimitHint(std::string_view option) {
  std::string flag(option);
  for (char& c : flag)
    if (c == '_') c = '-';
  return " (raise it with -o " + std::string(option) + "=N or --" + flag + " N)";
}

}  // namespace ckptfs
