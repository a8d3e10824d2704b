// The q8 Adam kernel one element at a time (Note [Q8 step] in q8.hpp): the
// definition the vector kernels match bit for bit. Built with -ffp-contract=off
// so that no build flags (-march=native) turn its a * b + c into an FMA.
#include "cpu/q8_driver.hpp"

namespace strata::kernels::cpu {

bool q8_piece_scalar(const Q8Span& s, std::size_t begin, std::size_t end, const AdamCoeffs& c,
                     float grad_scale, const Q8Tables& tab) {
  return q8_piece_with<float>(s, begin, end, c, grad_scale, tab);
}

}  // namespace strata::kernels::cpu
