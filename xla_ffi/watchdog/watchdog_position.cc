// Where this rank is: the call it runs (BeginCall, EndCall, BeginTeardown, Watch) and the
// blocking step it is in (EnterStep, LeaveStep), published in the process-wide Progress
// atomics that the watchdog thread reads. A few relaxed stores per step: this is the hot path.
#include "watchdog/watchdog.h"
#include "watchdog/watchdog_state.h"

namespace osmm {

using watchdog::GlobalProgress;
using watchdog::Progress;
using watchdog::WallNs;

void BeginTeardown() {
  Progress& p = GlobalProgress();
  p.completed.store(p.call_number.load(std::memory_order_relaxed), std::memory_order_relaxed);
  p.call_kind.store(static_cast<int64_t>(CallKind::kTeardown), std::memory_order_relaxed);
  p.call_id.store(0, std::memory_order_relaxed);
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
}

int64_t BeginCall(CallKind kind, int64_t call_id) {
  Progress& p = GlobalProgress();
  p.call_kind.store(static_cast<int64_t>(kind), std::memory_order_relaxed);
  p.call_id.store(call_id, std::memory_order_relaxed);
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
  return p.call_number.fetch_add(1, std::memory_order_relaxed) + 1;
}

void EndCall() {
  Progress& p = GlobalProgress();
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
  p.completed.store(p.call_number.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void EnterStep(Step step, MPI_Comm comm, bool bounded) {
  Progress& p = GlobalProgress();
  p.step_comm.store(CommKey(comm), std::memory_order_relaxed);
  p.step_bounded.store(bounded, std::memory_order_relaxed);
  p.since_mono_ns.store(watchdog::MonotonicNs(), std::memory_order_relaxed);
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
  p.step.store(static_cast<int64_t>(step), std::memory_order_release);
}

bool TryEnterStep(Step step, MPI_Comm comm) {
  Progress& p = GlobalProgress();
  int64_t none = static_cast<int64_t>(Step::kNone);
  if (p.step.load(std::memory_order_relaxed) != none) return false;
  // The times first: the watchdog thread reads them once it sees the step.
  p.step_comm.store(CommKey(comm), std::memory_order_relaxed);
  p.step_bounded.store(false, std::memory_order_relaxed);
  p.since_mono_ns.store(watchdog::MonotonicNs(), std::memory_order_relaxed);
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
  return p.step.compare_exchange_strong(none, static_cast<int64_t>(step), std::memory_order_release,
                                        std::memory_order_relaxed);
}

void LeaveStepIf(Step step) {
  Progress& p = GlobalProgress();
  int64_t expected = static_cast<int64_t>(step);
  if (p.step.compare_exchange_strong(expected, static_cast<int64_t>(Step::kNone),
                                     std::memory_order_release, std::memory_order_relaxed)) {
    p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
  }
}

void LeaveStep() {
  Progress& p = GlobalProgress();
  p.step.store(static_cast<int64_t>(Step::kNone), std::memory_order_release);
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
}

void Watch(int64_t comm_handle, int64_t begin) {
  if (begin != 0) {
    BeginCall(CallKind::kInGraph, 0);
    EnterStep(Step::kInGraph, CommFromHandle(comm_handle));
  } else {
    LeaveStep();
    EndCall();
  }
}

}  // namespace osmm
