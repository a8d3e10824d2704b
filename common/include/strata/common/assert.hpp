#pragma once
// Assertions for programmer errors (see Note [Errors in three kinds] in status.hpp).
//
//   STRATA_CHECK(cond)   always on; aborts with the condition, location and message.
//   STRATA_ASSERT(cond)  on in checked builds (STRATA_CHECKED, Debug, sanitizers); compiled
//                        out otherwise, so it may sit on hot paths.
// One condition per assertion (TigerBeetle): `STRATA_ASSERT(a); STRATA_ASSERT(b);`
// says which one failed.

namespace strata::detail {
//! Prints "strata: check failed: <expr> (<message>) at file:line" and aborts.
[[noreturn]] void check_failed(const char* expr, const char* message, const char* file, int line);
}  // namespace strata::detail

#define STRATA_CHECK(cond)                                           \
  do {                                                               \
    if (!(cond)) [[unlikely]]                                        \
      ::strata::detail::check_failed(#cond, "", __FILE__, __LINE__); \
  } while (0)

#define STRATA_CHECK_MSG(cond, msg)                                     \
  do {                                                                  \
    if (!(cond)) [[unlikely]]                                           \
      ::strata::detail::check_failed(#cond, (msg), __FILE__, __LINE__); \
  } while (0)

#if defined(STRATA_CHECKED) && STRATA_CHECKED
#define STRATA_ASSERT(cond) STRATA_CHECK(cond)
#define STRATA_ASSERT_MSG(cond, msg) STRATA_CHECK_MSG(cond, msg)
#define STRATA_CHECKED_BUILD 1
#else
#define STRATA_ASSERT(cond) ((void)sizeof(!(cond)))
#define STRATA_ASSERT_MSG(cond, msg) ((void)sizeof(!(cond)))
#define STRATA_CHECKED_BUILD 0
#endif

#define STRATA_UNREACHABLE() ::strata::detail::check_failed("unreachable", "", __FILE__, __LINE__)
