// Reading a byte range of an open file whole, and writing bytes whole: pread(2) and write(2)
// may move fewer bytes than asked (a signal, a file system's own limit) and fail with EINTR
// when a signal arrives first.
#ifndef CKPTFS_IO_FULL_PREAD_HPP_
#define CKPTFS_IO_FULL_PREAD_HPP_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckptfs/status.hpp"

namespace ckptfs {

// Reads [offset, offset + length) of descriptor `fd` into `out`, calling pread until every
// byte is there or the file ends; *done is how many arrived (fewer than `length` only at the
// end of the file). A failed call is FromErrno(name, "read failed", errno), *done then the
// bytes read before it.
Status PreadFull(int fd, void* out, size_t length, uint64_t offset, std::string_view name, size_t* done);

// Writes all `length` bytes of `data` to descriptor `fd`, calling write until they are out.
// A failed call is FromErrno(name, "write failed", errno); a call that writes nothing, EIO.
Status WriteFull(int fd, const void* data, size_t length, std::string_view name);

}  // namespace ckptfs

#endif  // CKPTFS_IO_FULL_PREAD_HPP_
