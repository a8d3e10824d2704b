// CRC32C: known values, and the hardware and table paths agree on every length and alignment.
#include <gtest/gtest.h>

#include <string_view>
#include <vector>

#include "strata/offload/crc32c.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

std::span<const std::byte> bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(crc32c(bytes("")), 0u);
  EXPECT_EQ(crc32c(bytes("123456789")), 0xE3069283u);  // the standard check value
  EXPECT_EQ(crc32c_table(bytes("123456789")), 0xE3069283u);
  std::vector<std::byte> zeros(32, std::byte{0});
  EXPECT_EQ(crc32c(zeros), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  std::vector<std::byte> ones(32, std::byte{0xFF});
  EXPECT_EQ(crc32c(ones), 0x62A8AB43u);  // RFC 3720 B.4: 32 bytes of 0xFF
}

TEST(Crc32c, ExtendsAcrossCalls) {
  std::vector<std::byte> data(1000);
  testing::fill_random(data, 3);
  std::uint32_t whole = crc32c(data);
  std::uint32_t parts = crc32c(std::span(data).subspan(0, 333));
  parts = crc32c(std::span(data).subspan(333), parts);
  EXPECT_EQ(whole, parts);
}

TEST(Crc32c, HardwareMatchesTableForEveryLengthAndAlignment) {
  if (!crc32c_hardware_available())
    GTEST_SKIP() << "this CPU has no SSE4.2 crc32 instruction; the table is used";
  EXPECT_EQ(crc32c_implementation(), "sse4.2");
  // Lengths around the three-stream blocks (3 x 256 and 3 x 4096 bytes, Note [Three
  // CRC streams]) and past several of them.
  std::vector<std::byte> data(100003 + 64);
  testing::fill_random(data, 11);
  for (std::size_t offset = 0; offset < 9; ++offset) {
    for (std::size_t length : {0,    1,    7,    8,     31,    32,    33,    100,         767,   768,   769,
                               1023, 1536, 4096, 12287, 12288, 12289, 13056, 24576 + 775, 65536, 100003}) {
      auto span = std::span<const std::byte>(data).subspan(offset, length);
      ASSERT_EQ(crc32c_hardware(span, 0x1234), crc32c_table(span, 0x1234)) << offset << " " << length;
    }
  }
}

TEST(Crc32c, DetectsAFlippedBit) {
  std::vector<std::byte> data(4096);
  testing::fill_random(data, 5);
  std::uint32_t before = crc32c(data);
  data[1234] ^= std::byte{0x10};
  EXPECT_NE(crc32c(data), before);
}

}  // namespace
}  // namespace strata::offload
