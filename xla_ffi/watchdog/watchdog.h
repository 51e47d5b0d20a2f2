// A bound in time on every blocking MPI step of the native layer, and a report that names the
// ranks behind a stuck one.
//
// Each rank publishes where it is (its call number, the kind and id of the call, the blocking
// step it is in and since when) in process-wide atomics: a few stores per step, nothing else on
// the hot path. A watchdog thread wakes a few times a second; when this rank has been inside
// one step for longer than the timeout (OSMM_TIMEOUT, seconds) it reads every rank's status
// through a side channel (a tiny MPI window per communicator, on a duplicate of its own, read
// with request-based MPI_Rget under a passive-target epoch, so the stuck collective is not
// involved), prints one report on stderr, tells the other ranks (they print a line of their
// own) and ends the job with MPI_Abort. Every MPI call on that way runs under a deadline: the
// remote reads and writes run on helper threads that are waited for with a timeout (MPI may
// block while issuing a call to a dead rank, in its network layer), what they could not learn
// is said in the report, and a reaper thread _exits the process with kWatchdogExitCode if
// MPI_Abort has not ended it a few seconds later.
//
// A rank that fails (an uncaught Python exception, see ReportFailure) writes "rank r failed:
// reason" into every other rank's window; a rank waiting in a blocking step reads its own
// window every tick and ends the job (raise mode: fails the wait) with that reason at once.
//
// In "raise" mode the steps that can be bounded without MPI's help (the agreement, and a
// barrier run before each fence and each window creation or free) are waited
// for with non-blocking calls and a deadline; when it passes, the call fails with the report
// instead, and the communicator is marked unusable (a non-blocking collective is left
// pending on it, so no further collective on it can be trusted). A step that cannot be bounded
// that way (a fence whose peers all arrived but one died inside it) still ends the job.
#ifndef OSMM_JAX_XLA_FFI_WATCHDOG_H_
#define OSMM_JAX_XLA_FFI_WATCHDOG_H_

#include <mpi.h>

#include <cstdint>
#include <string>

#include "core/common.h"

namespace osmm {

// What a rank is blocked in. Published in the status record: values are stable.
enum class Step : int64_t {
  kNone = 0,
  kAgreement = 1,      // the all-ranks agreement before a call's first RMA (MPI_Allreduce)
  kOpeningFence = 2,   // MPI_Win_fence opening an RMA epoch
  kClosingFence = 3,   // MPI_Win_fence closing an RMA epoch
  kWindowCreate = 4,   // MPI_Win_allocate / MPI_Win_create (collective)
  kWindowFree = 5,     // MPI_Win_free (collective; also when the program exits)
  kCommDup = 6,        // MPI_Comm_dup of the caller's communicator (collective)
  kHostAgreement = 7,  // osmm_jax's Python-side agreement on a product's options (collective)
  kBarrier = 8,        // the bounded barrier of raise mode
  kInGraph = 9,        // a collective inside the XLA program that osmm_jax brackets (Watch)
  kNotifyWait = 10,    // a notified reduce: waiting for deliveries, or for a target's slots
  kAllreduce = 11,     // osmm_allreduce: the native all-reduce (MPI_Iallreduce)
  kRmaIssue = 12,      // an MPI_Put/Get/Accumulate call (RmaIssueStep)
};

// What kind of call a rank is in. Published in the status record: values are stable.
enum class CallKind : int64_t {
  kNone = 0,
  kFetch = 1,     // osmm_fetch
  kReduce = 2,    // osmm_reduce_start ... osmm_reduce_finish
  kTeardown = 3,  // free_windows
  kHost = 4,      // a product's Python-side checks
  kInGraph = 5,   // the all-reduces of the allreduce method and of checksum verification
};

struct WatchdogSettings {
  double timeout_seconds = 300.0;  // <= 0: never time out
  bool raise = false;  // fail the call instead of ending the job, where the step allows it
};

void SetWatchdogSettings(const WatchdogSettings& settings);
WatchdogSettings GetWatchdogSettings();

// The exit code of MPI_Abort after a timeout or a desynchronisation.
inline constexpr int kWatchdogExitCode = 75;

// Marks the start of a collective call on this rank; returns its number (1, 2, ... per
// process). EndCall marks it completed, whatever its outcome.
int64_t BeginCall(CallKind kind, int64_t call_id);
void EndCall();
// Marks this rank as in teardown (free_windows) after its last call; not a numbered call.
void BeginTeardown();

// Calls EndCall when it goes out of scope, unless released.
class CallScope {
 public:
  CallScope() = default;
  ~CallScope() {
    if (active_) EndCall();
  }
  void Release() { active_ = false; }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

 private:
  bool active_ = true;
};

// Marks this rank as blocked in `step` on `comm` until LeaveStep (for callers that cannot use
// BlockingStep, e.g. Python's own collectives).
void EnterStep(Step step, MPI_Comm comm, bool bounded = false);
void LeaveStep();

// Marks this rank as in `step` on `comm` only if it is in no step now; returns whether it
// did. LeaveStepIf(step) then clears it only if no other step has replaced it since. For
// calls that may run on the issue thread while the calling thread is in a step of its own.
bool TryEnterStep(Step step, MPI_Comm comm);
void LeaveStepIf(Step step);

// This rank is blocked in `step` on `comm` (the native layer's private duplicate, or the
// caller's communicator) from construction to destruction. `bounded`: the caller waits with
// a deadline of its own (raise mode), so the watchdog thread leaves that step to it.
class BlockingStep {
 public:
  BlockingStep(Step step, MPI_Comm comm, bool bounded = false) { EnterStep(step, comm, bounded); }
  ~BlockingStep() { LeaveStep(); }
  BlockingStep(const BlockingStep&) = delete;
  BlockingStep& operator=(const BlockingStep&) = delete;
};

// An RMA call (MPI_Put, MPI_Get, MPI_Accumulate, MPI_Fetch_and_op) on `comm`, watched from
// construction to destruction when this rank is in no other step. Such calls return at once
// on MPICH and Intel MPI, but Open MPI's osc/rdma over a network without RDMA atomics (its
// TCP BTL) takes a lock at the target for every accumulate and waits inside the call until
// the target's own MPI progress grants it: a target that died, stopped or left the network
// would hold this rank there unseen. Never bounded: raise mode cannot interrupt an MPI call.
class RmaIssueStep {
 public:
  explicit RmaIssueStep(MPI_Comm comm) : entered_(TryEnterStep(Step::kRmaIssue, comm)) {}
  ~RmaIssueStep() {
    if (entered_) LeaveStepIf(Step::kRmaIssue);
  }
  RmaIssueStep(const RmaIssueStep&) = delete;
  RmaIssueStep& operator=(const RmaIssueStep&) = delete;

 private:
  bool entered_;
};

// A polling wait for something other ranks do (a flag in a window), as a watched blocking
// step: construct it before the loop, call Idle() after every poll that found the wait not
// over. Idle yields the core (and sleeps after a while), and in raise mode fails at the
// timeout (marking `comm` unusable, with the report) or on a failed rank's notice; in abort
// mode the watchdog thread bounds the step.
class PollWait {
 public:
  // `background`: the wait runs beside the program's computation (a deferred reduce's
  // waiter), so Idle sleeps after a tenth of the polls that yield the core otherwise.
  PollWait(Step step, MPI_Comm comm, const char* what, bool background = false);
  ~PollWait();
  PollWait(const PollWait&) = delete;
  PollWait& operator=(const PollWait&) = delete;
  ffi::Error Idle();

 private:
  static constexpr int64_t kYieldSpins = 2000;  // polls that yield before the wait sleeps
  static constexpr int kSleepMicros = 20;
  MPI_Comm comm_;
  const char* what_;
  bool bounded_;
  int64_t yield_spins_ = kYieldSpins;
  int64_t spins_ = 0;
  int64_t start_ns_ = 0;
  int64_t next_look_ns_ = 0;
};

// Waits for `request`, a collective on `comm` started for `step`. Abort mode: MPI_Wait (the
// watchdog thread bounds it). Raise mode: polls until the timeout, then fails with the report
// and marks `comm` unusable.
ffi::Error WaitBounded(MPI_Request* request, MPI_Comm comm, Step step, const char* what);

// Raise mode: a barrier over `comm` waited for with WaitBounded, so that the collective step
// after it (a synchronising fence, a window creation or free) starts only once every rank has
// arrived. Abort mode: nothing (the step itself is watched).
ffi::Error BoundedBarrier(MPI_Comm comm, const char* what);

// The osmm_watch target: `begin` != 0 marks the start of a collective that osmm_jax does not
// issue itself but orders on the same token chain (mpi4jax's all-reduces in the allreduce
// method and in checksum verification), as a new call blocked in Step::kInGraph on `comm`
// (the plan's communicator, for the report); 0 marks its end. Not bounded in raise mode:
// mpi4jax's call cannot be interrupted, so a timeout there ends the job.
void Watch(int64_t comm_handle, int64_t begin);

// Fails if an earlier timeout left `comm` unusable.
ffi::Error CheckUsable(MPI_Comm comm);

// Creates the side channel of `private_comm`, the private duplicate of `user_comm`
// (collective over it): a duplicate communicator and a one-record window under a
// passive-target epoch. Called once per private communicator, when it is created.
ffi::Error OpenStatusChannel(MPI_Comm user_comm, MPI_Comm private_comm);

// Frees every side channel, in creation order (collective). Before the private
// communicators are freed.
void CloseStatusChannels();

// A report of every rank's status on `comm`'s side channel (`comm`: a private duplicate or
// the caller's communicator), headed by `headline`. Reads the others with a bounded wait.
std::string DescribeRanks(MPI_Comm comm, const std::string& headline);

// This rank failed (an uncaught exception, a failed product): tells every other rank on every
// side channel, "rank r failed: `reason`", by writing into its window (no collective), waiting
// at most a second for each. A rank waiting in a blocking step then ends the job (raise mode:
// fails the wait) with that reason instead of waiting out the timeout; so does this rank, if
// it waits in a step afterwards (at exit). Once per process; returns a line on the ranks that
// could not be told ("" if none).
std::string ReportFailure(const std::string& reason);

// After ReportFailure, on a multi-rank job: waits `grace_seconds` (the others may end the job
// first, with their reports), then ends the job itself with its own report, rather than let
// its exit run collective teardown against ranks that are inside a product. Returns at once
// if this rank reported no failure or runs alone.
void EndJobAfterFailure(double grace_seconds);

// The report on `comm` headed by a failed rank's notice found in this rank's window, or "".
std::string FailureReport(MPI_Comm comm);

// The ranks of `comm` are running different calls (`detail` says how this was found). Abort
// mode: prints the report and ends the job. Raise mode: returns the report as an error and
// marks `comm` unusable.
ffi::Error Desynchronised(MPI_Comm comm, const std::string& detail);

// "<op>: rank <rank> runs call #<number> (id ...) but rank <peer_rank> runs call #... (id ...)",
// for Desynchronised, from a neighbour's window header read inside the same epoch.
std::string OutOfStep(const char* op, int rank, int64_t number, int64_t call_id, int peer_rank,
                      int64_t peer_number, int64_t peer_call_id);

// Test hook: the next `count` calls of `op` on this process fail at their start, as if XLA had
// failed there. Only "osmm_reduce_finish" (a failure between a reduce's start and finish,
// which CloseAbandonedReduce recovers from) is supported; false for any other op.
bool InjectFailure(const std::string& op, int64_t count);
// Whether the call `op` should fail now (consumes one injected failure).
bool TakeInjectedFailure(const char* op);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_WATCHDOG_H_
