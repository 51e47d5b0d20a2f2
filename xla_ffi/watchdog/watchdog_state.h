// The watchdog's process-wide state, shared by its files (watchdog*.cc) and by no one else:
// where this rank is (Progress), the status record it publishes from it, the side channels the
// records are published in, and the settings. See watchdog.h for the design.
#ifndef OSMM_JAX_XLA_FFI_WATCHDOG_STATE_H_
#define OSMM_JAX_XLA_FFI_WATCHDOG_STATE_H_

#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace osmm::watchdog {

// A rank's status record, as published in a side-channel window: int64 fields, by Field.
using StatusRecord = std::array<int64_t, 8>;

// The status record's fields.
enum Field : int {
  kMagic = 0,        // kRecordMagic once the record has been published
  kCallNumber = 1,   // the last call begun
  kCompleted = 2,    // the last call completed
  kCallKind = 3,     // CallKind of the last call begun
  kCallId = 4,       // its call_id
  kStep = 5,         // Step the rank is blocked in (kNone: none)
  kSinceWallNs = 6,  // when that step (or, outside any step, the last change) began
  kNotice = 7,       // written by another rank: 1 + the rank that is ending the job
};
constexpr int64_t kRecordMagic = 0x6f736d6d2d776474;  // "osmm-wdt"
constexpr double kReadSeconds = 2.0;                  // how long to wait for other ranks' records

// A rank that failed (an uncaught exception, a failed product) writes this into every other
// rank's window, after the status record: who failed (1 + its rank, 0: none) and why, so that
// a rank waiting for it in a blocking step ends the job (or raises) at once.
constexpr int kReasonBytes = 248;
struct FailureNotice {
  int64_t rank_plus_one;
  char reason[kReasonBytes];  // NUL-terminated
};
constexpr int kChannelBytes = static_cast<int>(sizeof(StatusRecord) + sizeof(FailureNotice));

inline int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t WallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Where this rank is. Written by the threads running calls, read by the watchdog thread.
struct Progress {
  std::atomic<int64_t> call_number{0};
  std::atomic<int64_t> completed{0};
  std::atomic<int64_t> call_kind{0};
  std::atomic<int64_t> call_id{0};
  std::atomic<int64_t> step{0};
  std::atomic<uint64_t> step_comm{0};  // CommKey of the step's communicator
  std::atomic<bool> step_bounded{false};
  std::atomic<int64_t> since_mono_ns{0};
  std::atomic<int64_t> since_wall_ns{0};
};

inline Progress& GlobalProgress() {
  static Progress* progress = new Progress();  // never destroyed: the watchdog thread reads it
  return *progress;
}

// This rank's status record, from its progress (kNotice 0).
inline StatusRecord OwnRecord() {
  const Progress& p = GlobalProgress();
  return StatusRecord{kRecordMagic,
                      p.call_number.load(std::memory_order_relaxed),
                      p.completed.load(std::memory_order_relaxed),
                      p.call_kind.load(std::memory_order_relaxed),
                      p.call_id.load(std::memory_order_relaxed),
                      p.step.load(std::memory_order_relaxed),
                      p.since_wall_ns.load(std::memory_order_relaxed),
                      0};
}

// One communicator's side channel.
struct Channel {
  uint64_t user_key = 0;
  uint64_t private_key = 0;
  MPI_Comm side = MPI_COMM_NULL;
  MPI_Win win = MPI_WIN_NULL;
  int64_t* record = nullptr;         // this rank's published record (window memory)
  FailureNotice* failure = nullptr;  // written by a failed rank (window memory, after record)
  int rank = 0;
  int size = 1;
  bool notice_printed = false;
};

struct State {
  std::mutex mu;                                   // guards channels, unusable, the thread's start
  std::vector<std::unique_ptr<Channel>> channels;  // creation order
  std::vector<std::pair<uint64_t, std::string>> unusable;  // comm key -> why
  std::atomic<bool> any_unusable{false};
  std::atomic<int64_t> timeout_ns{300'000'000'000};
  std::atomic<bool> raise{false};
  std::atomic<bool> fired{false};
  std::atomic<bool> failure_reported{false};  // this rank has told the others it failed
  bool thread_started = false;
  bool threads_ok = false;  // MPI_THREAD_MULTIPLE: the watchdog thread may call MPI
};

inline State& Global() {
  static State* state = new State();  // never destroyed, like the window cache
  return *state;
}

// Starts the watchdog thread (watchdog.cc) unless it runs already. Under s.mu.
void StartThreadLocked(State& s);

}  // namespace osmm::watchdog

#endif  // OSMM_JAX_XLA_FFI_WATCHDOG_STATE_H_
