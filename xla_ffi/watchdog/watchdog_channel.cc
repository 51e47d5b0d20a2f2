// The watchdog's side channels: opening and closing them (OpenStatusChannel,
// CloseStatusChannels), publishing this rank's status record, reading the other ranks' records
// and telling them that this rank ends the job or has failed. Every remote access runs on a
// helper thread per rank that the caller waits for with a deadline (ForEachPeer): MPI may block
// while issuing a call to a dead rank, and the decision to end the job must not wait for it.
#include "watchdog/watchdog_channel.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "watchdog/watchdog.h"

namespace osmm {
namespace watchdog {

Channel* FindChannelLocked(State& s, uint64_t key) {
  for (auto& c : s.channels) {
    if (c->user_key == key || c->private_key == key) return c.get();
  }
  return nullptr;
}

void Publish(Channel& c, const StatusRecord& own) {
  for (int f = kMagic; f < kNotice; ++f) __atomic_store_n(&c.record[f], own[f], __ATOMIC_RELAXED);
}

int TakeNotice(Channel& c) {
  const int64_t notice = __atomic_load_n(&c.record[kNotice], __ATOMIC_RELAXED);
  if (notice == 0 || c.notice_printed) return -1;
  c.notice_printed = true;
  return static_cast<int>(notice - 1);
}

namespace {

// What ForEachPeer's threads share with its caller, which may stop waiting before they end.
struct PeerCalls {
  std::mutex mu;
  std::condition_variable finished;
  std::vector<bool> answered;  // by rank: its call returned true
  int pending = 0;
};

}  // namespace

std::vector<bool> ForEachPeer(int size, int self, double seconds,
                              const std::function<bool(int)>& call) {
  auto shared = std::make_shared<PeerCalls>();
  shared->answered.assign(size, false);
  shared->pending = size - 1;
  for (int r = 0; r < size; ++r) {
    if (r == self) continue;
    // Own thread per rank: an MPI call to a dead rank may block in its network layer (a TCP
    // connect retried forever) while issuing, not only while waiting.
    std::thread([shared, call, r] {
      const bool ok = call(r);
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->answered[r] = ok;
      --shared->pending;
      shared->finished.notify_all();
    }).detach();
  }
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->finished.wait_for(lock, std::chrono::duration<double>(seconds),
                            [&] { return shared->pending == 0; });
  return shared->answered;
}

namespace {

// Waits for `request` until `deadline` (MonotonicNs); false if it failed or is still pending.
bool TestUntil(MPI_Request* request, int64_t deadline) {
  while (MonotonicNs() < deadline) {
    int done = 0;
    if (MPI_Test(request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

// Puts `bytes` bytes at `offset` of rank r's window and completes them there, within `deadline`.
bool PutAndFlush(MPI_Win win, int r, const void* bytes, int count, MPI_Aint offset,
                 int64_t deadline) {
  MPI_Request request = MPI_REQUEST_NULL;
  if (MPI_Rput(bytes, count, MPI_BYTE, r, offset, count, MPI_BYTE, win, &request) != MPI_SUCCESS ||
      !TestUntil(&request, deadline)) {
    return false;
  }
  return MPI_Win_flush(r, win) == MPI_SUCCESS;
}

}  // namespace

void ReadRecords(const Channel& c, bool threads_ok, std::vector<StatusRecord>* records,
                 std::vector<bool>* answered) {
  records->assign(c.size, StatusRecord{});
  answered->assign(c.size, false);
  (*records)[c.rank] = OwnRecord();
  (*answered)[c.rank] = true;
  if (!threads_ok || c.size == 1) return;
  // Never freed: MPI may still write an unanswered read's buffer after the caller moved on.
  auto* buffers = new StatusRecord[c.size]();
  const MPI_Win win = c.win;
  const int64_t deadline = MonotonicNs() + static_cast<int64_t>(kReadSeconds * 1e9);
  const std::vector<bool> done = ForEachPeer(c.size, c.rank, kReadSeconds + 0.1, [=](int r) {
    MPI_Request request = MPI_REQUEST_NULL;
    return MPI_Rget(buffers[r].data(), 8, MPI_INT64_T, r, 0, 8, MPI_INT64_T, win, &request) ==
               MPI_SUCCESS &&
           TestUntil(&request, deadline) && buffers[r][kMagic] == kRecordMagic;
  });
  for (int r = 0; r < c.size; ++r) {
    if (r == c.rank || !done[r]) continue;
    (*answered)[r] = true;
    (*records)[r] = buffers[r];
  }
}

void NotifyOthers(const Channel& c, bool threads_ok) {
  if (!threads_ok || c.size == 1) return;
  static int64_t value = 0;
  value = c.rank + 1;
  const MPI_Win win = c.win;
  const int64_t deadline = MonotonicNs() + static_cast<int64_t>(kNotifySeconds * 1e9);
  ForEachPeer(c.size, c.rank, kNotifySeconds + 0.1,
              [=](int r) { return PutAndFlush(win, r, &value, 8, kNotice * 8, deadline); });
}

std::vector<bool> PublishFailure(Channel& c, bool threads_ok, const std::string& reason) {
  // Never freed, like ReadRecords' buffers: a put may still be pending when this returns.
  auto* notice = new FailureNotice{};
  notice->rank_plus_one = c.rank + 1;
  std::strncpy(notice->reason, reason.c_str(), kReasonBytes - 1);
  // This rank's own copy too: its own watchdog then ends the job if it waits in a step later.
  std::memcpy(c.failure->reason, notice->reason, kReasonBytes);
  __atomic_store_n(&c.failure->rank_plus_one, notice->rank_plus_one, __ATOMIC_RELEASE);
  if (!threads_ok || c.size == 1) return std::vector<bool>(c.size, false);
  const MPI_Win win = c.win;
  const int64_t deadline = MonotonicNs() + static_cast<int64_t>(kNotifySeconds * 1e9);
  const MPI_Aint at = sizeof(StatusRecord);
  // The reason first, then who failed: a reader that sees the rank sees its reason.
  return ForEachPeer(c.size, c.rank, kNotifySeconds + 0.1, [=](int r) {
    return PutAndFlush(win, r, notice->reason, kReasonBytes, at + 8, deadline) &&
           PutAndFlush(win, r, &notice->rank_plus_one, 8, at, deadline);
  });
}

int ReadFailure(const Channel& c, std::string* reason) {
  const int64_t failed = __atomic_load_n(&c.failure->rank_plus_one, __ATOMIC_ACQUIRE);
  if (failed == 0) return -1;
  char text[kReasonBytes];
  std::memcpy(text, c.failure->reason, kReasonBytes);
  text[kReasonBytes - 1] = '\0';
  *reason = text;
  return static_cast<int>(failed - 1);
}

}  // namespace watchdog

using watchdog::Channel;
using watchdog::Global;
using watchdog::OwnRecord;
using watchdog::State;
using watchdog::StatusRecord;

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
  int rc = MPI_Win_allocate(static_cast<MPI_Aint>(watchdog::kChannelBytes), /*disp_unit=*/1,
                            MPI_INFO_NULL, c->side, &base, &c->win);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Win_allocate (watchdog side channel)");
  MPI_Win_set_errhandler(c->win, MPI_ERRORS_RETURN);
  c->record = static_cast<int64_t*>(base);
  c->failure = reinterpret_cast<watchdog::FailureNotice*>(c->record + sizeof(StatusRecord) / 8);
  const StatusRecord own = OwnRecord();
  std::memcpy(c->record, own.data(), sizeof(StatusRecord));
  std::memset(c->failure, 0, sizeof(watchdog::FailureNotice));
  MPI_Win_lock_all(MPI_MODE_NOCHECK, c->win);
  s.channels.push_back(std::move(c));
  watchdog::StartThreadLocked(s);
  return ffi::Error::Success();
}

void CloseStatusChannels() {
  State& s = Global();
  std::lock_guard<std::mutex> lock(s.mu);
  const StatusRecord own = OwnRecord();
  for (auto& c : s.channels) {
    // The last word of this rank, for a report another rank may still make.
    watchdog::Publish(*c, own);
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

}  // namespace osmm
