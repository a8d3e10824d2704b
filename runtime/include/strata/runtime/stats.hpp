#pragma once
// What a Runtime reports (strata/runtime/runtime.hpp): one step's figures
// (StepStats, returned by Runtime::step), the totals since creation (RunStats,
// Runtime::stats) and the hot paths' pool counters (HotPathCounters).

#include <cstdint>
#include <string>

#include "strata/runtime/timeline.hpp"

namespace strata::runtime {

//! What one step did. All byte counts are this step's.
struct StepStats {
  std::uint64_t step = 0;  //!< 1-based index of the step just finished
  bool applied = false;    //!< the optimizer ran (false: skipped for Inf/NaN)
  //! NVMe families whose update this step() left to run during the next forward
  //! (PlanOptions::deferred_updates; Note [Deferred updates] in
  //! runtime/src/pipeline/deferred_updates.cpp). `applied` covers the others.
  std::uint32_t updates_deferred = 0;
  bool followed_plan = false;  //!< the step followed the traced order (prefetch + Belady)
  double step_s = 0.0;         //!< wall time since the previous step() returned
  std::uint64_t bytes_h2d = 0, bytes_d2h = 0, bytes_disk_read = 0, bytes_disk_write = 0;
  //! Of bytes_disk_read: NVMe-homed params read for their forward and backward uses,
  //! and read by the optimizer beside their states (Note [NVMe-homed params] in
  //! runtime/src/residency/residency.hpp); the rest are optimizer states.
  std::uint64_t bytes_disk_read_param_uses = 0, bytes_disk_read_param_updates = 0;
  double stall_s = 0.0;             //!< host time blocked inside acquire()
  double busy_s[kTrackCount] = {};  //!< per track
  std::uint64_t gpu_high_water_bytes = 0;
  std::uint64_t host_high_water_bytes = 0;
  std::uint64_t nvme_bytes = 0;
  //! Gradient bytes the CPU read only to check them for Inf/NaN (and the clipping
  //! norm): 0 when every check ran on the device before the gradient's copy to
  //! host (Note [Gradient check on the device] in runtime/src/pipeline/grad_check.cpp).
  std::uint64_t grad_check_host_bytes = 0;
  std::uint64_t bytes_comm = 0;  //!< sent to other ranks (data parallelism; 0 for one rank)
  double comm_s = 0.0;           //!< blocked in collectives (data parallelism)
  //! Prefetches (reads of a param ahead of its use) that failed since the last
  //! step(), and the first one's error. Not fatal: the use read the param itself;
  //! the next public call returned the error once (Note [Prefetch errors] in
  //! runtime/src/residency/eviction.cpp).
  std::uint64_t prefetch_errors = 0;
  std::string first_prefetch_error;
};

//! How far the pools behind the runtime's hot paths have grown (Note
//! [Allocation-free hot paths] in runtime/src/leases.cpp). Each grows only past
//! its high water, so a steady step adds to none of them: the counters a test
//! checks beside a count of heap allocations (tests/runtime/test_alloc_free.cpp).
struct HotPathCounters {
  std::uint64_t copy_records = 0;  //!< timed copies' completion records created (in flight at once, at most)
  std::uint64_t launch_records = 0;  //!< launch()'s completion records created
  std::uint64_t timeline_spans = 0;  //!< spans recorded; their room is reserved once (timeline_events_max)
  std::uint64_t timeline_spans_dropped = 0;   //!< spans past timeline_events_max, counted, not kept
  std::uint64_t pool_handler_blocks = 0;      //!< the thread pool's operation blocks (Note [Handler memory])
  std::uint64_t pool_handlers_oversized = 0;  //!< posted functions too large for a block (heap)
  std::uint64_t nvme_io_records =
      0;  //!< NVMe pieces' completion records created (in flight at once, at most)
  std::uint64_t nvme_slot_op_records =
      0;  //!< the NVMe store's slot operation records (NvmeStore::io_records)
};

//! Totals since a Runtime was created (per-step figures are in StepStats).
struct RunStats {
  std::uint64_t steps = 0;
  std::uint64_t steps_skipped = 0;  //!< Inf/NaN gradients with loss scaling
  std::uint64_t bytes_h2d = 0, bytes_d2h = 0, bytes_disk_read = 0, bytes_disk_write = 0;
  std::uint64_t bytes_disk_read_param_uses = 0, bytes_disk_read_param_updates = 0;  //!< as in StepStats
  double stall_s = 0.0;  //!< host time blocked inside acquire()
  double step_s = 0.0;   //!< wall time in steps
  std::uint64_t gpu_high_water_bytes = 0, host_high_water_bytes = 0, nvme_bytes = 0;
  std::uint64_t prefetch_errors = 0;  //!< failed reads ahead of use (not fatal: StepStats)
};

}  // namespace strata::runtime
