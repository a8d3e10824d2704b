// The memory-only kernel, one 32-bit lane at a time, built with the flags of
// kernels' scalar file (Note [Memory-only roofline]).
#include "roofline/mem_kernel.hpp"
#include "roofline/mem_kernel_fns.hpp"

namespace strata::bench::roofline {

bool mem_piece_scalar(const MemPass& m, MemVariant variant, std::size_t begin, std::size_t end,
                      std::uint32_t zero, std::uint64_t* sink) {
  return mem_piece<Scalar, Scalar>(m, variant, begin, end, zero, sink);
}

void triad_piece_scalar(float* a, const float* b, const float* c, float s, std::size_t begin,
                        std::size_t end) {
  triad_loop(a, b, c, s, begin, end);
}

}  // namespace strata::bench::roofline
