// 8-bit optimizer states in the chunk runtime (q8_states.hpp).
//
// Note [Q8 state chunks]
// With state_dtype q8 (issue #49) a family's master stays fp32 and its two Adam
// states, m (state0) and v (state1), are each one chunk of C codes, one byte per
// element at the element's offset like every other kind (Note [Chunk layout]),
// followed by C / 256 fp32 absmax scales, one per block of kQ8BlockElems
// elements (state_chunk_bytes; the chunk then rounds up to 4 KiB as any other).
//
// Blocks start at each tensor's element 0, as in bitsandbytes' and torchao's
// 8-bit optimizers, which quantize each parameter alone. So the layout puts every
// tensor's offset and every chunk size on a multiple of 256 elements
// (q8_layout_options in runtime.cpp; up to 255 elements of padding after each tensor), tensor
// t's block j is block offset(t) / 256 + j of its chunks, and each tensor gets one
// kernel span of its numel: its last block may be partial, and its scale covers
// only the tensor's own elements, never the padding or a neighbour. The scales of
// padding blocks are never read.
//
// The reference a plain-torch implementation must equal bit for bit: for each
// parameter separately, flattened, blocks of 256 from element 0 (the last one
// shorter); state starts as torch.zeros codes (uint8) and zero scales — the zero
// state of bitsandbytes and torchao, which dequantizes to m = -0.0 (signed map[0]
// x 0) and v = 0 — and each step is Note [Q8 step] in kernels/q8.hpp on that
// parameter's blocks: dequantize map[code] * scale, the unfused Adam/AdamW rule in
// fp32, new scale = max |x| over the block, code = the number of map midpoints
// below x * (1 / scale). Blocks are independent and step_q8 splits work on whole
// blocks from each span's start (Note [Deterministic threading]), so results do
// not depend on the thread count or on the tier the states live on: host and
// NVMe families run the same CPU kernel over the same bytes (the sim device's
// GPU tier too: its kernel is the CPU's).
//
// Checkpoints save the codes and scales as they are and convert from and to fp32
// and bf16 states on load (Note [Q8 checkpoints] in runtime/checkpoint/q8_states.cpp).
//
// Data parallelism (Note [Sharded step]): with q8 states a shard is whole blocks
// (shard_align_elems: capacities are multiples of W x 256), so, tensors starting on
// a block, every part of a tensor a rank updates starts on one of the tensor's
// blocks, and a rank's state chunk is its shard's codes then its shard's scales. A
// checkpoint save gathers the W shards and lays them out again as the whole chunk's
// codes then scales (regroup_q8_shards in runtime/checkpoint/shards.cpp).
//
// Not served, and refused: optimizers without an 8-bit rule (only adam and adamw
// have one); a fixed layout.chunk_elems that is not whole blocks; leases on state0/state1 (codes
// are not values: read_tensor dequantizes, write_tensor quantizes); the CUDA
// optimizer, which has no q8 kernel yet: on a CUDA device the plan keeps q8 states
// on host and NVMe (plan_adoption.cpp), where the CPU kernel runs.
#include "pipeline/q8_states.hpp"

#include "strata/common/assert.hpp"

namespace strata::runtime {

kernels::Q8Span q8_span(const kernels::Span& s, std::uint64_t at, const Q8Chunk& m, const Q8Chunk& v) {
  STRATA_CHECK(at % kernels::kQ8BlockElems == 0);  // Note [Q8 state chunks]: a tensor starts on a block
  return kernels::Q8Span{.master = s.master,
                         .grad = s.grad,
                         .grad_dtype = s.grad_dtype,
                         .param = s.param,
                         .param_dtype = s.param_dtype,
                         .m_codes = m.codes(at),
                         .m_scales = m.scales(at),
                         .v_codes = v.codes(at),
                         .v_scales = v.scales(at),
                         .n = s.n};
}

Result<kernels::StepReport> step_q8_group(const kernels::StepArgs& args,
                                          std::span<const kernels::Q8Span> spans) {
  return kernels::step_q8(kernels::Q8StepArgs{.hyper = args.hyper,
                                              .step = args.step,
                                              .grad_scale = args.grad_scale,
                                              .spans = spans,
                                              .pool = args.pool,
                                              .check = args.check,
                                              .checked = args.checked});
}

kernels::Q8Map q8_map_of_state(std::uint32_t i) {
  STRATA_CHECK(i < 2);
  return i == 0 ? kernels::Q8Map::kSigned : kernels::Q8Map::kUnsigned;
}

}  // namespace strata::runtime
