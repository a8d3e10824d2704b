#include "strata/common/status.hpp"

#include <cerrno>
#include <cstring>
#include <iterator>
#include <ostream>

#include "strata/common/assert.hpp"
#include "strata/common/status_names.hpp"

namespace strata {

namespace {

// The one table of code names (status_names.hpp): one row per StatusCode, in its
// numeric order (checked in status_code_from_int's test).
struct CodeNames {
  StatusCode code;
  std::string_view name;  //!< CamelCase: messages, logs
  std::string_view id;    //!< snake_case: the C ABI
};
constexpr CodeNames kCodeNames[] = {
    {StatusCode::kOk, "OK", "ok"},
    {StatusCode::kInvalidArgument, "InvalidArgument", "invalid_argument"},
    {StatusCode::kOutOfBudget, "OutOfBudget", "out_of_budget"},
    {StatusCode::kOutOfMemory, "OutOfMemory", "out_of_memory"},
    {StatusCode::kNoSpace, "NoSpace", "no_space"},
    {StatusCode::kIoError, "IoError", "io_error"},
    {StatusCode::kCorrupt, "Corrupt", "corrupt"},
    {StatusCode::kNotFound, "NotFound", "not_found"},
    {StatusCode::kPermissionDenied, "PermissionDenied", "permission_denied"},
    {StatusCode::kUnavailable, "Unavailable", "unavailable"},
    {StatusCode::kFailedPrecondition, "FailedPrecondition", "failed_precondition"},
    {StatusCode::kCancelled, "Cancelled", "cancelled"},
    {StatusCode::kInternal, "Internal", "internal"},
};
constexpr bool rows_in_order() {
  for (std::size_t i = 0; i < std::size(kCodeNames); ++i) {
    if (static_cast<std::size_t>(kCodeNames[i].code) != i) return false;
  }
  return static_cast<std::size_t>(StatusCode::kInternal) + 1 == std::size(kCodeNames);
}
static_assert(rows_in_order(), "kCodeNames: one row per StatusCode, in numeric order");

const CodeNames* row(StatusCode code) {
  const auto i = static_cast<std::size_t>(code);
  return i < std::size(kCodeNames) ? &kCodeNames[i] : nullptr;
}

}  // namespace

std::string_view status_code_name(StatusCode code) {
  const CodeNames* r = row(code);
  return r != nullptr ? r->name : "Unknown";
}

std::string_view status_code_id(StatusCode code) {
  const CodeNames* r = row(code);
  return r != nullptr ? r->id : "unknown";
}

std::optional<StatusCode> status_code_from_int(int value) {
  if (value < 0 || static_cast<std::size_t>(value) >= std::size(kCodeNames)) return std::nullopt;
  return kCodeNames[value].code;
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
