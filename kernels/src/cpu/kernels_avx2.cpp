// AVX2 + FMA + F16C kernels: the ops over 8-lane vectors. Built with
// -mavx2 -mfma -mf16c (kernels/CMakeLists.txt); run only when CPUID says so.
#include "cpu/driver.hpp"
#include "cpu/lanes_avx2.hpp"

namespace strata::kernels {
namespace cpu {

PieceResult run_piece_avx2(Pass pass, const Hyper& h, const Span& s, std::size_t begin, std::size_t end,
                           const PassArgs& pa) {
  return run_piece_with<V8>(pass, h, s, begin, end, pa);
}

}  // namespace cpu
}  // namespace strata::kernels
