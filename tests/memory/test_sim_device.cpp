// The sim device backend: budgets, alignment, byte-exact copies, stream order, events.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "memory/test_util.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::memory {
namespace {

std::unique_ptr<Device> make_sim(std::uint64_t budget_bytes = 64 * kMiB, std::size_t queue_depth = 1024) {
  DeviceOptions options;
  options.kind = DeviceChoice::kSim;
  options.budget_bytes = budget_bytes;
  options.stream_queue_depth = queue_depth;
  auto device = make_device(options);
  EXPECT_TRUE(device.ok()) << device.status();
  return std::move(device).value();
}

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> out(n);
  for (auto& b : out) b = static_cast<std::uint8_t>(rng());
  return out;
}

TEST(SimDevice, IsSimAndNamesItsBudget) {
  auto device = make_sim(64 * kMiB);
  EXPECT_EQ(device->kind(), DeviceKind::kSim);
  EXPECT_NE(device->name().find("64.00 MiB"), std::string::npos) << device->name();
}

TEST(SimDevice, AllocationsStayWithinBudgetAndTrackHighWater) {
  auto device = make_sim(8 * kMiB);
  auto a = device->allocate(3 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = device->allocate(4 * kMiB);
  ASSERT_TRUE(b.ok()) << b.status();
  auto c = device->allocate(2 * kMiB);  // 9 MiB > 8 MiB
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(c.status().message().find("8.00 MiB"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("2.00 MiB"), std::string::npos) << c.status();
  EXPECT_EQ(device->memory_info().used_bytes, 7 * kMiB);
  EXPECT_EQ(device->memory_info().free_bytes, 1 * kMiB);
  *a = DeviceAllocation();  // frees 3 MiB
  EXPECT_EQ(device->memory_info().used_bytes, 4 * kMiB);
  auto d = device->allocate(4 * kMiB);
  ASSERT_TRUE(d.ok()) << d.status();
  MemoryInfo info = device->memory_info();
  EXPECT_EQ(info.used_bytes, 8 * kMiB);
  EXPECT_EQ(info.high_water_bytes, 8 * kMiB);
  EXPECT_LE(info.high_water_bytes, info.budget_bytes);
}

TEST(SimDevice, ZeroByteAllocationIsAnError) {
  auto device = make_sim();
  auto a = device->allocate(0);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
}

TEST(SimDevice, AllocationsAreAligned) {
  auto device = make_sim();
  std::vector<DeviceAllocation> blocks;
  for (std::size_t bytes : {1ul, 3ul, 4097ul, 65536ul}) {
    auto a = device->allocate(bytes);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % device->alignment_bytes(), 0u);
    EXPECT_GE(device->alignment_bytes(), 4096u);
    blocks.push_back(std::move(a).value());
  }
}

TEST(SimDevice, CopiesAreByteExactInEveryDirection) {
  auto device = make_sim();
  auto stream = device->create_stream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (std::size_t bytes : {1ul, 7ul, 4096ul, 1000003ul}) {
    const auto src = random_bytes(bytes, static_cast<std::uint32_t>(bytes));
    auto a = device->allocate(bytes);
    auto b = device->allocate(bytes);
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<std::uint8_t> back(bytes, 0);
    ASSERT_TRUE(device->copy_async(*stream, a->data(), src.data(), bytes, CopyKind::kHostToDevice).ok());
    ASSERT_TRUE(device->copy_async(*stream, b->data(), a->data(), bytes, CopyKind::kDeviceToDevice).ok());
    ASSERT_TRUE(device->copy_async(*stream, back.data(), b->data(), bytes, CopyKind::kDeviceToHost).ok());
    ASSERT_TRUE(device->synchronize(*stream).ok());
    EXPECT_EQ(std::memcmp(back.data(), src.data(), bytes), 0) << bytes << " bytes";
  }
  CopyStats h2d = device->copy_stats(CopyKind::kHostToDevice);
  EXPECT_EQ(h2d.copies, 4u);
  EXPECT_EQ(h2d.bytes, 1u + 7u + 4096u + 1000003u);
  EXPECT_EQ(device->copy_stats(CopyKind::kDeviceToHost).bytes, h2d.bytes);
  EXPECT_EQ(device->copy_stats(CopyKind::kDeviceToDevice).bytes, h2d.bytes);
}

TEST(SimDevice, CopyIntoSlotInsideAnAllocationIsAccepted) {
  auto device = make_sim();
  auto stream = device->create_stream();
  auto block = device->allocate(1 * kMiB);
  ASSERT_TRUE(stream.ok() && block.ok());
  std::vector<std::uint8_t> src(4096, 0xab);
  auto* slot = static_cast<std::uint8_t*>(block->data()) + 1 * kMiB - 4096;  // the last 4 KiB
  EXPECT_TRUE(device->copy_async(*stream, slot, src.data(), src.size(), CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(device->synchronize(*stream).ok());
  EXPECT_EQ(slot[4095], 0xab);
}

TEST(SimDevice, RejectsDevicePointersOutsideAllocations) {
  auto device = make_sim();
  auto stream = device->create_stream();
  auto block = device->allocate(4096);
  ASSERT_TRUE(stream.ok() && block.ok());
  std::vector<std::uint8_t> host(8192);
  // Host memory passed as device memory.
  Status s = device->copy_async(*stream, host.data(), host.data() + 4096, 4096, CopyKind::kHostToDevice);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("destination"), std::string::npos) << s;
  // Runs past the end of the allocation.
  s = device->copy_async(*stream, host.data(), static_cast<std::uint8_t*>(block->data()) + 1, 4096,
                         CopyKind::kDeviceToHost);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  s = device->copy_async(*stream, nullptr, host.data(), 16, CopyKind::kHostToDevice);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
}

TEST(SimDevice, StreamRunsWorkInOrder) {
  auto device = make_sim(64 * kMiB, /*queue_depth=*/4);  // a small queue: enqueue must block, not drop
  auto stream = device->create_stream();
  ASSERT_TRUE(stream.ok());
  std::vector<int> seen;  // touched only by the stream's worker until synchronize
  for (int i = 0; i < 500; ++i) {
    ASSERT_TRUE(device->launch_host(*stream, [&seen, i] { seen.push_back(i); }).ok());
  }
  ASSERT_TRUE(device->synchronize(*stream).ok());
  ASSERT_EQ(seen.size(), 500u);
  for (int i = 0; i < 500; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], i);
}

TEST(SimDevice, HostFunctionSeesEarlierCopy) {
  auto device = make_sim();
  auto stream = device->create_stream();
  auto block = device->allocate(1 * kMiB);
  ASSERT_TRUE(stream.ok() && block.ok());
  const auto src = random_bytes(1 * kMiB, 7);
  bool matches = false;
  ASSERT_TRUE(
      device->copy_async(*stream, block->data(), src.data(), src.size(), CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(
      device->launch_host(*stream, [&] { matches = std::memcmp(block->data(), src.data(), src.size()) == 0; })
          .ok());
  ASSERT_TRUE(device->synchronize(*stream).ok());
  EXPECT_TRUE(matches);
}

TEST(SimDevice, EventRecordedOnOneStreamOrdersAnother) {
  auto device = make_sim();
  auto a = device->create_stream();
  auto b = device->create_stream();
  auto event = device->create_event();
  ASSERT_TRUE(a.ok() && b.ok() && event.ok());
  std::atomic<bool> gate{false};
  std::atomic<bool> a_done{false};
  std::atomic<bool> b_saw_a_done{false};
  // Stream a is held until the test opens the gate, so b would run first without the event.
  ASSERT_TRUE(testing::launch_held(*device, *a, gate, [&] { a_done.store(true); }).ok());
  ASSERT_TRUE(device->record(*event, *a).ok());
  ASSERT_TRUE(device->wait(*b, *event).ok());
  ASSERT_TRUE(device->launch_host(*b, [&] { b_saw_a_done.store(a_done.load()); }).ok());

  auto pending = device->query(*event);
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(*pending) << "the event cannot be complete while stream a is held";
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  gate.store(true);
  ASSERT_TRUE(device->synchronize(*b).ok());
  EXPECT_TRUE(b_saw_a_done.load());
  ASSERT_TRUE(device->synchronize(*event).ok());
  auto done = device->query(*event);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
}

// Note [Native streams]: a stream named by its backend value orders against the device's
// own streams both ways, as another library's stream does on cuda (strata.torch: torch's).
TEST(SimDevice, NativeStreamOrdersBothWaysByEvents) {
  auto device = make_sim();
  auto own = device->create_stream();
  auto other = device->create_stream();  // played by "another library": used only by its value
  auto event = device->create_event();
  ASSERT_TRUE(own.ok() && other.ok() && event.ok());
  const NativeStream theirs{other->native()};
  std::atomic<bool> gate{false};
  std::atomic<int> order{0};
  int own_first = -1;
  int theirs_after = -1;
  int own_after = -1;
  // Own stream held at the gate: their work must wait for it through the event.
  ASSERT_TRUE(testing::launch_held(*device, *own, gate, [&] { own_first = order++; }).ok());
  ASSERT_TRUE(device->record(*event, *own).ok());
  ASSERT_TRUE(device->wait_native(theirs, *event).ok());
  ASSERT_TRUE(device->launch_host(*other, [&] { theirs_after = order++; }).ok());
  // And back: own work queued after waits for theirs.
  ASSERT_TRUE(device->record_native(*event, theirs).ok());
  ASSERT_TRUE(device->wait(*own, *event).ok());
  ASSERT_TRUE(device->launch_host(*own, [&] { own_after = order++; }).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(theirs_after, -1) << "their work ran before the event it waits for";
  gate.store(true);
  ASSERT_TRUE(device->synchronize().ok());
  EXPECT_EQ(own_first, 0);
  EXPECT_EQ(theirs_after, 1);
  EXPECT_EQ(own_after, 2);
}

TEST(SimDevice, NativeStreamThatIsNotOneOfItsStreamsIsRefused) {
  auto device = make_sim();
  auto event = device->create_event();
  ASSERT_TRUE(event.ok());
  std::uintptr_t gone = 0;
  {
    auto stream = device->create_stream();
    ASSERT_TRUE(stream.ok());
    gone = stream->native();
  }
  for (std::uintptr_t value : {std::uintptr_t{0}, gone}) {
    Status st = device->wait_native(NativeStream{value}, *event);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("not a live stream of this device"), std::string::npos) << st;
    EXPECT_EQ(device->record_native(*event, NativeStream{value}).code(), StatusCode::kInvalidArgument);
  }
}

TEST(SimDevice, NeverRecordedEventIsComplete) {
  auto device = make_sim();
  auto event = device->create_event();
  auto stream = device->create_stream();
  ASSERT_TRUE(event.ok() && stream.ok());
  auto done = device->query(*event);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  EXPECT_TRUE(device->synchronize(*event).ok());
  EXPECT_TRUE(device->wait(*stream, *event).ok());
  EXPECT_TRUE(device->synchronize(*stream).ok());
}

TEST(SimDevice, EventDestroyedWhileWorkStillUsesIt) {
  auto device = make_sim();
  auto a = device->create_stream();
  auto b = device->create_stream();
  ASSERT_TRUE(a.ok() && b.ok());
  std::atomic<int> order{0};
  int b_step = -1;
  {
    auto event = device->create_event();
    ASSERT_TRUE(event.ok());
    ASSERT_TRUE(device
                    ->launch_host(*a,
                                  [&] {
                                    std::this_thread::sleep_for(std::chrono::milliseconds(20));
                                    order.fetch_add(1);
                                  })
                    .ok());
    ASSERT_TRUE(device->record(*event, *a).ok());
    ASSERT_TRUE(device->wait(*b, *event).ok());
  }  // the handle is gone; the queued record and wait keep the event alive
  ASSERT_TRUE(device->launch_host(*b, [&] { b_step = order.load(); }).ok());
  ASSERT_TRUE(device->synchronize().ok());
  EXPECT_EQ(b_step, 1);
}

TEST(SimDevice, DeviceSynchronizeWaitsForEveryStream) {
  auto device = make_sim();
  std::vector<Stream> streams;
  std::atomic<int> done{0};
  for (int i = 0; i < 4; ++i) {
    auto s = device->create_stream();
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(device
                    ->launch_host(*s,
                                  [&] {
                                    std::this_thread::sleep_for(std::chrono::milliseconds(10));
                                    done.fetch_add(1);
                                  })
                    .ok());
    streams.push_back(std::move(s).value());
  }
  ASSERT_TRUE(device->synchronize().ok());
  EXPECT_EQ(done.load(), 4);
}

TEST(SimDevice, StreamCountIsBounded) {
  DeviceOptions options;
  options.kind = DeviceChoice::kSim;
  options.budget_bytes = kMiB;
  options.streams_max = 2;
  auto device = make_device(options);
  ASSERT_TRUE(device.ok());
  auto a = (*device)->create_stream();
  auto b = (*device)->create_stream();
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = (*device)->create_stream();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(c.status().message().find("device.streams_max"), std::string::npos) << c.status();
  *a = Stream();  // destroying one frees a place
  EXPECT_TRUE((*device)->create_stream().ok());
}

TEST(SimDevice, ConcurrentAllocateFreeNeverExceedsBudget) {
  auto device = make_sim(16 * kMiB);
  std::vector<std::thread> threads;
  std::atomic<int> refused{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<std::uint32_t>(t));
      std::vector<DeviceAllocation> held;
      for (int i = 0; i < 300; ++i) {
        if (held.size() < 4 && rng() % 2 == 0) {
          auto a = device->allocate((1 + rng() % 3) * kMiB);
          if (a.ok()) {
            held.push_back(std::move(a).value());
          } else {
            EXPECT_EQ(a.status().code(), StatusCode::kOutOfBudget);
            refused.fetch_add(1);
          }
        } else if (!held.empty()) {
          held.pop_back();
        }
        EXPECT_LE(device->memory_info().used_bytes, 16 * kMiB);
      }
    });
  }
  for (auto& t : threads) t.join();
  MemoryInfo info = device->memory_info();
  EXPECT_EQ(info.used_bytes, 0u);
  EXPECT_LE(info.high_water_bytes, 16 * kMiB);
  EXPECT_GT(info.high_water_bytes, 0u);
}

TEST(SimDevice, RegisterHostIsNotNeeded) {
  auto device = make_sim();
  std::vector<std::uint8_t> host(4096);
  auto r = device->register_host(host.data(), host.size());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, HostRegistration::kNotNeeded);
  EXPECT_TRUE(device->unregister_host(host.data()).ok());
}

}  // namespace
}  // namespace strata::memory
