#pragma once
// CRC32C (Castagnoli), as iSCSI and ext4 use it: the checksum each swap slot
// carries. The SSE4.2 `crc32` instruction is used when the CPU has it (checked
// once at run time; three streams at once, Note [Three CRC streams] in
// crc32c_sse42.cpp), a slicing-by-8 table otherwise; both give the same values.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace strata::offload {

//! CRC32C of `data`, continuing from `crc` (0 to start). Thread-safe; never fails.
std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc = 0);

//! The table implementation (for tests and machines without SSE4.2).
std::uint32_t crc32c_table(std::span<const std::byte> data, std::uint32_t crc = 0);

//! The SSE4.2 implementation. Only call when crc32c_hardware_available().
std::uint32_t crc32c_hardware(std::span<const std::byte> data, std::uint32_t crc = 0);

//! True when this CPU has the SSE4.2 crc32 instruction.
bool crc32c_hardware_available();

//! "sse4.2" or "table": what crc32c() uses here.
std::string_view crc32c_implementation();

}  // namespace strata::offload
