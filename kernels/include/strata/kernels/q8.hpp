#pragma once
// 8-bit AdamW/Adam states (issue #49): m and v stored as one byte per element,
// an index into a 256-entry dynamic quantization map, with one fp32 absmax
// scale per block of kQ8BlockElems elements; the fp32 master is kept.
//
// Note [Dynamic quantization maps]
// The maps are bitsandbytes' create_dynamic_map(signed, max_exponent_bits = 7,
// total_bits = 8) (bitsandbytes/functional.py; torchao's optim/quant_utils.py
// copies it for its 8-bit optimizers): for i in 0..6, the midpoints of
// linspace(0.1, 1, f_i) scaled by 10^(i - 6), where f_i = 2^i + 1 (signed:
// each midpoint also negated) or 2^(i+1) + 1 (unsigned); then 0 and 1.0;
// sorted. So both hold 254 such values plus 0 and 1: the signed map runs from
// -0.99297 to 1.0 (bitsandbytes has no -1), the unsigned from 0 to 1.0.
// bitsandbytes builds them in fp32 torch ops; here each entry is computed in
// double and rounded once to float, which can differ from torch's in the last
// bit of some entries (not checked against torch: no fixture). m uses the
// signed map, v the unsigned one, as in bitsandbytes' 8-bit Adam and torchao.
//
// Note [Q8 step]
// Per block: codes -> map[code] * scale (dequantized in the same pass over memory,
// through a block buffer in L1: Note [Q8 passes over a block]), the Adam
// rule of rules/adam.hpp on fp32 values, a new scale = max |x| over the block,
// codes re-chosen as the nearest map entry of x * (1 / scale) (scale 0: the
// code of 0). Nearest is defined by the 255 midpoints t[k] = (map[k] +
// map[k+1]) / 2 in float: code = the number of t[k] < x (a tie goes to the
// lower code), found by a bucket of x's bits, one table entry and one integer
// compare (Note [Q8 nearest-code search] in kernels/src/q8_search.hpp), the same
// integer ops and comparison on every ISA. The rule's a*b+c is unfused on every ISA here (the fp32 step fuses
// it on AVX2/AVX-512; the q8 files are built with -ffp-contract=off so that GCC does not fuse it either), so
// scalar, AVX2 and AVX-512 give the same bits as a plain C++ reference: every operation is a correctly
// rounded IEEE op or an exact max/compare, in the same order on every lane. Blocks start at each span's
// element 0 and are independent, so results do not depend on the thread count.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "strata/kernels/optim.hpp"
#include "strata/kernels/q8_span.hpp"

namespace strata::kernels {

//! The signed dynamic map (for m), sorted ascending (Note [Dynamic quantization maps]).
//! Computed once on first use; thread-safe.
const std::array<float, 256>& q8_signed_map();
//! The unsigned dynamic map (for v), sorted ascending.
const std::array<float, 256>& q8_unsigned_map();

//! One q8 call's work: as StepArgs, with Q8Spans.
struct Q8StepArgs {
  Hyper hyper;  //!< kAdam or kAdamW
  std::int64_t step = 1;
  float grad_scale = 1.0f;
  std::span<const Q8Span> spans;
  ThreadPool* pool = nullptr;
  std::optional<Isa> isa;
  GradCheck check = GradCheck::kSeparatePass;
  const GradStats* checked = nullptr;  //!< required with kCallerChecked
};

//! One Adam/AdamW step on 8-bit states (Note [Q8 step]). Checks the gradients
//! first (Note [Inf/NaN and untouched states]): on Inf/NaN writes nothing and
//! returns grads_finite = false. Zeroed codes are not a zero state (the code of 0
//! is not 0 in either map): start from q8_zero_states(). Blocks until done.
//! Fails: InvalidArgument (hyperparameters, optimizer not Adam/AdamW, missing
//! pointers, dtypes), Unavailable (forced isa not supported), FailedPrecondition
//! (kCallerChecked but a gradient was non-finite in the fused pass).
Result<StepReport> step_q8(const Q8StepArgs& args);

//! Sets a span's states to zero: codes of 0.0, scales 0. Pure memory writes.
void q8_zero_states(const Q8Span& span);

//! Which map a state's codes index: the signed one (m) or the unsigned one (v).
enum class Q8Map : std::uint8_t { kSigned, kUnsigned };

//! Quantizes values.size() fp32 values as step_q8 requantizes a state (Note [Q8
//! step]): blocks of kQ8BlockElems from element 0 (the last may be partial), each
//! block's scale the max |x| over it, each code the nearest map entry of
//! x * (1 / scale) (ties to the lower code; scale 0: the code of 0). Writes
//! values.size() codes and q8_blocks(values.size()) scales. Fails
//! (InvalidArgument, writing nothing) on a non-finite value, or a negative one
//! for the unsigned map, naming its index. Thread-safe; allocates nothing.
Status q8_quantize(std::span<const float> values, Q8Map map, std::uint8_t* codes, float* scales);

//! The values a state's codes stand for: map[code] * scale of its block (blocks
//! of kQ8BlockElems from element 0), into out (out.size() elements). Never fails.
void q8_dequantize(const std::uint8_t* codes, const float* scales, Q8Map map, std::span<float> out);

}  // namespace strata::kernels
