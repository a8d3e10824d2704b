// Checkpoint save with data parallelism: the ranks assemble each family's whole
// masters and states from their shards before the save thread starts (Note
// [Sharded checkpoint]), so the writer sees the same pieces as on one rank.

#include <cstring>
#include <vector>

#include "checkpoint.hpp"
#include "strata/checkpoint/test_hooks.hpp"

namespace strata::checkpoint::detail {

//! Data parallelism (Note [Sharded checkpoint]): family f's file is written by rank
//! f mod W, but every rank holds a shard of its masters and states. Before the save
//! thread starts, the ranks all-gather each family's shards (family by family, in
//! one order) and the writer keeps the whole chunks as the family's captured pieces,
//! so the files are the same as one rank's and load at any W. A rank whose own
//! part fails (memory, reading its shard) aborts the group with the cause, so the
//! others' collectives fail at once instead of waiting out the comm timeout.
//! The lock held.
namespace {

//! W gathered q8 shards, each `elems` codes then elems / kQ8BlockElems scales, in
//! place into the whole chunk's layout: every rank's codes in rank order, then
//! every rank's scales (Note [Q8 state chunks]; save_thread.cpp reads it so).
void regroup_q8_shards(std::byte* whole, std::uint64_t elems, std::uint64_t w) {
  const std::uint64_t scales = elems / runtime::kQ8BlockElems * 4, shard = elems + scales;
  std::vector<std::byte> copy(whole, whole + shard * w);
  for (std::uint64_t r = 0; r < w; ++r) {
    std::memcpy(whole + r * elems, copy.data() + r * shard, elems);
    std::memcpy(whole + w * elems + r * scales, copy.data() + r * shard + elems, scales);
  }
}

}  // namespace

Status assemble_shards(std::unique_lock<std::mutex>& lock, SaveState& s) {
  Source& src = s.src;
  const Description& d = s.desc;
  const auto w = static_cast<std::uint64_t>(src.ranks());
  const auto me = static_cast<std::uint64_t>(src.rank());
  // The last step's param gathers end first, in the same order on every rank (a
  // rank waiting for one alone would wait for the others, who are in the save's).
  STRATA_RETURN_IF_ERROR(src.finish_gathers(lock));
  std::vector<std::byte> mine, others;
  for (FamilyId f = 0; f < s.stage.size(); ++f) {
    const FamilyEntry& fam = d.families[f];
    const bool writer = fam.owned;
    std::vector<SaveState::Piece> pieces;
    Status st =
        test_hooks::before_assemble ? test_hooks::before_assemble(static_cast<int>(me), f) : Status::Ok();
    bool collective_failed = false;  // else the failure is this rank's own
    for (StateKind k : s.kinds[f]) {
      if (!st.ok()) break;
      const std::uint64_t bytes = fam.chunk_bytes[static_cast<std::size_t>(k)];
      const std::uint64_t esize = dtype_bytes(d.kind_dtype[static_cast<std::size_t>(k)]);
      if (!is_optim_kind(k)) {  // every rank holds the whole param
        if (!writer) continue;
        SaveState::Piece p{.kind = k, .bytes = bytes, .buf = save_allocate(s, bytes, true)};
        if (p.buf == nullptr) {
          st = out_of_budget("checkpoint save: no memory for a copy of family {} param", f);
          break;
        }
        pieces.push_back(p);
        st = src.read_chunk(lock, f, k, [&](const std::byte* h) { std::memcpy(p.buf, h, bytes); });
        if (!st.ok()) break;
        continue;
      }
      // A multiple of 4 bytes (kShardAlignElems). A q8 state's shard is its codes then
      // its blocks' scales (Note [Q8 state chunks]); gathered as one piece per rank and
      // laid out again below as the whole chunk's codes, then its scales.
      const bool q8 = d.kind_dtype[static_cast<std::size_t>(k)] == DType::kQ8;
      const std::uint64_t shard =
          fam.shard_elems * esize + (q8 ? fam.shard_elems / runtime::kQ8BlockElems * 4 : 0);
      mine.resize(shard);
      st = src.read_chunk(lock, f, k, [&](const std::byte* h) { std::memcpy(mine.data(), h, shard); });
      if (!st.ok()) break;
      std::byte* whole = nullptr;
      if (writer) {
        whole = save_allocate(s, shard * w, true);
        if (whole == nullptr) {
          st = out_of_budget("checkpoint save: no memory for family {} {}", f, state_kind_name(k));
          break;
        }
        pieces.push_back({.kind = k, .bytes = shard * w, .buf = whole});
      } else {
        others.resize(shard * w);
        whole = others.data();
      }
      std::memcpy(whole + me * shard, mine.data(), shard);
      st = src.all_gather(lock, whole, shard);
      collective_failed = !st.ok();
      if (!st.ok()) break;
      if (q8) regroup_q8_shards(whole, fam.shard_elems, w);
    }
    if (!st.ok()) {
      release_pieces(s, pieces);
      st.with_context(fmt::format("rank {} assembling family {}'s checkpoint shards", me, f));
      // The others are in (or will reach) this family's all-gathers: without
      // this they would wait out the comm timeout. The MPI backend ends the job.
      if (!collective_failed) src.abort_ranks(st.to_string());
      return st;
    }
    if (!writer) continue;
    s.pieces[f] = std::move(pieces);
    s.stage[f] = SaveState::Stage::kCaptured;
    --s.uncaptured;
  }
  return Status::Ok();
}

}  // namespace strata::checkpoint::detail
