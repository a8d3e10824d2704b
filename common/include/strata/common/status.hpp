#pragma once
// Status and Result<T>: how strata reports expected failures.
//
// Note [Errors in three kinds]
// Expected failures (out of budget, ENOSPC, EIO, no device, bad config) are
// values: a Status or a Result<T> whose message says what failed, which
// path/chunk/budget, and what the user can do about it. Programmer errors are
// assertions (assert.hpp). Exceptions appear only at the C++ API boundary.

#include <fmt/format.h>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace strata {

//! What kind of failure a Status carries. Callers branch on the code; users read the message.
enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,     //!< a setting or argument is malformed or out of range
  kOutOfBudget,         //!< a request exceeds a configured budget
  kOutOfMemory,         //!< the system refused memory (mmap, device allocation)
  kNoSpace,             //!< a disk is full (ENOSPC, EFBIG)
  kIoError,             //!< EIO or another I/O failure
  kCorrupt,             //!< data failed its checksum or a file is not what we wrote
  kNotFound,            //!< a file, tensor or device does not exist
  kPermissionDenied,    //!< the OS refused (EPERM, EACCES, memlock limit)
  kUnavailable,         //!< a facility is missing here (no GPU, no io_uring)
  kFailedPrecondition,  //!< the call is not valid in the current state
  kCancelled,           //!< the operation was cancelled by shutdown
  kInternal,            //!< a bug in strata; the message says where
};

//! Name of a code, e.g. "OutOfBudget". Never fails.
std::string_view status_code_name(StatusCode code);

//! Outcome of an operation: ok, or a code with an actionable message.
//! Cheap to move; copying copies the message. Thread-compatible.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  //! The ok status.
  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  //! "Code: message", or "OK". One line: control characters in the message (a
  //! newline quoted from user input) are escaped as \xNN.
  std::string to_string() const;

  //! Prepends context ("while X: ") to the message; no-op when ok.
  Status& with_context(std::string_view context);

  //! Explicitly ignore a status (e.g. best-effort cleanup in a destructor).
  void ignore() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline bool operator==(const Status& a, StatusCode code) {
  return a.code() == code;
}

//! Writes to_string() (for test failure messages and logs).
std::ostream& operator<<(std::ostream& os, const Status& status);

//! Builds a failed Status with a fmt-formatted message.
template <typename... Args>
Status make_status(StatusCode code, fmt::format_string<Args...> format, Args&&... args) {
  return Status(code, fmt::format(format, std::forward<Args>(args)...));
}

#define STRATA_DEFINE_STATUS_MAKER(Name, Code)                                         \
  template <typename... Args>                                                          \
  Status Name(fmt::format_string<Args...> format, Args&&... args) {                    \
    return Status(StatusCode::Code, fmt::format(format, std::forward<Args>(args)...)); \
  }
STRATA_DEFINE_STATUS_MAKER(invalid_argument, kInvalidArgument)
STRATA_DEFINE_STATUS_MAKER(out_of_budget, kOutOfBudget)
STRATA_DEFINE_STATUS_MAKER(out_of_memory, kOutOfMemory)
STRATA_DEFINE_STATUS_MAKER(no_space, kNoSpace)
STRATA_DEFINE_STATUS_MAKER(io_error, kIoError)
STRATA_DEFINE_STATUS_MAKER(corrupt, kCorrupt)
STRATA_DEFINE_STATUS_MAKER(not_found, kNotFound)
STRATA_DEFINE_STATUS_MAKER(permission_denied, kPermissionDenied)
STRATA_DEFINE_STATUS_MAKER(unavailable, kUnavailable)
STRATA_DEFINE_STATUS_MAKER(failed_precondition, kFailedPrecondition)
STRATA_DEFINE_STATUS_MAKER(cancelled, kCancelled)
STRATA_DEFINE_STATUS_MAKER(internal_error, kInternal)
#undef STRATA_DEFINE_STATUS_MAKER

//! Status from an errno value: ENOSPC/EFBIG -> NoSpace, ENOENT -> NotFound,
//! EACCES/EPERM -> PermissionDenied, ENOMEM -> OutOfMemory, ENOSYS -> Unavailable,
//! else IoError. The message is "<what>: <strerror> (errno N)".
Status errno_status(int err, std::string_view what);

//! A value or a failed Status. Accessing the value of a failed Result is a
//! programmer error (checked always).
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<T, Status>, "Result<Status> makes no sense");

 public:
  Result(T value) : storage_(std::in_place_index<0>, std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : storage_(std::in_place_index<1>, std::move(status)) {  // NOLINT
    check_not_ok();
  }

  bool ok() const { return storage_.index() == 0; }
  //! The failure; Status::Ok() when this holds a value.
  Status status() const { return ok() ? Status::Ok() : std::get<1>(storage_); }

  T& value() & {
    check_ok();
    return std::get<0>(storage_);
  }
  const T& value() const& {
    check_ok();
    return std::get<0>(storage_);
  }
  T&& value() && {
    check_ok();
    return std::get<0>(std::move(storage_));
  }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void check_ok() const;
  void check_not_ok() const;
  std::variant<T, Status> storage_;
};

namespace detail {
[[noreturn]] void result_access_failed(const Status& status);
[[noreturn]] void result_from_ok_status();
}  // namespace detail

template <typename T>
void Result<T>::check_ok() const {
  if (!ok()) detail::result_access_failed(std::get<1>(storage_));
}
template <typename T>
void Result<T>::check_not_ok() const {
  if (std::get<1>(storage_).ok()) detail::result_from_ok_status();
}

}  // namespace strata

#define STRATA_CONCAT_INNER(a, b) a##b
#define STRATA_CONCAT(a, b) STRATA_CONCAT_INNER(a, b)

//! Returns the Status of `expr` from the enclosing function when it failed.
#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::strata::Status strata_status_ = (expr);        \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

//! `lhs = value of expr`, or returns its Status from the enclosing function.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL(STRATA_CONCAT(strata_result_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

template <>
struct fmt::formatter<strata::Status> : fmt::formatter<std::string> {
  auto format(const strata::Status& s, fmt::format_context& ctx) const {
    return fmt::formatter<std::string>::format(s.to_string(), ctx);
  }
};
