#pragma once
// 8-bit optimizer states in the chunk runtime (state_dtype q8, issue #49): where a
// tensor's codes and block scales sit in its family's state chunks, the kernel
// spans over them, and the conversions read_tensor / write_tensor make (Note [Q8
// state chunks] in q8_states.cpp).

#include <cstdint>
#include <span>
#include <vector>

#include "strata/kernels/optim.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::runtime {

//! A q8 state chunk of `chunk_elems` elements: its codes at `chunk`, element e's at
//! chunk + e, and its block scales after them (block j of the chunk at scales + j).
struct Q8Chunk {
  std::byte* chunk = nullptr;
  std::uint64_t chunk_elems = 0;
  std::uint8_t* codes(std::uint64_t at) const { return reinterpret_cast<std::uint8_t*>(chunk) + at; }
  float* scales(std::uint64_t at) const {
    return reinterpret_cast<float*>(chunk + chunk_elems) + at / kernels::kQ8BlockElems;
  }
};

//! The q8 kernel span of `s` (a span of spans_for over the family's chunks): its
//! master, gradient and param, with the codes and scales of the element at `at` of
//! the m chunk and the v chunk. `at` is a multiple of kernels::kQ8BlockElems.
kernels::Q8Span q8_span(const kernels::Span& s, std::uint64_t at, const Q8Chunk& m, const Q8Chunk& v);

//! kernels::step_q8 over `spans` with one key's arguments (as group_args gives them).
Result<kernels::StepReport> step_q8_group(const kernels::StepArgs& args,
                                          std::span<const kernels::Q8Span> spans);

//! The map state kind `i` (0: m, 1: v) quantizes with.
kernels::Q8Map q8_map_of_state(std::uint32_t i);

}  // namespace strata::runtime
