#pragma once
// checkpoint::Checkpointer: saves and loads the state a checkpoint::Source holds
// (source.hpp), in the format of Note [Checkpoint format] (runtime/checkpoint/format.cpp).
// The runtime owns one and calls it from its public calls and its scheduler:
//
//   save(lock, dir)          a blocking save (collective with data-parallel ranks)
//   begin(lock, dir)         an overlapped save: captures as of the call, writes on a
//                            thread of its own while training goes on; finish() ends it
//   load(lock, dir)          checks everything, then loads (Note [Load in one read])
//   allows_update(f), capture_for_update(lock, f), wait_captured(lock, every)
//                            the hooks an overlapped save needs from the training thread:
//                            an update of family f must not start before the save has
//                            captured f (Note [Overlapped save] in capture.cpp)
//
// Every member expects the source's lock held as `lock` (Note [Snapshot lock]) except
// wait_stale_removed, which must be called without it.

#include <memory>
#include <mutex>
#include <string>

#include "strata/checkpoint/source.hpp"
#include "strata/common/status.hpp"

namespace strata::checkpoint {

struct SaveState;   // a save in flight (checkpoint.hpp, private)
class FileRemover;  // file_remover.hpp, private

class Checkpointer {
 public:
  explicit Checkpointer(Source& source);
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  //! Waits for a save in flight (the caller must have finished it: its outcome is lost)
  //! and for the stale files being removed.
  ~Checkpointer();

  //! A blocking save into `dir`: returns once the manifest is durable. With data-parallel
  //! ranks, every rank calls it (Note [Sharded checkpoint]).
  Status save(std::unique_lock<std::mutex>& lock, const std::string& dir);
  //! Starts an overlapped save into `dir` (Note [Overlapped save]); one rank only.
  Status begin(std::unique_lock<std::mutex>& lock, const std::string& dir);
  //! Waits for the save in flight to end; its outcome (collected: cleared). Ok when none.
  Status finish(std::unique_lock<std::mutex>& lock);
  //! A save is in flight (false once it ended well; its error once it failed).
  Result<bool> in_flight() const;
  //! Loads the checkpoint in `dir`; on any failure the state is as before (Note
  //! [Load in one read]). With data-parallel ranks, every rank calls it.
  Status load(std::unique_lock<std::mutex>& lock, const std::string& dir);

  //! True when family f's optimizer update may start now: no save is in flight or it
  //! has captured f. Otherwise the save launches it (Source::launch_update) once it has.
  bool allows_update(FamilyId f);
  //! Captures family f for the save in flight before an update of f starts, waiting
  //! (unlocked) while the save's room is full; nothing when f has no update pending.
  Status capture_for_update(std::unique_lock<std::mutex>& lock, FamilyId f);
  //! Waits until the save in flight has launched the updates it held back (before a
  //! step waits for its updates); with every_family, until it has captured every
  //! family too (before a host write or a load changes values).
  Status wait_captured(std::unique_lock<std::mutex>& lock, bool every_family = false);

  //! Waits until the files older checkpoints left are removed (Note [Stale checkpoint
  //! files] in format.cpp). Call without the source's lock.
  void wait_stale_removed();

 private:
  Status start(std::unique_lock<std::mutex>& lock, const std::string& dir, bool background);
  Status publish_shards(std::unique_lock<std::mutex>& lock);

  Source& src_;
  //! The save in flight or finished and not yet collected.
  std::shared_ptr<SaveState> save_;
  std::unique_ptr<FileRemover> stale_;
};

}  // namespace strata::checkpoint
