// The checkpoint test hooks' definitions (test_hooks.hpp): empty unless a test sets one.
#include "strata/checkpoint/test_hooks.hpp"

namespace strata::checkpoint::test_hooks {

std::function<Status(const std::string& tmp_path)> before_create;
std::function<Status(int rank, FamilyId f)> before_assemble;
std::function<void(const std::string& dir)> after_verify;
std::function<void(const std::string& dir)> after_host_apply;

}  // namespace strata::checkpoint::test_hooks
