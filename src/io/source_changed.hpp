// The kSourceChanged errors every Env reports, worded once: users and the test suites
// match these lines, whichever kind of source the file came from.
#ifndef CKPTFS_IO_SOURCE_CHANGED_HPP_
#define CKPTFS_IO_SOURCE_CHANGED_HPP_

#include <string_view>

#include "ckptfs/status.hpp"

namespace ckptfs {

// A read ended before the size recorded at open.
inline Status ShorterThanIndexed(std::string_view name) {
  return Status::SourceChanged(name, "file is shorter than when it was indexed");
}
// The name now reaches another file, or none.
inline Status ReplacedSinceIndexed(std::string_view name) {
  return Status::SourceChanged(name, "file was replaced since it was indexed");
}
// The same file, rewritten.
inline Status ChangedSinceIndexed(std::string_view name) {
  return Status::SourceChanged(name, "file changed since it was indexed (size, mtime or ctime differ)");
}

}  // namespace ckptfs

#endif  // CKPTFS_IO_SOURCE_CHANGED_HPP_
