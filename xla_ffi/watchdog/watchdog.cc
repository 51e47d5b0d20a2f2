// The watchdog's timeouts: its settings, the watchdog thread that publishes this rank's status
// and ends the job when a step has lasted longer than the timeout, raise mode's bounded waits
// (WaitBounded, BoundedBarrier) and the communicators a timeout or a desynchronisation has left
// unusable (CheckUsable, Desynchronised).
#include "watchdog/watchdog.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "watchdog/watchdog_channel.h"
#include "watchdog/watchdog_report.h"
#include "watchdog/watchdog_state.h"

namespace osmm {
namespace watchdog {
namespace {

constexpr double kGraceSeconds = 1.0;   // between telling the others and MPI_Abort
constexpr double kReaperSeconds = 3.0;  // how long MPI_Abort may take before _exit ends us

void Print(const std::string& text) {
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
}

// Ends this process with kWatchdogExitCode `seconds` from now, unless it has ended by then:
// MPI_Abort may itself try to reach a dead rank and never return.
void StartReaper(double seconds) {
  std::thread([seconds] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    Print("osmm_jax watchdog: MPI_Abort has not ended this process within " +
          std::to_string(static_cast<int>(seconds)) + " s: exiting with status " +
          std::to_string(kWatchdogExitCode) + ".\n");
    std::_Exit(kWatchdogExitCode);
  }).detach();
}

// Prints `report`, tells the others and ends the job, within a few seconds whatever MPI does
// (every MPI call on the way is bounded or watched by a reaper). Never returns.
[[noreturn]] void EndJob(State& s, uint64_t comm_key, const std::string& report) {
  Print(report + "Ending the job: MPI_Abort(MPI_COMM_WORLD, " + std::to_string(kWatchdogExitCode) +
        "). OSMM_TIMEOUT sets the limit in seconds; OSMM_ON_TIMEOUT=raise raises an error "
        "instead where the step allows it.\n");
  {
    std::unique_lock<std::mutex> lock(s.mu, std::try_to_lock);
    Channel* c = lock.owns_lock() ? FindChannelLocked(s, comm_key) : nullptr;
    if (c != nullptr) NotifyOthers(*c, s.threads_ok);
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(kGraceSeconds));
  StartReaper(kReaperSeconds);
  MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
  std::_Exit(kWatchdogExitCode);  // MPI_Abort does not return; this is for the compiler
}

// A failure notice in this rank's window on any side channel: the communicator's key, with
// the headline of a report on it; false if none (or s.mu is busy: the next look finds it).
bool FindFailure(State& s, uint64_t* comm_key, std::string* headline) {
  std::unique_lock<std::mutex> lock(s.mu, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  for (auto& c : s.channels) {
    std::string reason;
    if (const int failed = ReadFailure(*c, &reason); failed >= 0) {
      *comm_key = c->private_key;
      *headline = FailureHeadline(GlobalProgress(), *c, failed, reason);
      return true;
    }
  }
  return false;
}

void MarkUnusable(State& s, uint64_t key, const std::string& why) {
  std::lock_guard<std::mutex> lock(s.mu);
  s.unusable.emplace_back(key, why);
  if (Channel* c = FindChannelLocked(s, key)) {
    s.unusable.emplace_back(c->user_key, why);
    s.unusable.emplace_back(c->private_key, why);
  }
  s.any_unusable = true;
}

// Publishes this rank's status on every side channel, and prints a line if another rank is
// ending the job. Skipped when s.mu is busy: the next tick publishes.
void PublishStatus(State& s) {
  std::unique_lock<std::mutex> lock(s.mu, std::try_to_lock);
  if (!lock.owns_lock()) return;
  const StatusRecord own = OwnRecord();
  for (auto& c : s.channels) {
    Publish(*c, own);
    if (const int ending_rank = TakeNotice(*c); ending_rank >= 0) {
      Print(NoticeLine(*c, ending_rank, own));
    }
  }
}

void WatchdogLoop() {
  State& s = Global();
  Progress& p = GlobalProgress();
  for (;;) {
    const int64_t timeout = s.timeout_ns.load();
    const int64_t tick =
        timeout > 0 ? std::clamp<int64_t>(timeout / 8, 10'000'000, 100'000'000) : 100'000'000;
    std::this_thread::sleep_for(std::chrono::nanoseconds(tick));
    PublishStatus(s);
    const int64_t step = p.step.load();
    if (step == 0 || s.fired.load()) continue;
    if (s.raise.load() && p.step_bounded.load()) continue;  // the waiting call ends itself
    const int64_t waited = MonotonicNs() - p.since_mono_ns.load();
    uint64_t key = p.step_comm.load();
    std::string headline;
    if (!FindFailure(s, &key, &headline)) {
      if (timeout <= 0 || waited <= timeout) continue;
      key = p.step_comm.load();
      headline = TimeoutHeadline(p, waited);
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || s.fired.exchange(true)) continue;
    EndJob(s, key, BuildReport(s, key, headline));
  }
}

}  // namespace

void StartThreadLocked(State& s) {
  if (s.thread_started) return;
  s.thread_started = true;
  std::thread(WatchdogLoop).detach();  // lives as long as the process
}

}  // namespace watchdog

using watchdog::BuildReport;
using watchdog::DesynchronisedHeadline;
using watchdog::EndJob;
using watchdog::FindFailure;
using watchdog::Global;
using watchdog::GlobalProgress;
using watchdog::MarkUnusable;
using watchdog::MonotonicNs;
using watchdog::State;
using watchdog::TimeoutHeadline;

namespace {

constexpr int64_t kFailureLookNs = 100'000'000;  // how often a bounded wait looks for notices

// Raise mode: the error of a wait on `comm` that a failed rank's notice ends (the communicator
// is then unusable), or success if there is no notice.
ffi::Error FailedRankError(State& s, MPI_Comm comm, const char* what) {
  uint64_t key = CommKey(comm);
  std::string headline;
  if (!FindFailure(s, &key, &headline)) return ffi::Error::Success();
  const std::string report = BuildReport(s, key, headline);
  MarkUnusable(s, CommKey(comm), std::string(what) + " was ended by a failed rank's notice");
  return ffi::Error(ffi::ErrorCode::kAborted,
                    report +
                        "osmm_jax will not use this communicator again in this process: "
                        "end the job and start it again.");
}

}  // namespace

void SetWatchdogSettings(const WatchdogSettings& settings) {
  State& s = Global();
  s.timeout_ns = settings.timeout_seconds > 0
                     ? static_cast<int64_t>(std::min(settings.timeout_seconds, 1e9) * 1e9)
                     : 0;
  s.raise = settings.raise;
  std::lock_guard<std::mutex> lock(s.mu);
  watchdog::StartThreadLocked(s);
}

WatchdogSettings GetWatchdogSettings() {
  const State& s = Global();
  return WatchdogSettings{static_cast<double>(s.timeout_ns.load()) * 1e-9, s.raise.load()};
}

PollWait::PollWait(Step step, MPI_Comm comm, const char* what, bool background)
    : comm_(comm),
      what_(what),
      bounded_(Global().raise.load() && Global().timeout_ns.load() > 0),
      yield_spins_(background ? kYieldSpins / 10 : kYieldSpins) {
  EnterStep(step, comm, bounded_);
  start_ns_ = MonotonicNs();
  next_look_ns_ = start_ns_ + kFailureLookNs;
}

PollWait::~PollWait() { LeaveStep(); }

ffi::Error PollWait::Idle() {
  ++spins_;
  if (bounded_) {
    State& s = Global();
    const int64_t now = MonotonicNs();
    if (now >= next_look_ns_) {
      next_look_ns_ = now + kFailureLookNs;
      if (ffi::Error err = FailedRankError(s, comm_, what_); err.failure()) return err;
    }
    const int64_t waited = now - start_ns_;
    if (waited > s.timeout_ns.load()) {
      // Whatever this rank waited for may still arrive: nothing more may run on `comm`.
      const std::string report =
          BuildReport(s, CommKey(comm_), TimeoutHeadline(GlobalProgress(), waited));
      MarkUnusable(s, CommKey(comm_), std::string(what_) + " timed out");
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        report +
                            "osmm_jax will not use this communicator again in this "
                            "process: end the job and start it again (see README, "
                            "\"Failure behaviour\").");
    }
  }
  // Yield first (a rank waited for may need this core), then sleep: a waiting rank must not
  // starve the ranks it waits for when ranks outnumber cores.
  if (spins_ > yield_spins_) {
    std::this_thread::sleep_for(std::chrono::microseconds(kSleepMicros));
  } else {
    std::this_thread::yield();
  }
  return ffi::Error::Success();
}

ffi::Error WaitBounded(MPI_Request* request, MPI_Comm comm, Step step, const char* what) {
  State& s = Global();
  const int64_t timeout = s.timeout_ns.load();
  if (!s.raise.load() || timeout <= 0) {
    BlockingStep blocking(step, comm);
    int rc = MPI_Wait(request, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiError(rc, what);
    return ffi::Error::Success();
  }
  PollWait wait(step, comm, what);
  for (;;) {
    int done = 0;
    int rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiError(rc, what);
    if (done) return ffi::Error::Success();
    // A timed-out request stays pending forever: Idle marks the communicator unusable.
    if (ffi::Error err = wait.Idle(); err.failure()) return err;
  }
}

ffi::Error BoundedBarrier(MPI_Comm comm, const char* what) {
  State& s = Global();
  if (!s.raise.load() || s.timeout_ns.load() <= 0) return ffi::Error::Success();
  MPI_Request request = MPI_REQUEST_NULL;
  if (int rc = MPI_Ibarrier(comm, &request); rc != MPI_SUCCESS) return MpiError(rc, what);
  return WaitBounded(&request, comm, Step::kBarrier, what);
}

ffi::Error CheckUsable(MPI_Comm comm) {
  State& s = Global();
  if (!s.any_unusable.load(std::memory_order_relaxed)) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(s.mu);
  const uint64_t key = CommKey(comm);
  for (const auto& entry : s.unusable) {
    if (entry.first == key) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "osmm_jax no longer uses this communicator: " + entry.second +
                            " earlier in this process, and a collective may still be pending "
                            "on it. End the job and start it again.");
    }
  }
  return ffi::Error::Success();
}

ffi::Error Desynchronised(MPI_Comm comm, const std::string& detail) {
  State& s = Global();
  // Let the other ranks' watchdog threads publish where they are now.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string report = BuildReport(s, CommKey(comm), DesynchronisedHeadline(detail));
  if (!s.raise.load()) {
    if (!s.fired.exchange(true)) EndJob(s, CommKey(comm), report);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // the watchdog ends it
  }
  MarkUnusable(s, CommKey(comm), "the ranks were found out of step");
  return ffi::Error(ffi::ErrorCode::kAborted,
                    report + "osmm_jax will not use this communicator again in this process.");
}

}  // namespace osmm

namespace osmm {

std::string ReportFailure(const std::string& reason) {
  State& s = Global();
  if (s.failure_reported.exchange(true)) return "";
  std::unique_lock<std::mutex> lock(s.mu, std::defer_lock);
  for (int i = 0; i < 100 && !lock.try_lock(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!lock.owns_lock()) return "osmm_jax: could not tell the other ranks of this failure\n";
  std::string text;
  for (auto& c : s.channels) {
    const std::vector<bool> took = watchdog::PublishFailure(*c, s.threads_ok, reason);
    std::vector<int> silent;
    for (int r = 0; r < c->size; ++r) {
      if (r != c->rank && !took[r]) silent.push_back(r);
    }
    if (!silent.empty()) {
      text += "osmm_jax: rank " + std::to_string(c->rank) + " of a " + std::to_string(c->size) +
              "-rank communicator could not tell " + watchdog::RankList(silent) +
              " of its failure within " +
              std::to_string(static_cast<int>(watchdog::kNotifySeconds)) + " s\n";
    }
  }
  return text;
}

std::string FailureReport(MPI_Comm comm) {
  State& s = Global();
  uint64_t key = CommKey(comm);
  std::string headline;
  if (!FindFailure(s, &key, &headline)) return "";
  return BuildReport(s, key, headline);
}

}  // namespace osmm

namespace osmm {

void EndJobAfterFailure(double grace_seconds) {
  State& s = Global();
  {
    std::unique_lock<std::mutex> lock(s.mu, std::try_to_lock);
    if (!lock.owns_lock() || !s.failure_reported.load() ||
        std::none_of(s.channels.begin(), s.channels.end(),
                     [](const auto& c) { return c->size > 1; })) {
      return;
    }
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(grace_seconds));
  uint64_t key = 0;
  std::string headline;
  for (int i = 0; i < 10 && !FindFailure(s, &key, &headline); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (headline.empty()) return;
  if (s.fired.exchange(true)) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // the watchdog ends it
  }
  EndJob(s, key, BuildReport(s, key, headline));
}

}  // namespace osmm
