#include "notified/notify.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "core/counters.h"
#include "core/windows.h"
#include "notified/messages.h"
#include "notified/ordered_sum.h"
#include "protocols/deferred.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

constexpr int kStampShift = 24;  // stamp = product << this | id bits << 2 | status
constexpr int64_t kIdMask = (int64_t{1} << 22) - 1;
constexpr double kRemoteReadSeconds = 1e-3;  // how often a missing credit is read remotely
constexpr int kNoticeShift = 20;  // notice = (generation + 1) << this | (abandoning rank + 1)

// Per private communicator: the number of notified products run, and the origin buffers of
// the stamps and credits this rank sends (an MPI_Accumulate's origin buffer must stay
// unchanged until the operation completes: each is completed locally before its reuse).
struct SyncState {
  uint64_t key = 0;
  uint64_t window = 0;  // the sync window's generation (windows.h) the state belongs to
  int64_t products = 0;
  // Bytes of the slots window the last product used (its accumulator [0, last_acc) and its
  // slots [last_lo, last_hi)), which a target may still be summing when the next one arrives.
  int64_t last_acc = 0;
  int64_t last_lo = 0;
  int64_t last_hi = 0;
  int64_t generation = 0;  // how many times the ranks started again together (Resync)
  // Failed a product for an abandonment: start again at the next. Atomic: a communicator's
  // waiter (deferred.h) sets it while its next start may read it.
  std::atomic<bool> resync{false};
  std::atomic<int64_t> failed_run{0};  // the program run of the product failed (0: unknown)
  std::vector<int64_t> stamps;         // per target rank
  std::vector<int64_t> credits;        // per origin rank
  int64_t own = 0;                     // this rank's own progress, written into its window
  int64_t notice = 0;                  // the notice this rank sends (AnnounceAbandoned)
};

SyncState& StateOf(MPI_Comm comm, int size) {
  static std::mutex* mu = new std::mutex();
  static auto* states = new std::vector<std::unique_ptr<SyncState>>();
  std::lock_guard<std::mutex> lock(*mu);
  const uint64_t key = CommKey(comm);
  for (auto& s : *states) {
    if (s->key == key) return *s;
  }
  states->push_back(std::make_unique<SyncState>());
  SyncState& s = *states->back();
  s.key = key;
  s.stamps.assign(static_cast<size_t>(size), 0);
  s.credits.assign(static_cast<size_t>(size), 0);
  return s;
}

// Where `origin`'s stamp for this product is in a sync window: products of the second of two
// sets of slots have entries of their own, so that an origin may stamp one product while its
// target still reads the stamps of the one before.
int64_t StampIndex(const NotifiedReduce& n, int64_t origin) {
  return n.first_slot > 0 ? 2 * int64_t{n.size} + 2 + origin : origin;
}

int64_t ReadEntry(const NotifiedReduce& n, int64_t index) {
  return __atomic_load_n(n.sync_base + index, __ATOMIC_ACQUIRE);
}

// Writes `value` into entry `index` of `rank`'s sync window; `buffer` (this rank's) holds it
// until the operation completes.
ffi::Error WriteEntry(const NotifiedReduce& n, int rank, int64_t index, int64_t value,
                      int64_t* buffer, const char* what) {
  RmaIssueStep issuing(n.comm);
  if (int rc = MPI_Win_flush_local(rank, n.sync_win); rc != MPI_SUCCESS) {
    return MpiError(rc, what);
  }
  *buffer = value;
  const MPI_Aint disp = static_cast<MPI_Aint>(index * 8);
  if (int rc = MPI_Accumulate(buffer, 1, MPI_INT64_T, rank, disp, 1, MPI_INT64_T, MPI_REPLACE,
                              n.sync_win);
      rc != MPI_SUCCESS) {
    return MpiError(rc, what);
  }
  return ffi::Error::Success();
}

// The generation of the newest notice in this rank's sync window (0: none).
int64_t NoticeGeneration(const NotifiedReduce& n) {
  MPI_Win_sync(n.sync_win);
  return ReadEntry(n, 2 * n.size + 1) >> kNoticeShift;
}

// This rank failed `n` for an abandonment (or abandoned it): start again (Resync) next time.
void MarkFailed(const NotifiedReduce& n, SyncState& state) {
  state.failed_run = n.run;
  state.resync = true;
}

// Tells every rank that this rank abandoned a product (`state.notice`, MPI_MAX into entry 2P+1
// of every sync window, this rank's own included), completed before any stamp of the abandoned
// product goes out: a rank that hears of the abandonment through a stamp has the notice too.
ffi::Error AnnounceAbandoned(const NotifiedReduce& n, SyncState& state) {
  const char* what = "osmm_reduce (notified): MPI_Accumulate (abandonment notice)";
  state.notice = ((state.generation + 1) << kNoticeShift) | (n.rank + 1);
  RmaIssueStep issuing(n.comm);
  const MPI_Aint disp = static_cast<MPI_Aint>((2 * n.size + 1) * 8);
  for (int r = 0; r < n.size; ++r) {
    if (int rc = MPI_Accumulate(&state.notice, 1, MPI_INT64_T, r, disp, 1, MPI_INT64_T, MPI_MAX,
                                n.sync_win);
        rc != MPI_SUCCESS) {
      return MpiError(rc, what);
    }
  }
  if (int rc = MPI_Win_flush_all(n.sync_win); rc != MPI_SUCCESS) return MpiError(rc, what);
  MarkFailed(n, state);
  return ffi::Error::Success();
}

// Why a rank that reads a notice while it waits gives its product up.
std::string VoidedBy(const NotifiedReduce& n) {
  const int64_t rank = (ReadEntry(n, 2 * n.size + 1) & ((int64_t{1} << kNoticeShift) - 1)) - 1;
  return "osmm_reduce (notified): rank " + std::to_string(rank) +
         " abandoned a product (an error stopped its program between the start and the finish "
         "of a reduce; its own error says why), so this rank's product cannot complete and was "
         "discarded. Every rank starts again together at its next product.";
}

// Starts the ranks again together after a product abandoned by one of them (every rank calls
// it at its next notified product, having abandoned, or read the notice: AnnounceAbandoned):
// every rank completes what it sent, then, between two barriers, zeroes its slots window and
// its stamps and credits, so that nothing of the abandoned products remains and numbering
// starts again from 1 on every rank.
ffi::Error Resync(const NotifiedReduce& n, SyncState& state, int64_t slot_bytes) {
  {
    RmaIssueStep issuing(n.comm);
    int rc = MPI_Win_flush_all(n.slot_win);
    if (rc == MPI_SUCCESS) rc = MPI_Win_flush_all(n.sync_win);
    if (rc != MPI_SUCCESS) return MpiError(rc, "osmm_reduce (notified): starting again: flush");
  }
  auto barrier = [&n]() {
    MPI_Request request = MPI_REQUEST_NULL;
    if (int rc = MPI_Ibarrier(n.comm, &request); rc != MPI_SUCCESS) {
      return MpiError(rc, "osmm_reduce (notified): starting again: MPI_Ibarrier");
    }
    return WaitBounded(&request, n.comm, Step::kBarrier,
                       "osmm_reduce (notified): every rank starting again after an abandoned "
                       "product (MPI_Ibarrier)");
  };
  if (ffi::Error err = barrier(); err.failure()) return err;  // nothing more will arrive
  if (ffi::Error err = RestartMessages(n.comm, state.window); err.failure()) return err;
  MPI_Win_sync(n.slot_win);
  MPI_Win_sync(n.sync_win);
  std::memset(n.slot_base, 0, static_cast<size_t>(slot_bytes));
  for (int64_t i = 0; i < 3 * n.size + 2; ++i) {
    if (i == 2 * n.size + 1) continue;  // the notice stays: it names the generation
    __atomic_store_n(n.sync_base + i, int64_t{0}, __ATOMIC_RELEASE);
  }
  MPI_Win_sync(n.slot_win);
  MPI_Win_sync(n.sync_win);
  if (ffi::Error err = barrier(); err.failure()) return err;  // nobody writes before all cleared
  state.products = 0;
  state.last_acc = state.last_lo = state.last_hi = 0;
  state.own = 0;
  state.generation += 1;
  state.resync = false;
  GlobalCounters().resyncs.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// The progress `target` has made as a target: what it pushed here, or, when that is not
// enough and a while has passed since the last look, what its own window says.
ffi::Error TargetProgress(NotifiedReduce& n, size_t i, int64_t needed, int64_t* progress) {
  const int64_t target = n.spec.targets[i];
  *progress = ReadEntry(n, n.size + target);
  if (*progress >= needed || MPI_Wtime() - n.last_read[i] < kRemoteReadSeconds) {
    return ffi::Error::Success();
  }
  int64_t remote = 0;
  const MPI_Aint disp = static_cast<MPI_Aint>(2 * n.size * 8);
  RmaIssueStep issuing(n.comm);
  int rc = MPI_Fetch_and_op(nullptr, &remote, MPI_INT64_T, static_cast<int>(target), disp,
                            MPI_NO_OP, n.sync_win);
  if (rc == MPI_SUCCESS) rc = MPI_Win_flush(static_cast<int>(target), n.sync_win);
  if (rc != MPI_SUCCESS) return MpiError(rc, "osmm_reduce (notified): reading a target's progress");
  GlobalCounters().credit_reads.fetch_add(1, std::memory_order_relaxed);
  n.last_read[i] = MPI_Wtime();
  *progress = std::max(*progress, remote);
  return ffi::Error::Success();
}

// The progress `target` must have made before this rank writes its slot in this product.
int64_t NeededProgress(const NotifiedReduce& n, size_t i) {
  const int64_t round = n.spec.positions[i] / n.spec.per_product();
  // The first round's slots were last used by the product before the one before (the product
  // before used the other set), which the target has summed once it is done with that one.
  if (round == 0 && n.other_set_before) return (n.product - 2) * kNotifyRoundScale;
  return (n.product - 1) * kNotifyRoundScale + round;
}

// This rank's progress as a target is now `value`: into its own window entry, and pushed to
// `origins` (who wait for it to write their slots) unless they pull it (spec.pull_credits).
ffi::Error Advance(NotifiedReduce& n, SyncState& state, int64_t value,
                   const std::vector<int64_t>& origins) {
  const char* what = "osmm_reduce (notified): MPI_Accumulate (credit)";
  if (ffi::Error err = WriteEntry(n, n.rank, 2 * n.size, value, &state.own, what); err.failure()) {
    return err;
  }
  {
    RmaIssueStep issuing(n.comm);
    if (int rc = MPI_Win_flush(n.rank, n.sync_win); rc != MPI_SUCCESS) return MpiError(rc, what);
  }
  if (n.spec.pull_credits || n.spec.messages) return ffi::Error::Success();
  for (int64_t origin : origins) {
    const size_t o = static_cast<size_t>(origin);
    if (ffi::Error err = WriteEntry(n, static_cast<int>(origin), n.size + n.rank, value,
                                    &state.credits[o], what);
        err.failure()) {
      return err;
    }
    GlobalCounters().credit_pushes.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error OpenNotified(BufferOps& ops, MPI_Comm comm, const NotifySpec& spec, int64_t call_id,
                        int64_t window_bytes, NotifiedReduce* out, ffi::Error* local) {
  out->spec = spec;
  out->comm = comm;
  out->run = CurrentRun();
  MPI_Comm_rank(comm, &out->rank);
  MPI_Comm_size(comm, &out->size);
  int64_t slot_bytes = 0;  // of the whole slots window
  const int64_t sync_bytes = (3 * int64_t{out->size} + 2) * 8;
  if (!WindowHolds(comm, WindowSlot::kSlots, window_bytes) ||
      !WindowHolds(comm, WindowSlot::kSync, sync_bytes)) {
    DrainDeferred(comm);  // the waiter may not use a window being replaced
  }
  {
    WindowLease lease;
    if (ffi::Error err = AcquireWindow(comm, WindowSlot::kSlots, window_bytes, &lease);
        err.failure()) {
      return err;
    }
    if (ffi::Error used = ops.UseWindow(lease); used.failure() && local->success()) {
      *local = std::move(used);
    }
    out->slot_win = lease.win();
    out->slot_base = lease.base();
    slot_bytes = lease.bytes();
  }
  {
    WindowLease lease;
    if (ffi::Error err = AcquireWindow(comm, WindowSlot::kSync, sync_bytes, &lease);
        err.failure()) {
      return err;
    }
    // Only MPI and this host touch it, but every window of a call goes through the platform.
    if (ffi::Error used = ops.UseWindow(lease); used.failure() && local->success()) {
      *local = std::move(used);
    }
    out->sync_win = lease.win();
    out->sync_base = reinterpret_cast<int64_t*>(lease.base());
    SyncState& state = StateOf(comm, out->size);
    if (state.window != lease.generation()) {
      // A new, zeroed sync window (the first, or after FreeWindows, on every rank alike):
      // numbering starts again.
      state.window = lease.generation();
      state.products = 0;
      state.last_acc = state.last_lo = state.last_hi = 0;
      state.generation = 0;
      state.resync = false;
    }
  }
  SyncState& state = StateOf(comm, out->size);
  // Before starting again: every rank makes the lane at the same product (collective).
  if (spec.messages) {
    if (ffi::Error err = OpenMessages(*out, state.window); err.failure()) return err;
  }
  if (state.resync || NoticeGeneration(*out) > state.generation) {
    // Not failed yet (it hears of the abandonment only now), or failed in this program run (a
    // deferred product, on the waiter, while the program went on): this product fails. Failed
    // in an earlier run: this start begins the next program, as the abandoning rank's does,
    // and runs. Run ids unknown (0): as earlier.
    DrainDeferred(comm);  // nothing of the waiter's may run while the slots are cleared
    const bool failed_already =
        state.resync && (state.failed_run == 0 || out->run == 0 || state.failed_run != out->run);
    if (ffi::Error err = Resync(*out, state, slot_bytes); err.failure()) return err;
    if (!failed_already) return ffi::Error::Internal(VoidedBy(*out));
  }
  out->product = ++state.products;
  // Two sets: this product's set, and whether its slots are clear of the bytes the product
  // before uses, accumulator included (products of other sizes lay their slots out
  // differently). Every rank runs the same products on `comm` in the same order: all agree.
  out->first_slot = spec.two_sets && out->product % 2 == 1 ? spec.slots / 2 : 0;
  const int64_t lo = (1 + out->first_slot) * spec.slot_bytes;
  const int64_t hi = lo + spec.per_product() * spec.slot_bytes;
  out->other_set_before =
      spec.two_sets && lo >= state.last_acc && (hi <= state.last_lo || lo >= state.last_hi);
  state.last_acc = spec.slot_bytes;
  state.last_lo = lo;
  state.last_hi = hi;
  out->stamp = (out->product << kStampShift) | ((call_id & kIdMask) << 2);
  out->target_state.assign(spec.targets.size(), 0);
  out->last_read.assign(spec.targets.size(), -1.0);
  GlobalCounters().slot_window_bytes.store(window_bytes, std::memory_order_relaxed);
  return ffi::Error::Success();
}

bool MayDeliverNow(NotifiedReduce& n, int64_t target) {
  const auto it = std::lower_bound(n.spec.targets.begin(), n.spec.targets.end(), target);
  if (it == n.spec.targets.end() || *it != target) return false;  // not in the plan: never sent
  const size_t i = static_cast<size_t>(it - n.spec.targets.begin());
  if (n.target_state[i] == 0) {
    MPI_Win_sync(n.sync_win);
    const bool free = ReadEntry(n, n.size + target) >= NeededProgress(n, i);
    n.target_state[i] = free ? 1 : 2;
    if (!free) GlobalCounters().deferred_deliveries.fetch_add(1, std::memory_order_relaxed);
  }
  return n.target_state[i] == 1;
}

namespace {

// The targets' side of the finish: delivers what was deferred once its slot is free, then
// completes every delivery and sends the stamps. Returns whether it did anything.
struct Deliveries {
  NotifiedReduce& n;
  SyncState& state;
  const std::function<std::string(int64_t)>& deliver;
  std::string problem;     // this rank's: every stamp then carries the failed status
  bool abandoned;          // this rank abandoned the product: every stamp says so
  std::vector<int> phase;  // per target: 0 waiting for its slot, 1 to notify, 2 notified
  size_t notified = 0;

  int64_t Stamp() const {
    return n.stamp | (abandoned ? kStampAbandoned : (problem.empty() ? 0 : kStampFailed));
  }

  // The message transport: each target's message (its stamp and partials) sent, then waited
  // for until it has left this rank.
  ffi::Error StepMessages(bool* progressed) {
    for (size_t i = 0; i < phase.size(); ++i) {
      if (phase[i] == 0) {
        if (problem.empty()) problem = deliver(n.spec.targets[i]);
        if (ffi::Error err = SendImage(n, i, Stamp()); err.failure()) return err;
        phase[i] = 1;
        *progressed = true;
      }
      bool done = false;
      if (phase[i] == 1) {
        if (ffi::Error err = SendDone(n, i, &done); err.failure()) return err;
      }
      if (done) {
        phase[i] = 2;
        ++notified;
        *progressed = true;
      }
    }
    return ffi::Error::Success();
  }

  ffi::Error Step(bool* progressed) {
    if (n.spec.messages) return StepMessages(progressed);
    std::vector<size_t> ready;
    MPI_Win_sync(n.sync_win);
    for (size_t i = 0; i < phase.size(); ++i) {
      if (phase[i] == 0) {
        int64_t progress = 0;
        if (ffi::Error err = TargetProgress(n, i, NeededProgress(n, i), &progress); err.failure()) {
          return err;
        }
        if (progress < NeededProgress(n, i)) continue;
        if (problem.empty()) problem = deliver(n.spec.targets[i]);
        phase[i] = 1;
      }
      if (phase[i] == 1) ready.push_back(i);
    }
    // Every delivery complete at its target before any stamp: one flush waits for them all.
    if (!ready.empty()) {
      RmaIssueStep issuing(n.comm);
      const int rc = ready.size() == 1
                         ? MPI_Win_flush(static_cast<int>(n.spec.targets[ready[0]]), n.slot_win)
                         : MPI_Win_flush_all(n.slot_win);
      if (rc != MPI_SUCCESS) return MpiError(rc, "osmm_reduce (notified): MPI_Win_flush");
    }
    for (size_t i : ready) {
      const int64_t target = n.spec.targets[i];
      if (ffi::Error err = WriteEntry(n, static_cast<int>(target), StampIndex(n, n.rank), Stamp(),
                                      &state.stamps[static_cast<size_t>(target)],
                                      "osmm_reduce (notified): MPI_Accumulate (stamp)");
          err.failure()) {
        return err;
      }
      GlobalCounters().notifications.fetch_add(1, std::memory_order_relaxed);
      phase[i] = 2;
      ++notified;
    }
    *progressed = *progressed || !ready.empty();
    return ffi::Error::Success();
  }
};

// Whether origins number [first, end) have all stamped this product: nothing to wait for any more
// (*arrived), or the ranks are out of step (an error); *failed names an origin that failed.
ffi::Error RoundArrived(NotifiedReduce& n, SyncState& state, size_t first, size_t end,
                        bool* arrived, std::string* failed) {
  MPI_Win_sync(n.sync_win);
  *arrived = true;
  for (size_t k = first; k < end; ++k) {
    const int64_t origin = n.spec.origins[k];
    int64_t stamp = 0;
    bool came = true;
    if (n.spec.messages) {
      if (ffi::Error err = ReceivedStamp(n, k, &came, &stamp); err.failure()) return err;
    } else {
      stamp = ReadEntry(n, StampIndex(n, origin));
    }
    const int64_t product = stamp >> kStampShift;
    // A message is this product's or a sign that the ranks are out of step (below).
    if (!came || (product < n.product && !n.spec.messages)) {
      *arrived = false;
      continue;
    }
    if (product != n.product || (stamp & ~int64_t{3}) != n.stamp) {
      auto named = [](int64_t p, int64_t s) {
        return "product #" + std::to_string(p) + " (id bits " + std::to_string((s >> 2) & kIdMask) +
               ")";
      };
      return Desynchronised(n.comm, "osmm_reduce (notified): rank " + std::to_string(n.rank) +
                                        " runs its notified " + named(n.product, n.stamp) +
                                        " but rank " + std::to_string(origin) + " delivered for " +
                                        named(product, stamp));
    }
    if ((stamp & kStampAbandoned) != 0) MarkFailed(n, state);  // the ranks start again next product
    if ((stamp & kStampAbandoned) != 0 && failed->empty()) {
      *failed = "osmm_reduce_finish: rank " + std::to_string(origin) +
                " abandoned this product (an error stopped its program between the start and "
                "the finish of the reduce; its own error says why); this rank's result would "
                "be incomplete and was discarded. The next product runs normally.";
    } else if ((stamp & kStampFailed) != 0 && failed->empty()) {
      *failed = "osmm_reduce_finish: rank " + std::to_string(origin) +
                " could not deliver its partials to this product (an error on that rank: its "
                "own error says why); this rank's result would be incomplete and was discarded."
                " The next product runs normally.";
    }
  }
  return ffi::Error::Success();
}

}  // namespace

namespace {

ffi::Error Finish(BufferOps& ops, NotifiedReduce& n,
                  const std::function<std::string(int64_t)>& deliver, const std::string& problem,
                  bool abandoned, ffi::DataType dtype, const void* local, void* out,
                  int64_t elements, std::string* failure) {
  SyncState& state = StateOf(n.comm, n.size);
  if (abandoned) {
    if (ffi::Error err = AnnounceAbandoned(n, state); err.failure()) return err;
  }
  if (n.spec.messages && (state.resync || NoticeGeneration(n) > state.generation)) {
    // A product was abandoned (this one, or one before that this rank has not started again
    // after: a deferred product opened before it heard): its targets get the stamp alone,
    // and it posts no receive the messages of the abandoned product might match.
    const int64_t status = abandoned ? kStampAbandoned : kStampFailed;
    if (ffi::Error err = SendStamps(n, n.stamp | status); err.failure()) return err;
    if (failure->empty()) *failure = VoidedBy(n);
    MarkFailed(n, state);
    return ffi::Error::Success();
  }
  Deliveries targets{n, state, deliver, problem, abandoned, {}, 0};
  for (int s : n.target_state) targets.phase.push_back(s == 1 ? 1 : 0);
  const std::vector<int64_t>& origins = n.spec.origins;
  const size_t slots = static_cast<size_t>(n.spec.per_product());  // per round
  const bool above = !origins.empty() && origins.back() > n.rank;
  OrderedSum sum(ops, dtype, local, out, n.slot_base, elements, above);
  size_t next_origin = 0;  // the first origin of the round being waited for
  std::vector<int64_t> round;
  const double start = MPI_Wtime();
  PollWait wait(Step::kNotifyWait, n.comm, "osmm_reduce (notified): waiting for deliveries",
                n.background);
  const int64_t block_bytes = elements * static_cast<int64_t>(ffi::ByteWidth(dtype));
  if (n.spec.messages) {
    if (ffi::Error err = PostReceives(n, 0, std::min(origins.size(), slots), block_bytes,
                                      static_cast<int64_t>(ffi::ByteWidth(dtype)));
        err.failure()) {
      return err;
    }
  }
  for (;;) {
    bool progressed = false;
    if (ffi::Error err = targets.Step(&progressed); err.failure()) return err;
    bool arrived = next_origin >= origins.size();
    if (!arrived) {
      const size_t end = std::min(origins.size(), next_origin + slots);
      round.assign(origins.begin() + next_origin, origins.begin() + end);
      if (ffi::Error err = RoundArrived(n, state, next_origin, end, &arrived, failure);
          err.failure()) {
        return err;
      }
      if (arrived) {
        MPI_Win_sync(n.slot_win);
        for (size_t k = 0; k < round.size(); ++k) {
          const size_t index = static_cast<size_t>(n.first_slot) + (next_origin + k) % slots;
          std::byte* slot = n.slot_base + (1 + index) * n.spec.slot_bytes;
          const size_t origin = next_origin + k;
          if (out == nullptr) {
            const int64_t used =
                n.spec.place ? n.spec.origin_extents[origin] : elements * ffi::ByteWidth(dtype);
            std::memset(slot, 0, static_cast<size_t>(used));
            continue;
          }
          if (n.spec.place) {
            if (ffi::Error err = PlaceSlot(ops, n, origin, slot, dtype, local, out);
                err.failure()) {
              return err;
            }
            continue;
          }
          if (!sum.has_local() && round[k] > n.rank) {
            if (ffi::Error err = sum.AddLocal(); err.failure()) return err;
          }
          if (ffi::Error err = sum.AddSlot(slot); err.failure()) return err;
        }
        if (out != nullptr && !n.spec.place) {  // the round's slots are freed below
          if (ffi::Error err = sum.EndRound(end >= origins.size()); err.failure()) return err;
        }
        MPI_Win_sync(n.slot_win);
        next_origin = end;
        if (n.spec.messages) {
          const size_t last = std::min(origins.size(), end + slots);
          if (ffi::Error err = PostReceives(n, end, last, block_bytes,
                                            static_cast<int64_t>(ffi::ByteWidth(dtype)));
              err.failure()) {
            return err;
          }
        }
        const int64_t rounds = static_cast<int64_t>((next_origin + slots - 1) / slots);
        std::vector<int64_t> next(origins.begin() + end,
                                  origins.begin() + std::min(origins.size(), end + slots));
        if (ffi::Error err = Advance(n, state, (n.product - 1) * kNotifyRoundScale + rounds, next);
            err.failure()) {
          return err;
        }
        progressed = true;
      }
    }
    if (next_origin >= origins.size() && targets.notified == targets.phase.size()) break;
    if (!progressed && NoticeGeneration(n) > state.generation) {
      // A product was abandoned: some of what this one waits for will never come.
      if (failure->empty()) *failure = VoidedBy(n);
      MarkFailed(n, state);
      return n.spec.messages ? CancelReceives(n) : ffi::Error::Success();
    }
    if (!progressed) {
      int flag = 0;  // drives MPI's progress engine (the origins' operations into this rank)
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, n.comm, &flag, MPI_STATUS_IGNORE);
      if (ffi::Error err = wait.Idle(); err.failure()) return err;
    }
  }
  GlobalCounters().notify_wait_ns.fetch_add(static_cast<int64_t>((MPI_Wtime() - start) * 1e9),
                                            std::memory_order_relaxed);
  if (out != nullptr && n.spec.place) {
    if (ffi::Error err = PlaceLocal(ops, n, dtype, local, out, elements); err.failure()) return err;
  } else if (out != nullptr && !sum.has_local()) {
    if (ffi::Error err = sum.AddLocal(); err.failure()) return err;
  }
  if (ffi::Error err = Advance(n, state, n.product * kNotifyRoundScale, origins); err.failure()) {
    return err;
  }
  if (!targets.problem.empty() && failure->empty()) *failure = targets.problem;
  return ffi::Error::Success();
}

}  // namespace

ffi::Error FinishNotified(BufferOps& ops, NotifiedReduce& n,
                          const std::function<std::string(int64_t)>& deliver,
                          const std::string& problem, bool abandoned, ffi::DataType dtype,
                          const void* local, void* out, int64_t elements, std::string* failure) {
  ffi::Error err =
      Finish(ops, n, deliver, problem, abandoned, dtype, local, out, elements, failure);
  // A finish that failed leaves no receive posted into the slots.
  if (err.failure() && n.spec.messages && n.lane != nullptr) CancelReceives(n);
  return err;
}

}  // namespace osmm
