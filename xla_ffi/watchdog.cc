// The watchdog's timeouts: its settings, the watchdog thread that publishes this rank's status
// and ends the job when a step has lasted longer than the timeout, raise mode's bounded waits
// (WaitBounded, BoundedBarrier) and the communicators a timeout or a desynchronisation has left
// unusable (CheckUsable, Desynchronised).
#include "watchdog.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "watchdog_channel.h"
#include "watchdog_report.h"
#include "watchdog_state.h"

namespace osmm {
namespace watchdog {
namespace {

constexpr double kGraceSeconds = 1.0;  // between telling the others and MPI_Abort

void Print(const std::string& text) {
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
}

// Prints `report`, tells the others and ends the job. Never returns.
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
  MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
  std::_Exit(kWatchdogExitCode);  // MPI_Abort does not return; this is for the compiler
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
    if (timeout <= 0 || step == 0 || s.fired.load()) continue;
    if (s.raise.load() && p.step_bounded.load()) continue;  // the waiting call times out itself
    const int64_t waited = MonotonicNs() - p.since_mono_ns.load();
    if (waited <= timeout) continue;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || s.fired.exchange(true)) continue;
    const uint64_t key = p.step_comm.load();
    EndJob(s, key, BuildReport(s, key, TimeoutHeadline(p, waited)));
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
using watchdog::Global;
using watchdog::GlobalProgress;
using watchdog::MarkUnusable;
using watchdog::MonotonicNs;
using watchdog::State;
using watchdog::TimeoutHeadline;

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

ffi::Error WaitBounded(MPI_Request* request, MPI_Comm comm, Step step, const char* what) {
  State& s = Global();
  const int64_t timeout = s.timeout_ns.load();
  if (!s.raise.load() || timeout <= 0) {
    BlockingStep blocking(step, comm);
    int rc = MPI_Wait(request, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiError(rc, what);
    return ffi::Error::Success();
  }
  BlockingStep blocking(step, comm, /*bounded=*/true);
  const int64_t start = MonotonicNs();
  for (int64_t spins = 0;; ++spins) {
    int done = 0;
    int rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiError(rc, what);
    if (done) return ffi::Error::Success();
    const int64_t waited = MonotonicNs() - start;
    if (waited > timeout) {
      // The request stays pending forever: nothing more may run on this communicator.
      const std::string report =
          BuildReport(s, CommKey(comm), TimeoutHeadline(GlobalProgress(), waited));
      MarkUnusable(s, CommKey(comm), std::string(what) + " timed out");
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        report +
                            "osmm_jax will not use this communicator again in this "
                            "process: end the job and start it again (see README, "
                            "\"Failure behaviour\").");
    }
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
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
