// q8_quantize and q8_dequantize (q8.hpp): a state's values to codes and block
// scales and back, outside the step, for what reads or writes a whole state
// (the runtime's read_tensor/write_tensor, a checkpoint converting between fp32
// and q8 states). The same rounding as step_q8's requantization (Note [Q8 step]),
// written plainly: a binary search of the midpoints stands for the kernels'
// bucketed search (Note [Q8 nearest-code search]); both count the midpoints
// below x, so they give the same code.
#include <algorithm>
#include <array>
#include <cmath>

#include "strata/kernels/q8.hpp"

namespace strata::kernels {
namespace {

//! The 255 midpoints t[k] = (map[k] + map[k+1]) / 2 in float, as the kernels'.
struct Midpoints {
  std::array<float, 255> t{};
  std::uint8_t zero = 0;  //!< the code of 0.0
};

Midpoints make_midpoints(const std::array<float, 256>& map) {
  Midpoints m;
  for (std::size_t k = 0; k < 255; ++k) m.t[k] = (map[k] + map[k + 1]) / 2.0f;
  m.zero = static_cast<std::uint8_t>(std::find(map.begin(), map.end(), 0.0f) - map.begin());
  return m;
}

const Midpoints& midpoints(Q8Map map) {
  static const Midpoints s = make_midpoints(q8_signed_map());
  static const Midpoints u = make_midpoints(q8_unsigned_map());
  return map == Q8Map::kSigned ? s : u;
}

}  // namespace

Status q8_quantize(std::span<const float> values, Q8Map map, std::uint8_t* codes, float* scales) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || (map == Q8Map::kUnsigned && values[i] < 0.0f)) {
      return invalid_argument(
          "q8_quantize: value {} at index {} cannot be an 8-bit {} state (finite values{} only)", values[i],
          i, map == Q8Map::kSigned ? "signed (first moment)" : "unsigned (second moment)",
          map == Q8Map::kSigned ? "" : " >= 0");
    }
  }
  const Midpoints& m = midpoints(map);
  for (std::size_t b = 0; b * kQ8BlockElems < values.size(); ++b) {
    const std::size_t begin = b * kQ8BlockElems;
    const std::size_t end = std::min(values.size(), begin + kQ8BlockElems);
    float scale = 0.0f;
    for (std::size_t i = begin; i < end; ++i) scale = std::max(scale, std::fabs(values[i]));
    scales[b] = scale;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (std::size_t i = begin; i < end; ++i) {
      const float x = values[i] * inv;
      codes[i] = static_cast<std::uint8_t>(std::lower_bound(m.t.begin(), m.t.end(), x) - m.t.begin());
    }
  }
  return Status::Ok();
}

void q8_dequantize(const std::uint8_t* codes, const float* scales, Q8Map map, std::span<float> out) {
  const std::array<float, 256>& table = map == Q8Map::kSigned ? q8_signed_map() : q8_unsigned_map();
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = table[codes[i]] * scales[i / kQ8BlockElems];
}

}  // namespace strata::kernels
