// offload/file_io: whole-file I/O (the checkpoint's): exact reads and writes, errors
// that name the path, the striped CRC32C writer and its publishing.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <vector>

#include "strata/offload/crc32c.hpp"
#include "strata/offload/file_io.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

using testing::TempDir;

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return v;
}

TEST(FileIo, WritesAndReadsBackExactly) {
  TempDir dir;
  const auto path = dir.path() / "f.bin";
  auto fd = open_file(path, O_RDWR | O_CREAT | O_TRUNC, 0644, "creating");
  ASSERT_TRUE(fd.ok()) << fd.status();
  const auto data = pattern(3 * 4096 + 17, 7);
  ASSERT_TRUE(write_exact(fd->get(), data.data(), data.size(), 100, path.string()).ok());
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(read_exact(fd->get(), back.data(), back.size(), 100, path).ok());
  EXPECT_EQ(back, data);
  EXPECT_TRUE(fsync_file(fd->get(), path).ok());
  EXPECT_TRUE(fd->close(path).ok());
  EXPECT_TRUE(fsync_dir(dir.path()).ok());
}

TEST(FileIo, AFileThatEndsFirstIsCorruptNamingIt) {
  TempDir dir;
  const auto path = dir.path() / "short.bin";
  std::ofstream(path) << "only eleven";
  auto fd = open_file(path, O_RDONLY, 0, "opening");
  ASSERT_TRUE(fd.ok()) << fd.status();
  std::vector<std::byte> buf(64);
  Status s = read_exact(fd->get(), buf.data(), buf.size(), 0, path);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s;
  EXPECT_NE(s.message().find(path.string()), std::string::npos) << s;
  EXPECT_NE(s.message().find("ends at byte 11"), std::string::npos) << s;
}

TEST(FileIo, OpenErrorsNameThePathAndTheHint) {
  TempDir dir;
  const auto missing = dir.path() / "nope" / "f.bin";
  auto fd = open_file(missing, O_WRONLY | O_CREAT, 0644, "save: creating", "the directory must exist");
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kNotFound) << fd.status();
  EXPECT_NE(fd.status().message().find("save: creating " + missing.string() + " (the directory must exist)"),
            std::string::npos)
      << fd.status();
  Status r = rename_file(missing, dir.path() / "g.bin");
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.message().find(missing.string()), std::string::npos) << r;
  EXPECT_FALSE(fsync_dir(dir.path() / "nope").ok());
}

// Stripes of kStripeBytes with a CRC32C each, written behind on the sink's thread;
// sync and rename publish the file under its final name.
TEST(FileIo, StripedWriterChecksumsEachStripeAndPublishes) {
  TempDir dir;
  const auto final_path = dir.path() / "family-0.bin";
  const auto data = pattern(2 * kStripeBytes + 12345, 3);
  StripeSink sink;
  auto fd = open_file(StripedWriter::tmp_path(final_path), O_WRONLY | O_CREAT | O_TRUNC, 0644, "creating");
  ASSERT_TRUE(fd.ok()) << fd.status();
  StripedWriter w = StripedWriter::adopt(final_path, std::move(*fd), sink);
  for (std::size_t at = 0; at < data.size(); at += 100'000)  // appends across stripe boundaries
    w.append(data.data() + at, std::min<std::size_t>(100'000, data.size() - at));
  w.finish();
  EXPECT_EQ(w.size(), data.size());
  ASSERT_TRUE(sink.drain().ok());
  ASSERT_TRUE(w.sync().ok());
  EXPECT_FALSE(std::filesystem::exists(final_path));
  ASSERT_TRUE(w.rename().ok());
  ASSERT_TRUE(std::filesystem::exists(final_path));
  EXPECT_FALSE(std::filesystem::exists(StripedWriter::tmp_path(final_path)));
  ASSERT_EQ(w.crcs().size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    const std::size_t at = i * kStripeBytes, n = std::min<std::size_t>(kStripeBytes, data.size() - at);
    EXPECT_EQ(w.crcs()[i], crc32c(std::span<const std::byte>(data.data() + at, n))) << "stripe " << i;
  }
  auto in = open_file(final_path, O_RDONLY, 0, "opening");
  ASSERT_TRUE(in.ok());
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE(read_exact(in->get(), back.data(), back.size(), 0, final_path).ok());
  EXPECT_EQ(back, data);
}

// A write the disk refuses (here: a descriptor open read-only) is the sink's error,
// returned by drain, naming the file.
TEST(FileIo, AFailedStripeWriteIsTheErrorDrainReturns) {
  TempDir dir;
  const auto final_path = dir.path() / "ro.bin";
  std::ofstream(StripedWriter::tmp_path(final_path)) << "";
  StripeSink sink;
  auto fd = open_file(StripedWriter::tmp_path(final_path), O_RDONLY, 0, "opening");
  ASSERT_TRUE(fd.ok());
  StripedWriter w = StripedWriter::adopt(final_path, std::move(*fd), sink);
  const auto data = pattern(5000, 1);
  w.append(data.data(), data.size());
  w.finish();
  Status s = sink.drain();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("ro.bin.tmp"), std::string::npos) << s;
}

}  // namespace
}  // namespace strata::offload
