// libFuzzer target: the probe's model-shape arguments (--layers --hidden --seq
// --batch --vocab, --params, --verify-params) through shape checks, the shape
// search and the placement estimate (the bisection that once hung on tiny
// layers). The input is 5 little-endian u32 dimensions, a placement byte and
// capacities; libFuzzer's -timeout catches a slow input.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "probe/model.hpp"
#include "probe/runtime_spec.hpp"
#include "strata/common/bytes.hpp"

namespace {

std::uint64_t take(const std::uint8_t*& data, std::size_t& size, std::size_t bytes) {
  std::uint64_t v = 0;
  const std::size_t n = bytes < size ? bytes : size;
  std::memcpy(&v, data, n);
  data += n;
  size -= n;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace strata::probe;
  ModelShape shape;
  shape.layers = take(data, size, 4);
  shape.hidden = take(data, size, 4);
  shape.seq = take(data, size, 4);
  shape.batch = take(data, size, 4);
  shape.vocab = take(data, size, 4);
  const std::uint64_t choice = take(data, size, 1);
  const Placement placement = kPlacements[choice % 5];
  Capacity cap;
  cap.gpu_bytes = take(data, size, 2) * strata::kMiB;
  cap.host_bytes = take(data, size, 2) * 16 * strata::kMiB;
  cap.nvme_bytes = take(data, size, 2) * 256 * strata::kMiB;
  auto params = shape_params(shape);
  if (params.ok()) {
    (void)shape_for_params(*params, shape.seq, shape.batch, shape.vocab);
    (void)shape_for_verify(*params, shape.seq, shape.batch);
    TrainSpec spec;
    spec.shape = shape;
    spec.optimizer = static_cast<strata::kernels::Optimizer>((choice / 5) % 7);
    if (check_supported(spec).ok()) {
      strata::runtime::Rates rates;
      (void)estimate(spec, placement, cap, rates);
    }
  }
  return 0;
}
