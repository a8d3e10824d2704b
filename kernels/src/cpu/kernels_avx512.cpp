// AVX-512 (F/BW/DQ/VL) kernels: the ops over 16-lane vectors. Built with
// -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c; run only when CPUID says so.
// bf16 goes through integer RNE, not AVX512_BF16, so Skylake-X runs it too.
#include "cpu/driver.hpp"
#include "cpu/lanes_avx512.hpp"

namespace strata::kernels {
namespace cpu {

PieceResult run_piece_avx512(Pass pass, const Hyper& h, const Span& s, std::size_t begin, std::size_t end,
                             const PassArgs& pa) {
  return run_piece_with<V16>(pass, h, s, begin, end, pa);
}

}  // namespace cpu
}  // namespace strata::kernels
