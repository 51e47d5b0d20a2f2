// The watchdog's report: one line per rank saying which call and blocking step it is in and
// for how long (Describe), the report over a communicator's side channel with the ranks that
// run different calls or lag behind (BuildReport, DescribeRanks), its headlines, and the text
// of a detected desynchronisation (OutOfStep).
#include "watchdog/watchdog_report.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "watchdog/watchdog.h"
#include "watchdog/watchdog_channel.h"

namespace osmm {
namespace watchdog {
namespace {

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
    case Step::kNotifyWait:
      return "a notified reduce (waiting for another rank's deliveries or slots)";
    case Step::kAllreduce:
      return "an osmm_jax all-reduce (MPI_Iallreduce)";
    case Step::kRmaIssue:
      return "an RMA call to another rank (MPI_Put/Get/Accumulate; the MPI waits for the target)";
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
      return "all-reduce";
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
std::string Describe(const StatusRecord& r, int64_t now_wall) {
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

// The report's line on ranks inside calls with different ids (they run different calls), or
// "" when there are none.
std::string DifferentCallsLine(const std::vector<StatusRecord>& records,
                               const std::vector<bool>& answered) {
  std::vector<std::pair<int64_t, std::vector<int>>> by_id;
  for (int r = 0; r < static_cast<int>(records.size()); ++r) {
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
  if (by_id.size() <= 1) return "";
  std::string text = "  out of step: ranks inside calls run different ones:";
  for (const auto& e : by_id) text += " " + RankList(e.second) + " in id " + Hex(e.first) + ";";
  text.back() = '\n';
  return text;
}

std::string Report(const Channel* c, bool threads_ok, const std::string& headline) {
  const int64_t now = WallNs();
  std::string text = headline + "\n";
  if (c == nullptr) {
    return text + "  this rank: " + Describe(OwnRecord(), now) +
           "\n  (no side channel on this communicator: the other ranks' state is unknown)\n";
  }
  std::vector<StatusRecord> records;
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
  text += DifferentCallsLine(records, answered);
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

int WorldRank() {
  int rank = -1;
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

}  // namespace

std::string RankList(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
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

std::string FailureHeadline(const Progress& p, const Channel& c, int failed_rank,
                            const std::string& reason) {
  if (failed_rank == c.rank) {
    return "osmm_jax: rank " + std::to_string(WorldRank()) + " (of MPI_COMM_WORLD; rank " +
           std::to_string(c.rank) + " of a " + std::to_string(c.size) +
           "-rank communicator) failed after its call " +
           CallText(p.call_number.load(), p.call_kind.load(), p.call_id.load()) + ": " + reason +
           ". Every rank of the communicator:";
  }
  const std::string where = p.step.load() != 0
                                ? std::string("waiting in ") + StepName(p.step.load())
                                : std::string("before its next step");
  return "osmm_jax watchdog: rank " + std::to_string(WorldRank()) +
         " (of MPI_COMM_WORLD) stopped " + where + " of call " +
         CallText(p.call_number.load(), p.call_kind.load(), p.call_id.load()) + ": rank " +
         std::to_string(failed_rank) + (failed_rank == c.rank ? " (this rank)" : "") + " of the " +
         std::to_string(c.size) + "-rank communicator failed: " + reason +
         ". Every rank of the communicator:";
}

std::string DesynchronisedHeadline(const std::string& detail) {
  return "osmm_jax: rank " + std::to_string(WorldRank()) + " (of MPI_COMM_WORLD) found the ranks " +
         "out of step: " + detail + ". Every rank must run the same products in the same " +
         "order. Every rank of the communicator:";
}

std::string NoticeLine(const Channel& c, int ending_rank, const StatusRecord& own) {
  return "osmm_jax watchdog: rank " + std::to_string(c.rank) + " of a " + std::to_string(c.size) +
         "-rank communicator: rank " + std::to_string(ending_rank) +
         " is ending the job (its report says why); " + "this rank " + Describe(own, WallNs()) +
         "\n";
}

}  // namespace watchdog

std::string DescribeRanks(MPI_Comm comm, const std::string& headline) {
  return watchdog::BuildReport(watchdog::Global(), CommKey(comm), headline);
}

std::string OutOfStep(const char* op, int rank, int64_t number, int64_t call_id, int peer_rank,
                      int64_t peer_number, int64_t peer_call_id) {
  return std::string(op) + ": rank " + std::to_string(rank) + " runs its call #" +
         std::to_string(number) + " (id " + watchdog::Hex(call_id) + ") but rank " +
         std::to_string(peer_rank) + " runs its call #" + std::to_string(peer_number) + " (id " +
         watchdog::Hex(peer_call_id) + ")";
}

}  // namespace osmm
