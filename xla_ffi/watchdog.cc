#include "watchdog.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace osmm {
namespace {

using Record = std::array<int64_t, 8>;

// The status record's fields (int64 each), as published in a side-channel window.
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
constexpr double kGraceSeconds = 1.0;                 // between telling the others and MPI_Abort

int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t WallNs() {
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

Progress& GlobalProgress() {
  static Progress* progress = new Progress();  // never destroyed: the watchdog thread reads it
  return *progress;
}

Record OwnRecord() {
  const Progress& p = GlobalProgress();
  return Record{kRecordMagic,
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
  int64_t* record = nullptr;  // this rank's published record (window memory)
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
  bool thread_started = false;
  bool threads_ok = false;  // MPI_THREAD_MULTIPLE: the watchdog thread may call MPI
  std::array<std::atomic<int64_t>, 1> injected{};
};

State& Global() {
  static State* state = new State();  // never destroyed, like the window cache
  return *state;
}

const char* StepName(int64_t step) {
  switch (static_cast<Step>(step)) {
    case Step::kNone:
      return "no blocking step";
    case Step::kAgreement:
      return "the all-ranks agreement (MPI_Allreduce)";
    case Step::kOpeningFence:
      return "the opening MPI_Win_fence";
    case Step::kClosingFence:
      return "the closing MPI_Win_fence";
    case Step::kWindowCreate:
      return "window creation (MPI_Win_allocate)";
    case Step::kWindowFree:
      return "freeing a window (MPI_Win_free)";
    case Step::kCommDup:
      return "duplicating the communicator (MPI_Comm_dup)";
    case Step::kHostAgreement:
      return "matmul's agreement on its options (mpi4py allgather)";
    case Step::kBarrier:
      return "the barrier before a collective step (MPI_Ibarrier)";
    case Step::kInGraph:
      return "an mpi4jax all-reduce (MPI_Allreduce)";
  }
  return "an unknown step";
}

const char* KindName(int64_t kind) {
  switch (static_cast<CallKind>(kind)) {
    case CallKind::kNone:
      return "none";
    case CallKind::kFetch:
      return "osmm_fetch";
    case CallKind::kReduce:
      return "osmm_reduce";
    case CallKind::kTeardown:
      return "free_windows";
    case CallKind::kHost:
      return "matmul";
    case CallKind::kInGraph:
      return "mpi4jax all-reduce";
  }
  return "unknown";
}

std::string Seconds(int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", static_cast<double>(ns) * 1e-9);
  return text;
}

// A call id as 16 hex digits, as reports print it.
std::string Hex(int64_t id) {
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(id));
  return hex;
}

std::string CallText(int64_t number, int64_t kind, int64_t id) {
  std::string text = "#" + std::to_string(number) + " (" + KindName(kind);
  if (id != 0) text += ", id " + Hex(id);
  return text + ")";
}

// One line saying where the rank of `r` is.
std::string Describe(const Record& r, int64_t now_wall) {
  const int64_t age = std::max<int64_t>(0, now_wall - r[kSinceWallNs]);
  if (r[kCallKind] == static_cast<int64_t>(CallKind::kTeardown)) {
    std::string text = "in teardown after its last call #" + std::to_string(r[kCallNumber]) +
                       " (free_windows: its program is ending";
    if (r[kStep] != 0) text += std::string("), blocked in ") + StepName(r[kStep]);
    return text + (r[kStep] != 0 ? " for " : ") for ") + Seconds(age);
  }
  if (r[kStep] != 0) {
    return "in call " + CallText(r[kCallNumber], r[kCallKind], r[kCallId]) + ", blocked in " +
           StepName(r[kStep]) + " for " + Seconds(age);
  }
  if (r[kCallNumber] > r[kCompleted]) {
    return "inside call " + CallText(r[kCallNumber], r[kCallKind], r[kCallId]) +
           ", not blocked in MPI (computing) for " + Seconds(age);
  }
  if (r[kCallNumber] == 0) return "has not started any osmm_jax call";

  return "between calls, last completed " + CallText(r[kCompleted], r[kCallKind], r[kCallId]) +
         " " + Seconds(age) + " ago";
}

Channel* FindChannelLocked(State& s, uint64_t key) {
  for (auto& c : s.channels) {
    if (c->user_key == key || c->private_key == key) return c.get();
  }
  return nullptr;
}

// Reads every rank's record over `c` (this rank's from its own progress); `answered[r]` says
// whose arrived within kReadSeconds. Buffers of unanswered reads are leaked on purpose: MPI
// may still write them.
void ReadRecords(const Channel& c, bool threads_ok, std::vector<Record>* records,
                 std::vector<bool>* answered) {
  records->assign(c.size, Record{});
  answered->assign(c.size, false);
  (*records)[c.rank] = OwnRecord();
  (*answered)[c.rank] = true;
  if (!threads_ok || c.size == 1) return;
  auto* buffers = new Record[c.size]();
  std::vector<MPI_Request> requests(c.size, MPI_REQUEST_NULL);
  for (int r = 0; r < c.size; ++r) {
    if (r == c.rank) continue;
    MPI_Rget(buffers[r].data(), 8, MPI_INT64_T, r, 0, 8, MPI_INT64_T, c.win, &requests[r]);
  }
  const int64_t deadline = MonotonicNs() + static_cast<int64_t>(kReadSeconds * 1e9);
  int pending = c.size - 1;
  while (pending > 0 && MonotonicNs() < deadline) {
    for (int r = 0; r < c.size; ++r) {
      if (requests[r] == MPI_REQUEST_NULL || (*answered)[r]) continue;
      int done = 0;
      if (MPI_Test(&requests[r], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        requests[r] = MPI_REQUEST_NULL;
        --pending;
      } else if (done) {
        (*answered)[r] = buffers[r][kMagic] == kRecordMagic;
        (*records)[r] = buffers[r];
        --pending;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (pending == 0) delete[] buffers;
}

std::string RankList(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

std::string Report(const Channel* c, bool threads_ok, const std::string& headline) {
  const int64_t now = WallNs();
  std::string text = headline + "\n";
  if (c == nullptr) {
    return text + "  this rank: " + Describe(OwnRecord(), now) +
           "\n  (no side channel on this communicator: the other ranks' state is unknown)\n";
  }
  std::vector<Record> records;
  std::vector<bool> answered;
  ReadRecords(*c, threads_ok, &records, &answered);
  int64_t furthest = 0;
  for (int r = 0; r < c->size; ++r) {
    if (answered[r]) furthest = std::max(furthest, records[r][kCallNumber]);
  }
  std::vector<int> ahead, silent;
  std::vector<std::pair<int, int64_t>> behind;
  for (int r = 0; r < c->size; ++r) {
    text += "  rank " + std::to_string(r) + (r == c->rank ? " (this rank)" : "") + ": ";
    if (!answered[r]) {
      text += "did not answer within " + std::to_string(static_cast<int>(kReadSeconds)) +
              " s (dead, or busy outside MPI)\n";
      silent.push_back(r);
      continue;
    }
    text += Describe(records[r], now) + "\n";
    if (records[r][kCallNumber] == furthest) {
      ahead.push_back(r);
    } else {
      behind.emplace_back(r, records[r][kCallNumber]);
    }
  }
  // Ranks inside calls with different ids run different calls.
  std::vector<std::pair<int64_t, std::vector<int>>> by_id;
  for (int r = 0; r < c->size; ++r) {
    if (!answered[r] || records[r][kCallNumber] <= records[r][kCompleted] ||
        records[r][kCallId] == 0) {
      continue;
    }
    auto it = std::find_if(by_id.begin(), by_id.end(),
                           [&](const auto& e) { return e.first == records[r][kCallId]; });
    if (it == by_id.end()) {
      by_id.emplace_back(records[r][kCallId], std::vector<int>{r});
    } else {
      it->second.push_back(r);
    }
  }
  if (by_id.size() > 1) {
    text += "  out of step: ranks inside calls run different ones:";
    for (const auto& e : by_id) text += " " + RankList(e.second) + " in id " + Hex(e.first) + ";";
    text.back() = '\n';
  }
  if (!behind.empty() || !silent.empty()) {
    text += "  furthest: " + RankList(ahead) + " at call #" + std::to_string(furthest);
    for (const auto& b : behind) {
      text += "; rank " + std::to_string(b.first) + " at #" + std::to_string(b.second);
    }
    if (!silent.empty()) text += "; no answer from " + RankList(silent);
    text += "\n";
  }
  if (c->size > 1 && !threads_ok) {
    text += "  (MPI does not provide MPI_THREAD_MULTIPLE: other ranks were not asked)\n";
  }
  return text;
}

// Tells every other rank on `c` that this rank ends the job, waiting at most kReadSeconds.
void NotifyOthers(const Channel& c, bool threads_ok) {
  if (!threads_ok || c.size == 1) return;
  static int64_t value = 0;
  value = c.rank + 1;
  std::vector<MPI_Request> requests;
  for (int r = 0; r < c.size; ++r) {
    if (r == c.rank) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Raccumulate(&value, 1, MPI_INT64_T, r, kNotice * 8, 1, MPI_INT64_T, MPI_REPLACE, c.win,
                        &request) == MPI_SUCCESS) {
      requests.push_back(request);
    }
  }
  const int64_t deadline = MonotonicNs() + static_cast<int64_t>(kReadSeconds * 1e9);
  while (MonotonicNs() < deadline) {
    int done = 0;
    if (MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                    MPI_STATUSES_IGNORE) != MPI_SUCCESS ||
        done) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

int WorldRank() {
  int rank = -1;
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

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

std::string BuildReport(State& s, uint64_t comm_key, const std::string& headline) {
  // The main thread may hold the lock while freeing channels at exit: do not wait for it.
  std::unique_lock<std::mutex> lock(s.mu, std::defer_lock);
  for (int i = 0; i < 100 && !lock.try_lock(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const Channel* c = lock.owns_lock() ? FindChannelLocked(s, comm_key) : nullptr;
  return Report(c, s.threads_ok, headline);
}

std::string TimeoutHeadline(const Progress& p, int64_t waited_ns) {
  const int rank = WorldRank();
  return "osmm_jax watchdog: rank " + std::to_string(rank) + " (of MPI_COMM_WORLD) has waited " +
         Seconds(waited_ns) + " (limit " + Seconds(Global().timeout_ns.load()) + ") in " +
         StepName(p.step.load()) + " of call " +
         CallText(p.call_number.load(), p.call_kind.load(), p.call_id.load()) +
         ". Every rank of the communicator:";
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

void WatchdogLoop() {
  State& s = Global();
  Progress& p = GlobalProgress();
  for (;;) {
    const int64_t timeout = s.timeout_ns.load();
    const int64_t tick =
        timeout > 0 ? std::clamp<int64_t>(timeout / 8, 10'000'000, 100'000'000) : 100'000'000;
    std::this_thread::sleep_for(std::chrono::nanoseconds(tick));
    {
      // Publish this rank's status, and print a line if another rank is ending the job.
      std::unique_lock<std::mutex> lock(s.mu, std::try_to_lock);
      if (lock.owns_lock()) {
        const Record own = OwnRecord();
        for (auto& c : s.channels) {
          for (int f = kMagic; f < kNotice; ++f) {
            __atomic_store_n(&c->record[f], own[f], __ATOMIC_RELAXED);
          }
          const int64_t notice = __atomic_load_n(&c->record[kNotice], __ATOMIC_RELAXED);
          if (notice != 0 && !c->notice_printed) {
            c->notice_printed = true;
            Print("osmm_jax watchdog: rank " + std::to_string(c->rank) + " of a " +
                  std::to_string(c->size) + "-rank communicator: rank " +
                  std::to_string(notice - 1) + " is ending the job (its report says why); " +
                  "this rank " + Describe(own, WallNs()) + "\n");
          }
        }
      }
    }
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

void StartThreadLocked(State& s) {
  if (s.thread_started) return;
  s.thread_started = true;
  std::thread(WatchdogLoop).detach();  // lives as long as the process
}

void MarkStep(Step step, MPI_Comm comm, bool bounded) {
  Progress& p = GlobalProgress();
  p.step_comm.store(CommKey(comm), std::memory_order_relaxed);
  p.step_bounded.store(bounded, std::memory_order_relaxed);
  p.since_mono_ns.store(MonotonicNs(), std::memory_order_relaxed);
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
  p.step.store(static_cast<int64_t>(step), std::memory_order_release);
}

int InjectionIndex(const std::string& op) { return op == "osmm_reduce_finish" ? 0 : -1; }

}  // namespace

void SetWatchdogSettings(const WatchdogSettings& settings) {
  State& s = Global();
  s.timeout_ns = settings.timeout_seconds > 0
                     ? static_cast<int64_t>(std::min(settings.timeout_seconds, 1e9) * 1e9)
                     : 0;
  s.raise = settings.raise;
  std::lock_guard<std::mutex> lock(s.mu);
  StartThreadLocked(s);
}

WatchdogSettings GetWatchdogSettings() {
  const State& s = Global();
  return WatchdogSettings{static_cast<double>(s.timeout_ns.load()) * 1e-9, s.raise.load()};
}

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

void EnterStep(Step step, MPI_Comm comm, bool bounded) { MarkStep(step, comm, bounded); }

void LeaveStep() {
  Progress& p = GlobalProgress();
  p.step.store(static_cast<int64_t>(Step::kNone), std::memory_order_release);
  p.since_wall_ns.store(WallNs(), std::memory_order_relaxed);
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

void Watch(int64_t comm_handle, int64_t begin) {
  if (begin != 0) {
    BeginCall(CallKind::kInGraph, 0);
    EnterStep(Step::kInGraph, CommFromHandle(comm_handle));
  } else {
    LeaveStep();
    EndCall();
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

ffi::Error OpenStatusChannel(MPI_Comm user_comm, MPI_Comm private_comm) {
  State& s = Global();
  std::lock_guard<std::mutex> lock(s.mu);
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  s.threads_ok = provided == MPI_THREAD_MULTIPLE;
  auto c = std::make_unique<Channel>();
  c->user_key = CommKey(user_comm);
  c->private_key = CommKey(private_comm);
  if (int rc = MPI_Comm_dup(private_comm, &c->side); rc != MPI_SUCCESS) {
    return MpiError(rc, "MPI_Comm_dup (watchdog side channel)");
  }
  MPI_Comm_set_errhandler(c->side, MPI_ERRORS_RETURN);
  MPI_Comm_rank(c->side, &c->rank);
  MPI_Comm_size(c->side, &c->size);
  void* base = nullptr;
  int rc = MPI_Win_allocate(static_cast<MPI_Aint>(sizeof(Record)), /*disp_unit=*/1, MPI_INFO_NULL,
                            c->side, &base, &c->win);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Win_allocate (watchdog side channel)");
  MPI_Win_set_errhandler(c->win, MPI_ERRORS_RETURN);
  c->record = static_cast<int64_t*>(base);
  const Record own = OwnRecord();
  std::memcpy(c->record, own.data(), sizeof(Record));
  MPI_Win_lock_all(MPI_MODE_NOCHECK, c->win);
  s.channels.push_back(std::move(c));
  StartThreadLocked(s);
  return ffi::Error::Success();
}

void CloseStatusChannels() {
  State& s = Global();
  std::lock_guard<std::mutex> lock(s.mu);
  const Record own = OwnRecord();
  for (auto& c : s.channels) {
    // The last word of this rank, for a report another rank may still make.
    for (int f = kMagic; f < kNotice; ++f)
      __atomic_store_n(&c->record[f], own[f], __ATOMIC_RELAXED);
    const bool usable = std::none_of(s.unusable.begin(), s.unusable.end(), [&](const auto& e) {
      return e.first == c->user_key || e.first == c->private_key;
    });
    if (!usable) continue;  // a collective is pending there: leave the channel to the exit
    // Watched like any other window free, though a report can then only describe this rank.
    BlockingStep blocking(Step::kWindowFree, c->private_key == 0 ? MPI_COMM_NULL : c->side);
    if (c->win != MPI_WIN_NULL) {
      MPI_Win_unlock_all(c->win);
      MPI_Win_free(&c->win);
    }
    if (c->side != MPI_COMM_NULL) MPI_Comm_free(&c->side);
  }
  s.channels.clear();
}

std::string DescribeRanks(MPI_Comm comm, const std::string& headline) {
  return BuildReport(Global(), CommKey(comm), headline);
}

ffi::Error Desynchronised(MPI_Comm comm, const std::string& detail) {
  State& s = Global();
  // Let the other ranks' watchdog threads publish where they are now.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string report = BuildReport(
      s, CommKey(comm),
      "osmm_jax: rank " + std::to_string(WorldRank()) + " (of MPI_COMM_WORLD) found the ranks " +
          "out of step: " + detail + ". Every rank must run the same products in the same " +
          "order. Every rank of the communicator:");
  if (!s.raise.load()) {
    if (!s.fired.exchange(true)) EndJob(s, CommKey(comm), report);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // the watchdog ends it
  }
  MarkUnusable(s, CommKey(comm), "the ranks were found out of step");
  return ffi::Error(ffi::ErrorCode::kAborted,
                    report + "osmm_jax will not use this communicator again in this process.");
}

std::string OutOfStep(const char* op, int rank, int64_t number, int64_t call_id, int peer_rank,
                      int64_t peer_number, int64_t peer_call_id) {
  return std::string(op) + ": rank " + std::to_string(rank) + " runs its call #" +
         std::to_string(number) + " (id " + Hex(call_id) + ") but rank " +
         std::to_string(peer_rank) + " runs its call #" + std::to_string(peer_number) + " (id " +
         Hex(peer_call_id) + ")";
}

bool InjectFailure(const std::string& op, int64_t count) {
  const int index = InjectionIndex(op);
  if (index < 0) return false;
  Global().injected[index].store(count);
  return true;
}

bool TakeInjectedFailure(const char* op) {
  const int index = InjectionIndex(op);
  if (index < 0) return false;
  auto& slot = Global().injected[index];
  int64_t left = slot.load(std::memory_order_relaxed);
  while (left > 0) {
    if (slot.compare_exchange_weak(left, left - 1)) return true;
  }
  return false;
}

}  // namespace osmm
