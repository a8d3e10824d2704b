// Scalar CPU kernels: the ops over float, one element at a time. Always built,
// always runnable; the fallback when CPUID offers neither AVX2 nor AVX-512.
#include "cpu/driver.hpp"

namespace strata::kernels::cpu {

PieceResult run_piece_scalar(Pass pass, const Hyper& h, const Span& s, std::size_t begin, std::size_t end,
                             const PassArgs& pa) {
  return run_piece_with<float>(pass, h, s, begin, end, pa);
}

}  // namespace strata::kernels::cpu
