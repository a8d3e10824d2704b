#pragma once
// Validation of RuntimeOptions: the one place that says which settings and
// combinations the runtime accepts. Runtime::create calls validate_options()
// first; the facade's Config, the C ABI and the tools (strata-probe,
// strata-example-lm, strata-bench) call the same functions on what they are
// given, so nothing a tool plans or a config names is refused later.
//
// Note [One validation per input kind]
// A config key and a command-line flag that set the same thing go through the
// same check, and its message names the key (or flag), the value, and what is
// allowed. An explicit 0 where 0 means nothing (a budget, a slot count, a
// search bound) is an error, never "use the default". A directory that does not
// exist is an error: strata never creates a directory it was told to use.

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/common/scratch_dir.hpp"
#include "strata/common/status.hpp"
#include "strata/runtime/layout.hpp"
#include "strata/runtime/runtime_options.hpp"

namespace strata::runtime {

//! Bound on prefetch depth, NVMe families in flight and grad staging slots.
inline constexpr std::uint32_t kPlanCountMax = 64;
//! The most NVMe families plan.deferred_updates may defer into the next forward.
inline constexpr std::uint32_t kDeferredUpdatesMax = 4096;
//! Bound on CPU workers.
inline constexpr std::size_t kThreadsMax = 4096;
//! Bound on recorded trace events.
inline constexpr std::size_t kTimelineEventsMax = std::size_t{1} << 24;

//! Checks every setting and combination Runtime::create accepts: dtypes,
//! optimizer (validate_hyper; not CAME; bf16 states only for the Adam family),
//! budgets (gpu and host > 0; gpu holds 3 chunk slots of a fixed chunk size;
//! host reserve below the host budget), the NVMe tier (dirs and budget both or
//! neither; each dir passes validate_nvme_dir; the budget is a cap and may exceed
//! their free space: the plan's NVMe bytes are checked when the tier is made), layout
//! (validate_layout_options), plan knobs, threads and trace bounds. Directories are checked only when no
//! nvme_store is supplied. Touches the file system (stat, statfs, access); never creates or removes anything.
//! Fails with InvalidArgument (or NotFound / PermissionDenied / NoSpace for directories) naming the setting,
//! its value and what is allowed.
Status validate_options(const RuntimeOptions& options);

//! `dir` can hold swap files: it exists (NotFound otherwise; never created), is a
//! directory, is writable and searchable by this process, is not on a read-only
//! mount, and is not on a pseudo file system (proc, sysfs, devpts, cgroup, ...).
//! `setting` names the key or flag in the message ("nvme.dirs", "--nvme").
Status validate_nvme_dir(const std::string& dir, std::string_view setting = "nvme.dirs");

//! Bytes an unprivileged writer may still allocate on the file system of `dir`.
Result<std::uint64_t> free_bytes_of(const std::string& dir);

//! The NVMe directory of one run of a tool (Note [Stable scratch layout] in
//! scratch_dir.hpp): `given` when not empty (checked by validate_nvme_dir as
//! `setting`, never created, borrowed), else the stable `$TMPDIR/<default_name>`
//! (created when missing, removed at the end when empty). Swap files a crashed
//! run left there are reported and reclaimed first (never read), so the run
//! starts clean and leaves nothing when it ends, cleanly or with an error.
Result<ScratchDir> open_tool_nvme_dir(const std::string& given, std::string_view setting,
                                      std::string_view default_name);

}  // namespace strata::runtime
