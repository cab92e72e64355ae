// Status: the single error currency of ckptfs.
//
// Every fallible operation in the core returns a Status. An error carries a code
// (what kind of failure) and one human-readable line that names the file and the
// problem ("ck.pt: record data/3 is compressed; tensor data must be stored").
// Front ends print that line (with the option that raises a read limit, when it names one,
// in their own spelling); the FUSE edge maps the code to an errno.
#ifndef CKPTFS_STATUS_HPP_
#define CKPTFS_STATUS_HPP_

#include <string>
#include <string_view>
#include <utility>

namespace ckptfs {

class Status {
 public:
  enum class Code {
    kOk = 0,
    kNotFound,         // a path or key that does not exist
    kCorruption,       // input bytes that break the format's rules
    kNotSupported,     // a valid input ckptfs cannot serve (yet)
    kInvalidArgument,  // a bad request from the caller
    kIOError,          // the operating system failed a call
    kSourceChanged,    // a source file differs from the one that was indexed
    kRefused,          // input that asks for something we never do (run code)
  };

  Status() = default;  // OK

  static Status OK() { return Status(); }
  static Status NotFound(std::string_view where, std::string_view what) {
    return Status(Code::kNotFound, where, what);
  }
  static Status Corruption(std::string_view where, std::string_view what) {
    return Status(Code::kCorruption, where, what);
  }
  static Status NotSupported(std::string_view where, std::string_view what) {
    return Status(Code::kNotSupported, where, what);
  }
  static Status InvalidArgument(std::string_view where, std::string_view what) {
    return Status(Code::kInvalidArgument, where, what);
  }
  static Status SourceChanged(std::string_view where, std::string_view what) {
    return Status(Code::kSourceChanged, where, what);
  }
  static Status Refused(std::string_view where, std::string_view what) {
    return Status(Code::kRefused, where, what);
  }
  // An I/O error from a failed system call; `err` is its errno.
  static Status FromErrno(std::string_view where, std::string_view what, int err);

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  // "WHERE: WHAT" (empty for OK).
  const std::string& message() const { return message_; }
  // The errno a syscall-shaped front end (FUSE) should answer with.
  int ToErrno() const;
  // The errno given to FromErrno, or 0.
  int sys_errno() const { return sys_errno_; }

  // A refusal over a read limit names the option that raises it ("max_pickle": a name of the
  // option table, in static storage). The core never spells an option: each front end says
  // how to set it in its own spelling (StatusText, include/ckptfs/options.hpp), inserted at
  // limit_option_at() in message(). Empty for other statuses.
  Status WithLimitOption(std::string_view option) const;
  // This status naming the limit option `from` names (same place in the message): for an
  // error rebuilt from another's message.
  Status WithLimitOptionOf(const Status& from) const;
  std::string_view limit_option() const { return limit_option_; }
  size_t limit_option_at() const { return limit_option_at_; }

 private:
  Status(Code code, std::string_view where, std::string_view what);

  Code code_ = Code::kOk;
  int sys_errno_ = 0;
  std::string message_;
  std::string_view limit_option_;
  size_t limit_option_at_ = 0;
};

}  // namespace ckptfs

// Returns from the enclosing function when `expr` yields an error Status.
#define CKPTFS_RETURN_IF_ERROR(expr)            \
  do {                                          \
    ::ckptfs::Status ckptfs_status_ = (expr);   \
    if (!ckptfs_status_.ok()) return ckptfs_status_; \
  } while (0)

#endif  // CKPTFS_STATUS_HPP_
