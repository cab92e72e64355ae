// The hint every limit error ends with (limits: ReadLimits in ckptfs/limits.hpp).
#ifndef CKPTFS_FORMAT_LIMIT_HINT_HPP_
#define CKPTFS_FORMAT_LIMIT_HINT_HPP_

#include <string>
#include <string_view>

namespace ckptfs {

// " (raise it with -o max_pickle=N or --max-pickle N)": appended to every limit error, so
// the one line a user sees says how to get past it.
std::string LimitHint(std::string_view option);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_LIMIT_HINT_HPP_
