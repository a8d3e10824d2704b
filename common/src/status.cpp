#include "strata/common/status.hpp"

#include <cerrno>
#include <cstring>
#include <ostream>

#include "strata/common/assert.hpp"

namespace strata {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kOutOfBudget:
      return "OutOfBudget";
    case StatusCode::kOutOfMemory:
      return "OutOfMemory";
    case StatusCode::kNoSpace:
      return "NoSpace";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kCorrupt:
      return "Corrupt";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  // One line whatever the message quotes: a control character from user input
  // (a config key or a flag value with a newline) is printed escaped.
  std::string line = fmt::format("{}: ", status_code_name(code_));
  for (const char c : message_) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      line += fmt::format("\\x{:02x}", u);
    } else {
      line += c;
    }
  }
  return line;
}

Status& Status::with_context(std::string_view context) {
  if (!ok()) message_ = fmt::format("{}: {}", context, message_);
  return *this;
}

std::ostream& operator<<(std::ostream& os, const Status& status) {
  return os << status.to_string();
}

Status errno_status(int err, std::string_view what) {
  StatusCode code = StatusCode::kIoError;
  switch (err) {
    case ENOSPC:
    case EFBIG:
    case EDQUOT:
      code = StatusCode::kNoSpace;
      break;
    case ENOENT:
      code = StatusCode::kNotFound;
      break;
    case EACCES:
    case EPERM:
    case EROFS:
      code = StatusCode::kPermissionDenied;
      break;
    case ENOMEM:
      code = StatusCode::kOutOfMemory;
      break;
    case ENOSYS:
    case EOPNOTSUPP:
      code = StatusCode::kUnavailable;
      break;
    case EINVAL:
      code = StatusCode::kInvalidArgument;
      break;
    case ECANCELED:
      code = StatusCode::kCancelled;
      break;
    default:
      break;
  }
  return Status(code, fmt::format("{}: {} (errno {})", what, std::strerror(err), err));
}

namespace detail {
void result_access_failed(const Status& status) {
  strata::detail::check_failed("Result::value() on a failed Result", status.to_string().c_str(), __FILE__,
                               __LINE__);
}
void result_from_ok_status() {
  strata::detail::check_failed("Result constructed from an ok Status", "", __FILE__, __LINE__);
}
}  // namespace detail

}  // namespace strata
