#pragma once
// The MLP the NVMe tests train (test_nvme_params.cpp, test_deferred_updates.cpp): its
// sizes and the options that put its params and optimizer states on NVMe.
#include <cstdint>
#include <filesystem>

#include "strata/common/bytes.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime::testing::nvme_mlp {

// 8 layers of width 128: one family per layer, 80 KiB fp32 chunks (as test_runtime.cpp).
constexpr std::size_t kLayers = 8;
constexpr std::size_t kWidth = 128;
constexpr std::uint64_t kChunkElems = 20480;
constexpr std::uint64_t kChunkBytes = kChunkElems * 4;
// Host bytes the plan needs before any home when params spill (Note [Host room] in
// runtime/plan/planner.cpp): one grad landing slot, host copies of one gradient per
// streaming slot (6: 2 + 2 x prefetch depth 2), one NVMe chunk's temporary copy
// (counted as a family's states: 2 chunks), 4 param staging buffers (prefetch
// depth 2 + 2) and one NVMe family in flight (two fp32 Adam states and the param).
constexpr std::uint64_t kStagingBytes = (1 + 6 + 2 + 4 + 3) * kChunkBytes;
constexpr std::uint64_t kGpuBytes = kLayers * kChunkBytes;  // a quarter of the model state

inline RuntimeOptions base_options() {
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-3f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = kChunkElems;
  o.threads = 2;
  o.plan.prefetch_depth_max = 2;
  o.plan.nvme_families_in_flight = 1;
  o.plan.grad_staging_slots = 1;
  return o;
}

// Everything on host (the GPU streams params and grads).
inline RuntimeOptions on_host() {
  RuntimeOptions o = base_options();
  o.budgets = {.gpu_bytes = kGpuBytes, .host_bytes = 64 * kMiB};
  return o;
}

// Host room for the staging and `host_params` params: the rest of the params, and
// every optimizer state, live on NVMe.
inline RuntimeOptions nvme_params(const std::filesystem::path& dir, std::uint64_t host_params) {
  RuntimeOptions o = base_options();
  o.budgets = {.gpu_bytes = kGpuBytes,
               .host_bytes = kStagingBytes + host_params * kChunkBytes + kChunkBytes / 2,
               .nvme_bytes = 32 * kMiB};
  o.nvme_dirs = {dir.string()};
  return o;
}

}  // namespace strata::runtime::testing::nvme_mlp
