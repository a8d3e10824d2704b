#pragma once
// The entry points each memory-only kernel translation unit exports (internal
// to bench/roofline; mem_roofline.cpp picks one per kernels::Isa).

#include <cstddef>
#include <cstdint>

#include "roofline/mem_roofline.hpp"

namespace strata::bench::roofline {

//! Runs elements [begin, end) of m; adds the read-only streams' sum to *sink.
//! False when no kernel is built for m's shape. zero must be 0 (opaque to the compiler).
using MemPieceFn = bool (*)(const MemPass& m, MemVariant variant, std::size_t begin, std::size_t end,
                            std::uint32_t zero, std::uint64_t* sink);
//! a[i] = b[i] + s c[i] over [begin, end).
using TriadPieceFn = void (*)(float* a, const float* b, const float* c, float s, std::size_t begin,
                              std::size_t end);

bool mem_piece_scalar(const MemPass&, MemVariant, std::size_t, std::size_t, std::uint32_t, std::uint64_t*);
bool mem_piece_avx2(const MemPass&, MemVariant, std::size_t, std::size_t, std::uint32_t, std::uint64_t*);
bool mem_piece_avx512(const MemPass&, MemVariant, std::size_t, std::size_t, std::uint32_t, std::uint64_t*);
void triad_piece_scalar(float*, const float*, const float*, float, std::size_t, std::size_t);
void triad_piece_avx2(float*, const float*, const float*, float, std::size_t, std::size_t);
void triad_piece_avx512(float*, const float*, const float*, float, std::size_t, std::size_t);

}  // namespace strata::bench::roofline
