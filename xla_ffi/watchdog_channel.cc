// The watchdog's side channels: opening and closing them (OpenStatusChannel,
// CloseStatusChannels), publishing this rank's status record, reading the other ranks' records
// and telling them that this rank ends the job, each with a bounded wait.
#include "watchdog_channel.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "watchdog.h"

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

// Buffers of unanswered reads are leaked on purpose: MPI may still write them.
void ReadRecords(const Channel& c, bool threads_ok, std::vector<StatusRecord>* records,
                 std::vector<bool>* answered) {
  records->assign(c.size, StatusRecord{});
  answered->assign(c.size, false);
  (*records)[c.rank] = OwnRecord();
  (*answered)[c.rank] = true;
  if (!threads_ok || c.size == 1) return;
  auto* buffers = new StatusRecord[c.size]();
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
  int rc = MPI_Win_allocate(static_cast<MPI_Aint>(sizeof(StatusRecord)), /*disp_unit=*/1,
                            MPI_INFO_NULL, c->side, &base, &c->win);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Win_allocate (watchdog side channel)");
  MPI_Win_set_errhandler(c->win, MPI_ERRORS_RETURN);
  c->record = static_cast<int64_t*>(base);
  const StatusRecord own = OwnRecord();
  std::memcpy(c->record, own.data(), sizeof(StatusRecord));
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
