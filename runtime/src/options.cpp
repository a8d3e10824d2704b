// validate_options: every check Runtime::create applies to its options (Note
// [One validation per input kind] in options.hpp).
#include "strata/runtime/options.hpp"

#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <set>

#include "strata/comm/caps.hpp"
#include "strata/common/bytes.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/offload/swap_store.hpp"

namespace strata::runtime {
namespace {

// File systems that are views of the kernel, not storage: a swap file there is
// refused by the kernel or, worse, lands in memory.
struct PseudoFs {
  long magic;
  const char* name;
};
constexpr PseudoFs kPseudoFs[] = {
    {0x9fa0, "proc"},         {0x62656572, "sysfs"},
    {0x1cd1, "devpts"},       {0x27e0eb, "cgroup"},
    {0x63677270, "cgroup2"},  {0x64626720, "debugfs"},
    {0x74726163, "tracefs"},  {0x73636673, "securityfs"},
    {0xcafe4a11, "bpf"},      {0x42494e4d, "binfmt_misc"},
    {0x6e736673, "nsfs"},     {0x50495045, "pipefs"},
    {0x534f434b, "sockfs"},   {0xf97cff8c, "selinuxfs"},
    {0x43415d53, "smackfs"},  {0x6165676c, "pstorefs"},
    {0xde5e81e4, "efivarfs"}, {0x1373, "devfs"},
};

Status validate_nvme(const RuntimeOptions& o) {
  if (o.nvme_store != nullptr) return Status::Ok();  // supplied by the embedder
  if (!o.nvme_dirs.empty() && o.budgets.nvme_bytes == 0) {
    return invalid_argument(
        "nvme_dirs is set but budgets.nvme = 0: give the NVMe tier a budget (e.g. \"16GiB\")");
  }
  if (o.nvme_dirs.empty() && o.budgets.nvme_bytes > 0) {
    return invalid_argument(
        "budgets.nvme = {} but no nvme_dirs: name at least one directory for the NVMe tier",
        format_bytes(o.budgets.nvme_bytes));
  }
  if (o.nvme_dirs.empty()) return Status::Ok();
  if (o.nvme_dirs.size() > 16) {
    return invalid_argument("nvme.dirs lists {} directories: at most 16 (one per drive)", o.nvme_dirs.size());
  }
  // No free-space check here: budgets.nvme is a cap, not a size. What the plan
  // puts on NVMe is checked against free space when the NVMe tier is created
  // (Note [Growing swap files] in offload/src/swap_store.cpp).
  std::set<std::filesystem::path> seen;
  for (const std::string& dir : o.nvme_dirs) {
    STRATA_RETURN_IF_ERROR(validate_nvme_dir(dir));
    std::error_code ec;
    if (!seen.insert(std::filesystem::weakly_canonical(dir, ec)).second) {
      return invalid_argument("nvme.dirs lists {} twice: list each directory once", dir);
    }
  }
  return Status::Ok();
}

Status validate_plan(const RuntimeOptions& o) {
  const PlanOptions& p = o.plan;
  const std::pair<const char*, std::uint32_t> counts[] = {
      {"plan.nvme_families_in_flight", p.nvme_families_in_flight},
      {"plan.grad_staging_slots", p.grad_staging_slots},
  };
  for (const auto& [name, value] : counts) {
    if (value == 0 || value > kPlanCountMax)
      return invalid_argument("{} = {}: use 1 .. {}", name, value, kPlanCountMax);
  }
  if (p.prefetch && (p.prefetch_depth_max == 0 || p.prefetch_depth_max > kPlanCountMax)) {
    return invalid_argument(
        "plan.prefetch_depth_max = {}: use 1 .. {} (or plan.prefetch = false for no lookahead)",
        p.prefetch_depth_max, kPlanCountMax);
  }
  if (p.micro_batches == 0 || p.micro_batches > (1u << 20)) {
    return invalid_argument("plan.micro_batches = {}: use 1 .. {} (backward passes per step)",
                            p.micro_batches, 1u << 20);
  }
  if (p.deferred_updates > kDeferredUpdatesMax) {
    return invalid_argument(
        "plan.deferred_updates = {}: use 0 .. {} (NVMe families whose update runs in the next forward)",
        p.deferred_updates, kDeferredUpdatesMax);
  }
  if (p.host_reserve_bytes >= o.budgets.host_bytes) {
    return invalid_argument("plan.host_reserve = {} must be below budgets.host = {}",
                            format_bytes(p.host_reserve_bytes), format_bytes(o.budgets.host_bytes));
  }
  return Status::Ok();
}

//! The checks for state_dtype q8 (Note [Q8 state chunks] in
//! runtime/src/pipeline/q8_states.cpp): the optimizer, a fixed chunk size. Ok for
//! any other state dtype.
Status validate_q8_options(const RuntimeOptions& o) {
  if (o.state_dtype != DType::kQ8) return Status::Ok();
  const kernels::Optimizer opt = o.hyper.optimizer;
  if (opt != kernels::Optimizer::kAdam && opt != kernels::Optimizer::kAdamW) {
    return invalid_argument(
        "optimizer {} has no 8-bit state rule; use precision.states (state_dtype) fp32 or bf16, or optimizer "
        "adamw or adam",
        kernels::optimizer_name(opt));
  }
  if (o.layout.chunk_elems % kQ8BlockElems != 0) {
    return invalid_argument(
        "layout.chunk_elems = {} with precision.states q8: a chunk must hold whole {}-element scale blocks; "
        "use a multiple of {} (or 0 to search)",
        o.layout.chunk_elems, kQ8BlockElems, kQ8BlockElems);
  }
  return Status::Ok();
}

}  // namespace

Status validate_nvme_dir(const std::string& dir, std::string_view setting) {
  if (dir.empty()) return invalid_argument("{}: an empty directory name", setting);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return not_found("{} = {}: no such directory; create it (strata never does) or name another", setting,
                       dir);
    }
    return errno_status(err, fmt::format("{} = {}", setting, dir));
  }
  if (!S_ISDIR(st.st_mode))
    return invalid_argument("{} = {}: not a directory; name a directory", setting, dir);
  struct statfs fs {};
  if (::statfs(dir.c_str(), &fs) != 0)
    return errno_status(errno, fmt::format("{} = {}: statfs", setting, dir));
  for (const PseudoFs& p : kPseudoFs) {
    if (static_cast<long>(fs.f_type) == p.magic) {
      return invalid_argument(
          "{} = {}: on the {} pseudo file system, which holds no files; name a directory on a "
          "drive",
          setting, dir, p.name);
    }
  }
  if ((fs.f_flags & ST_RDONLY) != 0) {
    return permission_denied("{} = {}: the file system is mounted read-only; name a writable directory",
                             setting, dir);
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return permission_denied(
        "{} = {}: not writable by this process (uid {}); fix its permissions or name another", setting, dir,
        ::getuid());
  }
  return Status::Ok();
}

Result<std::uint64_t> free_bytes_of(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return errno_status(errno, fmt::format("statvfs of {}", dir));
  return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

Status validate_options(const RuntimeOptions& o) {
  if (o.compute_dtype != DType::kF32 && o.compute_dtype != DType::kBF16 && o.compute_dtype != DType::kF16) {
    return invalid_argument("runtime compute_dtype {} must be fp32, bf16 or fp16",
                            runtime::dtype_name(o.compute_dtype));
  }
  if (o.budgets.gpu_bytes == 0) {
    return invalid_argument("budgets.gpu = 0: the runtime needs device memory for at least 3 chunk slots");
  }
  if (o.budgets.host_bytes == 0)
    return invalid_argument("budgets.host = 0: the runtime needs host memory for params");
  if (o.hyper.optimizer == kernels::Optimizer::kCame) {
    return invalid_argument(
        "optimizer came: CAME's factored moments need whole 2-D tensors, which the chunk runtime does not "
        "hand its kernels yet; use adamw, lamb, lars, sgd, lion, adagrad or adam (kernels::came_step runs "
        "CAME alone)");
  }
  STRATA_RETURN_IF_ERROR(kernels::validate_hyper(o.hyper));
  const bool adam_family = o.hyper.optimizer == kernels::Optimizer::kAdam ||
                           o.hyper.optimizer == kernels::Optimizer::kAdamW ||
                           o.hyper.optimizer == kernels::Optimizer::kLamb;
  if (o.state_dtype == kernels::DType::kBF16 && !adam_family) {
    return invalid_argument("state_dtype bf16 is supported for adam, adamw and lamb only (optimizer {})",
                            kernels::optimizer_name(o.hyper.optimizer));
  }
  if (o.state_dtype != kernels::DType::kF32 && o.state_dtype != kernels::DType::kBF16 &&
      o.state_dtype != kernels::DType::kQ8) {
    return invalid_argument("state_dtype {} must be fp32, bf16 or q8 (q8: adam and adamw only)",
                            kernels::dtype_name(o.state_dtype));
  }
  STRATA_RETURN_IF_ERROR(validate_q8_options(o));
  if (o.io_engine != "auto" && o.io_engine != "uring" && o.io_engine != "posix") {
    return invalid_argument("io_engine = \"{}\": use auto, uring or posix", o.io_engine);
  }
  if (o.comm != nullptr && !comm::rank_ordered_sum(*o.comm) && o.comm->options().deterministic) {
    return invalid_argument(
        "comm: the nccl backend has no rank-ordered sum, so it cannot run deterministic mode (Note "
        "[Deterministic reduction]); set CommOptions::deterministic = false, or use the mpi or local backend "
        "for bit-identical runs");
  }
  if (!std::isfinite(o.clip_max_norm) || o.clip_max_norm < 0) {
    return invalid_argument("clip_max_norm = {} must be finite and >= 0 (0 = off)", o.clip_max_norm);
  }
  if (o.threads > kThreadsMax) {
    return invalid_argument("threads = {}: at most {} (0 = one per core)", o.threads, kThreadsMax);
  }
  if (o.timeline_events_max == 0 || o.timeline_events_max > kTimelineEventsMax) {
    return invalid_argument("timeline_events_max = {}: use 1 .. {}", o.timeline_events_max,
                            kTimelineEventsMax);
  }
  STRATA_RETURN_IF_ERROR(validate_layout_options(o.layout));
  if (o.layout.chunk_elems != 0) {
    // A fixed chunk size: the device must hold 3 chunk slots (current param and
    // grad, next param) or no step can run.
    const std::uint64_t slot_bytes = o.layout.chunk_elems * dtype_bytes(o.compute_dtype);
    if (o.budgets.gpu_bytes / 3 < slot_bytes) {
      return invalid_argument(
          "budgets.gpu = {} holds fewer than 3 chunk slots of layout.chunk_elems = {} ({} each): raise "
          "budgets.gpu to at least {} or lower layout.chunk_elems (more if a tensor is larger than a chunk: "
          "it gets a chunk of its own, and the plan, made once tensors are registered, names the size)",
          format_bytes(o.budgets.gpu_bytes), o.layout.chunk_elems, format_bytes(slot_bytes),
          format_bytes(3 * slot_bytes));
    }
  }
  STRATA_RETURN_IF_ERROR(validate_plan(o));
  return validate_nvme(o);
}

Result<ScratchDir> open_tool_nvme_dir(const std::string& given, std::string_view setting,
                                      std::string_view default_name) {
  ScratchDir dir;
  if (!given.empty()) {
    STRATA_RETURN_IF_ERROR(validate_nvme_dir(given, setting));
    dir = ScratchDir::borrow(given);
  } else {
    std::error_code ec;
    const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
    if (ec) return errno_status(ec.value(), fmt::format("{}: no temp directory ($TMPDIR)", setting));
    STRATA_ASSIGN_OR_RETURN(dir, ScratchDir::create(tmp, default_name));
    STRATA_RETURN_IF_ERROR(validate_nvme_dir(dir.path().string(), setting));
  }
  STRATA_RETURN_IF_ERROR(offload::reclaim_stale_swap_files(dir.path()));
  return dir;
}

}  // namespace strata::runtime
