#include "ckptfs/status.hpp"

#include <cerrno>
#include <cstring>

namespace ckptfs {

Status::Status(Code code, std::string_view where, std::string_view what) : code_(code) {
  message_.reserve(where.size() + what.size() + 2);
  message_.append(where);
  if (!where.empty() && !what.empty()) message_.append(": ");
  message_.append(what);
}

Status Status::FromErrno(std::string_view where, std::string_view what, int err) {
  std::string text(what);
  if (!text.empty()) text += ": ";
  text += std::strerror(err);
  Status s(err == ENOENT ? Code::kNotFound : Code::kIOError, where, text);
  s.sys_errno_ = err;
  return s;
}

Status Status::WithLimitOption(std::string_view option) const {
  Status s = *this;
  s.limit_option_ = option;
  s.limit_option_at_ = message_.size();
  return s;
}

Status Status::WithLimitOptionOf(const Status& from) const {
  Status s = *this;
  s.limit_option_ = from.limit_option_;
  s.limit_option_at_ = from.limit_option_at_;
  return s;
}

int Status::ToErrno() const {
  switch (code_) {
    case Code::kOk: return 0;
    case Code::kNotFound: return ENOENT;
    case Code::kInvalidArgument: return EINVAL;
    case Code::kNotSupported: return EOPNOTSUPP;
    case Code::kIOError: return sys_errno_ != 0 ? sys_errno_ : EIO;
    // Bad or changed bytes under a mount surface as EIO: the caller must not
    // mistake them for data.
    case Code::kCorruption:
    case Code::kSourceChanged:
    case Code::kRefused: return EIO;
  }
  return EIO;
}

}  // namespace ckptfs
