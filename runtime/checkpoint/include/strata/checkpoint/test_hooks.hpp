#pragma once
// Checkpoint test hooks: points where a test injects a failure or a change to a
// file, to show a save or load fails the way a real error would. Not part of the
// library's private header (checkpoint.hpp): the checkpoint files that call a hook
// include this one, and so do the tests (tests/runtime/test_checkpoint.cpp,
// tests/runtime/test_data_parallel_checkpoint.cpp). Each hook is empty in
// production; a test sets it before the runtimes run and clears it after
// (they are process-wide and not synchronised).

#include <functional>
#include <string>

#include "strata/common/status.hpp"
#include "strata/runtime/tensor.hpp"

namespace strata::checkpoint::test_hooks {

using runtime::FamilyId;

//! Runs before a save creates each `<name>.tmp`; an error fails that file as a real
//! one would (test_data_parallel_checkpoint.cpp fails one rank's file).
extern std::function<Status(const std::string& tmp_path)> before_create;
//! Runs on each rank before it copies family f's shards for a save's assembly
//! (assemble_shards); an error fails that rank's copy as a real one would.
extern std::function<Status(int rank, FamilyId f)> before_assemble;
//! Runs once a load has verified every file, before it applies any
//! (test_checkpoint.cpp writes a file there).
extern std::function<void(const std::string& dir)> after_verify;
//! Runs once a one-rank load has applied the host-held values, before it checks the
//! files again and commits the NVMe ones (Note [Load in one read] in load.cpp).
extern std::function<void(const std::string& dir)> after_host_apply;

}  // namespace strata::checkpoint::test_hooks
