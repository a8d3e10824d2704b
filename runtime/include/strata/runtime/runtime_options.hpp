#pragma once
// RuntimeOptions: the settings of a Runtime (strata/runtime/runtime.hpp), which
// validate_options (strata/runtime/options.hpp) checks. Below Runtime so that the
// runtime's parts and the validation take them without Runtime's own header.

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "strata/comm/communicator.hpp"
#include "strata/kernels/dtype.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/runtime/layout.hpp"
#include "strata/runtime/planner.hpp"
#include "strata/runtime/stores.hpp"
#include "strata/runtime/tensor.hpp"

namespace strata::runtime {

//! Settings of a Runtime. Validated by Runtime::create.
struct RuntimeOptions {
  DType compute_dtype = DType::kF32;                  //!< dtype of params and grads (every tensor's)
  kernels::Hyper hyper;                               //!< optimizer and hyperparameters (not CAME: see docs)
  kernels::DType state_dtype = kernels::DType::kF32;  //!< optimizer states (bf16 for the Adam family)
  double clip_max_norm = 0.0;          //!< global grad-norm clipping; 0 = off (forces deferral)
  bool loss_scaling = false;           //!< Inf/NaN skips the step (Note [Step semantics])
  Budgets budgets;                     //!< hard limits per tier (gpu = bytes for chunks on the device)
  std::vector<std::string> nvme_dirs;  //!< NVMe tier directories; empty = none
  std::string io_engine = "auto";      //!< auto, uring or posix
  LayoutOptions layout;
  PlanOptions plan;
  std::size_t threads = 0;  //!< CPU workers; 0 = hardware concurrency
  std::size_t timeline_events_max = 1u << 18;
  //! Tests and embedders may supply their own tiers (e.g. fault-injecting); null = built from the options.
  std::shared_ptr<HostStore> host_store;
  std::shared_ptr<NvmeStore> nvme_store;
  //! Data parallelism: this rank's end of a group of W ranks; null = one rank.
  //! Every rank registers the same tensors with the same options (checked at the
  //! first acquire/init/step) and hands over every trainable gradient each step
  //! (Note [Sharded step] in runtime/src/dp/data_parallel.cpp).
  std::shared_ptr<comm::Communicator> comm;
};

}  // namespace strata::runtime
