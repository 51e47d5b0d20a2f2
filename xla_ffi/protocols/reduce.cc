#include "protocols/reduce.h"

#include <mpi.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/agreement.h"
#include "core/counters.h"
#include "core/records.h"
#include "core/rma.h"
#include "core/windows.h"
#include "notified/messages.h"
#include "notified/notify.h"
#include "protocols/deferred.h"
#include "protocols/issuer.h"
#include "protocols/reduce_epoch.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

struct EpochTable {
  std::mutex mu;
  // Keyed by CommKey(user comm). Epochs are heap-allocated: the issuer thread holds pointers.
  std::vector<std::pair<uint64_t, std::unique_ptr<ReduceEpoch>>> open;
};

EpochTable& Epochs() {
  static EpochTable* table = new EpochTable();  // never destroyed, like the window cache
  return *table;
}

ReduceEpoch* FindEpoch(uint64_t key) {
  EpochTable& t = Epochs();
  std::lock_guard<std::mutex> lock(t.mu);
  for (auto& entry : t.open) {
    if (entry.first == key) return entry.second.get();
  }
  return nullptr;
}

// Whether no two of `records` write the same element of one target (then each slot of the
// notified mode, written by one origin only, needs no MPI_SUM: a put leaves the same bytes).
// Over shared memory a put is a copy and MPI_Accumulate a read-add-write, several times
// slower (benchmarks/results/sync_latency.md); over a network MPICH's accumulates are faster.
// Checks at most kMaxPairs pairs; more records than that count as overlapping.
bool DisjointPerTarget(const std::vector<Record>& records) {
  constexpr size_t kMaxPairs = 1 << 16;
  if (records.size() * records.size() > 2 * kMaxPairs) return false;
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& a = records[i];
    for (size_t j = i + 1; j < records.size(); ++j) {
      const Record& b = records[j];
      if (a.target != b.target || a.rows == 0 || a.cols == 0 || b.rows == 0 || b.cols == 0) {
        continue;
      }
      const bool rows = a.row0 < b.row0 + b.rows && b.row0 < a.row0 + a.rows;
      const bool cols = a.col0 < b.col0 + b.cols && b.col0 < a.col0 + a.cols;
      if (rows && cols) return false;
    }
  }
  return true;
}

// Removes the epoch open on the communicator with key `key` from the table (destroying it).
void ForgetEpoch(uint64_t key) {
  EpochTable& t = Epochs();
  std::lock_guard<std::mutex> lock(t.mu);
  t.open.erase(std::find_if(t.open.begin(), t.open.end(),
                            [key](const auto& entry) { return entry.first == key; }));
}

// The prologue of the calls that continue an epoch: the epoch open on `comm_handle`'s
// communicator and a one-element ticket.
ffi::Error OpenEpochCall(const char* op, int64_t comm_handle, const ffi::AnyBuffer* ticket,
                         ReduceEpoch** epoch) {
  *epoch = FindEpoch(CommKey(CommFromHandle(comm_handle)));
  if (*epoch == nullptr) {
    return ffi::Error::Internal(std::string(op) + ": no reduce epoch is open on this communicator");
  }
  if (ticket != nullptr && ticket->element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": expected a one-element ticket");
  }
  return ffi::Error::Success();
}

// Issues record `i` (of a chunk whose contents are in RMA memory at `chunk`). Returns an empty
// string, or which MPI call failed.
std::string IssueRecord(const ReduceEpoch& epoch, int64_t i, const std::byte* chunk) {
  const Record& r = epoch.records[i];
  if (r.rows == 0 || r.cols == 0) return std::string();
  Counters& counters = GlobalCounters();
  const int64_t itemsize = epoch.itemsize;
  const bool accumulate = r.kind == kOpAccumulate && !epoch.slot_puts;
  const std::byte* origin = chunk + r.offset * itemsize;
  MPI_Aint disp = static_cast<MPI_Aint>((r.row0 * r.ld + r.col0) * itemsize);
  if (epoch.notified != nullptr) disp += SlotDisplacement(*epoch.notified, r.target);
  RmaIssueStep issuing(epoch.private_comm);
  const int rc = IssueRect(
      r.rows, r.cols, r.ld, itemsize, disp, epoch.mpi_type,
      [&](int64_t origin_units, int64_t count, MPI_Aint target_disp, MPI_Datatype target_type,
          int64_t target_count) {
        const void* src = origin + origin_units * itemsize;
        if (accumulate) {
          return MPI_Accumulate(src, static_cast<int>(count), epoch.mpi_type,
                                static_cast<int>(r.target), target_disp,
                                static_cast<int>(target_count), target_type, MPI_SUM, epoch.win);
        }
        return MPI_Put(src, static_cast<int>(count), epoch.mpi_type, static_cast<int>(r.target),
                       target_disp, static_cast<int>(target_count), target_type, epoch.win);
      });
  if (rc != MPI_SUCCESS) {
    return MpiError(rc, std::string("osmm_reduce: ") + (accumulate ? "MPI_Accumulate" : "MPI_Put"))
        .message();
  }
  const int64_t bytes = r.rows * r.cols * itemsize;
  counters.rma_ops.fetch_add(1, std::memory_order_relaxed);
  counters.rma_bytes.fetch_add(bytes, std::memory_order_relaxed);
  counters.sent_bytes.fetch_add(bytes, std::memory_order_relaxed);
  (accumulate ? counters.accumulates : counters.puts).fetch_add(1, std::memory_order_relaxed);
  return std::string();
}

// Hands chunk `index` to the issuer thread (async epochs) or issues it now. Returns an empty
// string, or what failed (synchronous issue only; the issuer reports at Drain).
std::string SubmitChunk(BufferOps& ops, ReduceEpoch* epoch, int64_t index,
                        const ffi::AnyBuffer& chunk) {
  const std::byte* data = nullptr;
  if (ffi::Error err =
          ops.RmaSource(epoch->key, chunk.untyped_data(), static_cast<int64_t>(chunk.size_bytes()),
                        epoch->chunk_starts[index], &data);
      err.failure()) {
    return err.message();
  }
  if (!epoch->async) return IssueChunk(*epoch, index, data);
  // The chunk buffer stays alive until osmm_reduce_finish, which takes it as an operand (and
  // the staging copy until the next start on this communicator, after this epoch's finish).
  GlobalIssuer().Submit([epoch, index, data] { return IssueChunk(*epoch, index, data); });
  return std::string();
}

bool SameDims(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  auto dx = x.dimensions();
  auto dy = y.dimensions();
  return dx.size() == dy.size() && std::equal(dx.begin(), dx.end(), dy.begin());
}

// Opens the fence epoch of a reduce on the reduce window of `private_comm` (collective):
// fills in the epoch's window and header; a local problem with the window goes to *local.
ffi::Error OpenFenceEpoch(BufferOps& ops, MPI_Comm private_comm, int64_t window_bytes,
                          ReduceEpoch* epoch, ffi::Error* local) {
  {
    WindowLease lease;
    if (ffi::Error err = AcquireWindow(private_comm, WindowSlot::kReduce, window_bytes, &lease,
                                       ops.window_memory());
        err.failure()) {
      return err;
    }
    *local = ops.UseWindow(lease);
    epoch->win = lease.win();
    epoch->window_base = lease.base();
    epoch->window_bytes = lease.bytes();
    epoch->header = lease.header();
    epoch->header_win = lease.header_win();
    epoch->header_disp = lease.header_disp();
  }
  epoch->header[WindowHeader::kCallId] = epoch->call_id;
  epoch->header[WindowHeader::kCallNumber] = epoch->number;
  // NOPRECEDE: the previous epoch on this window ended with a NOSUCCEED fence, and the
  // agreement has just synchronised the ranks, so MPI may skip another barrier.
  return FenceWithHeader(epoch->win, epoch->header_win, private_comm, MPI_MODE_NOPRECEDE,
                         "osmm_reduce_start: opening MPI_Win_fence");
}

}  // namespace

std::string IssueChunk(ReduceEpoch& epoch, int64_t index, const std::byte* chunk) {
  const int64_t first = index == 0 ? 0 : epoch.chunk_ends[index - 1];
  const int64_t last = epoch.chunk_ends[index];
  if (epoch.notified != nullptr) epoch.chunk_data[index] = chunk;
  if (epoch.notified != nullptr && epoch.notified->spec.messages) {
    // Every target's message leaves once its last chunk is here.
    if (index + 1 < static_cast<int64_t>(epoch.chunk_ends.size())) return std::string();
    return SendImages(*epoch.notified, ImageOf(epoch));
  }
  for (int64_t i = first; i < last; ++i) {
    if (epoch.notified != nullptr && !MayDeliverNow(*epoch.notified, epoch.records[i].target)) {
      epoch.deferred.emplace_back(index, i);
      continue;
    }
    if (std::string problem = IssueRecord(epoch, i, chunk); !problem.empty()) return problem;
  }
  return std::string();
}

ffi::Error FinishNotifiedEpoch(BufferOps& ops, ReduceEpoch* epoch, const std::string& problem,
                               bool abandoned, const void* local, void* out, std::string* failure) {
  auto deliver = [epoch](int64_t target) {
    if (epoch->notified->spec.messages)
      return StageImage(*epoch->notified, target, ImageOf(*epoch));
    for (const auto& [chunk, record] : epoch->deferred) {
      if (epoch->records[record].target != target) continue;
      std::string problem = IssueRecord(*epoch, record, epoch->chunk_data[chunk]);
      if (!problem.empty()) return problem;
    }
    return std::string();
  };
  return FinishNotified(ops, *epoch->notified, deliver, problem, abandoned, epoch->dtype, local,
                        out, epoch->local_elements, failure);
}

namespace {

// osmm_reduce_start, or with `deferred_local` (this rank's whole C block) its deferred form.
ffi::Error StartReduce(BufferOps& ops, const ffi::AnyBuffer& chunk,
                       const ffi::AnyBuffer* deferred_local, ffi::Result<ffi::AnyBuffer> ticket,
                       int64_t comm_handle, int64_t call_id, int64_t window_bytes,
                       int64_t local_elements, int64_t overlap, ffi::Span<const int64_t> transfers,
                       ffi::Span<const int64_t> chunk_ends, ffi::Span<const int64_t> chunk_sizes,
                       ffi::Span<const int64_t> notify) {
  CallComm call;
  if (ffi::Error err = OpenCall("osmm_reduce_start", comm_handle, &call); err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckUsable(call.comm); err.failure()) return err;
  if (ffi::Error err = CloseAbandonedReduce(ops, CommKey(call.comm)); err.failure()) return err;
  const int64_t number = BeginCall(CallKind::kReduce, call_id);
  CallScope call_scope;  // released once the epoch is open: the finish ends the call

  // Local checks of every chunk's records, before anything moves.
  const ffi::DataType dtype = chunk.element_type();
  ReduceEpoch epoch;
  std::string problem;
  if (dtype == ffi::DataType::F32) {
    epoch.mpi_type = MPI_FLOAT;
  } else if (dtype == ffi::DataType::F64) {
    epoch.mpi_type = MPI_DOUBLE;
  } else {
    problem = "unsupported dtype (osmm_reduce handles float32 and float64)";
  }
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(dtype));
  // The fence mode reduces into the window itself; the notified mode's slots are checked
  // against the block by ParseNotifySpec (in placement a slot holds one origin's part only).
  const bool fence_mode = notify.size() == 0;
  if (problem.empty() && (chunk.dimensions().size() != 1 || ticket->element_count() != 1)) {
    problem = "expected a 1-D chunk and a one-element ticket";
  } else if (problem.empty() &&
             (window_bytes < 0 || local_elements < 0 ||
              (fence_mode && local_elements > window_bytes / std::max<int64_t>(1, itemsize)))) {
    problem = "the local C block (" + std::to_string(local_elements) +
              " elements) does not fit the " + std::to_string(window_bytes) + "-byte window";
  } else if (problem.empty() &&
             (chunk_ends.size() == 0 || chunk_ends.size() != chunk_sizes.size() ||
              chunk_sizes[0] != static_cast<int64_t>(chunk.element_count()))) {
    problem = "chunk_ends and chunk_sizes must describe the chunks, the first being this one";
  }
  NotifySpec spec;
  if (problem.empty()) {
    int rank = 0;
    MPI_Comm_rank(call.comm, &rank);
    problem =
        ParseNotifySpec(notify, rank, call.size, window_bytes, local_elements * itemsize, &spec);
    if (problem.empty() && spec.enabled() && ops.WindowMemoryKind() != 0) {
      problem =
          "the notified mode needs host windows, not device memory (CUDA-aware MPI): use "
          "OSMM_SYNC=fence";
    }
  }
  if (problem.empty() && deferred_local != nullptr &&
      (!spec.enabled() || chunk_sizes.size() != 1 || overlap != 0 ||
       deferred_local->element_type() != dtype ||
       static_cast<int64_t>(deferred_local->element_count()) != local_elements)) {
    problem =
        "a deferred reduce needs the notified mode, one chunk sent from the calling thread and "
        "this rank's whole C block";
  }
  // A notified record must fit its slot, and go to a target the spec names.
  const int64_t record_window = spec.enabled() ? spec.slot_bytes : window_bytes;
  int64_t previous_end = 0;
  int64_t staging_bytes = 0;
  for (size_t c = 0; c < chunk_ends.size() && problem.empty(); ++c) {
    const int64_t end = chunk_ends[c];
    if (end < previous_end ||
        end * static_cast<int64_t>(kRecordLength) > static_cast<int64_t>(transfers.size()) ||
        chunk_sizes[c] < 0) {
      problem = "chunk " + std::to_string(c) + " has a bad record range or size";
      break;
    }
    ffi::Span<const int64_t> part(transfers.begin() + previous_end * kRecordLength,
                                  static_cast<size_t>((end - previous_end) * kRecordLength));
    problem = ValidateRecords(part, "transfers", kOpCount, call.size, chunk_sizes[c], itemsize,
                              record_window, [](int64_t) { return int64_t{0}; });
    for (size_t i = 0; i < RecordCount(part) && problem.empty() && spec.enabled(); ++i) {
      const int64_t target = RecordAt(part, i).target;
      if (!std::binary_search(spec.targets.begin(), spec.targets.end(), target)) {
        problem = "notify: a record goes to rank " + std::to_string(target) +
                  ", which is not among the targets";
      }
    }
    previous_end = end;
    epoch.chunk_starts.push_back(staging_bytes);
    int64_t chunk_bytes = 0;
    if (problem.empty() && (!MulOk(chunk_sizes[c], itemsize, &chunk_bytes) ||
                            !AddOk(staging_bytes, chunk_bytes, &staging_bytes))) {
      problem = "chunk " + std::to_string(c) + " is too large";
    }
  }
  if (problem.empty() && previous_end * static_cast<int64_t>(kRecordLength) !=
                             static_cast<int64_t>(transfers.size())) {
    problem = "records after the last chunk";
  }
  const uint64_t key = CommKey(call.comm);
  if (problem.empty()) problem = ops.PrepareCall(key, Staging::kChunks, staging_bytes);
  const int64_t memory_kind = ops.WindowMemoryKind();
  MPI_Comm private_comm = MPI_COMM_NULL;
  const uint64_t signature = Signature()
                                 .Add(call_id)
                                 .Add(chunk)
                                 .Add(window_bytes)
                                 .Add(local_elements)
                                 .Add(transfers)
                                 .Add(chunk_ends)
                                 .Add(chunk_sizes)
                                 .Add(memory_kind)
                                 .Add(notify)
                                 .value();  // not whether it defers: ranks decide alone
  if (ffi::Error err = Agree(call.comm, "osmm_reduce_start", call_id, problem,
                             {{"window_bytes", window_bytes}, {"window memory kind", memory_kind}},
                             signature, &private_comm);
      err.failure()) {
    return err;
  }
  // The communicator's deferred reduces share its windows and notification state.
  if (deferred_local == nullptr) DrainDeferred(private_comm);

  // Every rank accepted its records.
  MPI_Comm_rank(private_comm, &epoch.rank);
  epoch.size = call.size;
  epoch.call_id = call_id;
  epoch.number = number;
  epoch.peer[0] = call_id;
  epoch.key = key;
  epoch.private_comm = private_comm;
  epoch.dtype = dtype;
  epoch.itemsize = itemsize;
  epoch.local_elements = local_elements;
  epoch.async = overlap != 0;
  for (size_t i = 0; i < RecordCount(transfers); ++i)
    epoch.records.push_back(RecordAt(transfers, i));
  epoch.chunk_ends.assign(chunk_ends.begin(), chunk_ends.end());
  epoch.chunk_sizes.assign(chunk_sizes.begin(), chunk_sizes.end());
  ffi::Error local = ffi::Error::Success();
  if (spec.enabled()) {
    // No epoch to open: the slots window stays locked (notify.h).
    std::string inconsistent;
    if (ffi::Error err = ResolvePositions(private_comm, signature, local_elements * itemsize, &spec,
                                          &inconsistent);
        err.failure()) {
      return err;
    }
    if (spec.messages) {
      if (ffi::Error err = LearnShapes(private_comm, signature, epoch.records, &spec);
          err.failure()) {
        return err;
      }
    }
    if (inconsistent.empty()) inconsistent = CheckSlotExtents(spec, epoch.records, itemsize);
    if (!inconsistent.empty()) {
      // Deliver nothing (every target is told of the failure): no usable slot position.
      spec.positions.assign(spec.targets.size(), 0);
      spec.bases.assign(spec.targets.size(), 0);
      local = ffi::Error::Internal(inconsistent);
    }
    epoch.notified = std::make_unique<NotifiedReduce>();
    if (ffi::Error err = OpenNotified(ops, private_comm, spec, call_id, window_bytes,
                                      epoch.notified.get(), &local);
        err.failure()) {
      return err;
    }
    epoch.win = epoch.notified->slot_win;
    epoch.window_base = epoch.notified->slot_base;
    epoch.window_bytes = window_bytes;
    epoch.chunk_data.assign(chunk_sizes.size(), nullptr);
    epoch.slot_puts = !CommUsesNetwork(private_comm) && DisjointPerTarget(epoch.records);
  } else if (ffi::Error err = OpenFenceEpoch(ops, private_comm, window_bytes, &epoch, &local);
             err.failure()) {
    return err;
  }
  epoch.start_time = MPI_Wtime();
  epoch.next_chunk = 1;
  if (deferred_local != nullptr) {
    // The waiter drives MPI's progress itself while it waits.
    if (local.failure()) epoch.problem = local.message();
    return DeferReduce(ops, std::make_unique<ReduceEpoch>(std::move(epoch)), chunk, *deferred_local,
                       ticket);
  }
  epoch.progress = call.size > 1 && WantsProgress(CommUsesNetwork(private_comm));
  ReduceEpoch* open = nullptr;
  {
    EpochTable& t = Epochs();
    std::lock_guard<std::mutex> lock(t.mu);
    t.open.emplace_back(key, std::make_unique<ReduceEpoch>(std::move(epoch)));
    open = t.open.back().second.get();
  }
  if (open->progress) BeginProgress(open->private_comm);
  call_scope.Release();
  if (open->size > 1 && open->notified == nullptr) {
    // The next rank's header, to check at the finish that it runs this call too.
    RmaIssueStep issuing(open->private_comm);
    open->peer_rc = MPI_Get(open->peer, 2, MPI_INT64_T, (open->rank + 1) % open->size,
                            open->header_disp, 2, MPI_INT64_T, open->header_win);
  }
  // Kept even if issuing fails: the finish must still close the epoch on every rank.
  open->problem = local.success() ? SubmitChunk(ops, open, 0, chunk) : local.message();
  if (open->problem.empty()) {
    if (ffi::Error err = ops.WriteTicket(ticket->untyped_data(), 0); err.failure()) {
      open->problem = err.message();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error ReduceStart(BufferOps& ops, ffi::AnyBuffer chunk, ffi::Result<ffi::AnyBuffer> ticket,
                       int64_t comm_handle, int64_t call_id, int64_t window_bytes,
                       int64_t local_elements, int64_t overlap, ffi::Span<const int64_t> transfers,
                       ffi::Span<const int64_t> chunk_ends, ffi::Span<const int64_t> chunk_sizes,
                       ffi::Span<const int64_t> notify) {
  return StartReduce(ops, chunk, nullptr, ticket, comm_handle, call_id, window_bytes,
                     local_elements, overlap, transfers, chunk_ends, chunk_sizes, notify);
}

ffi::Error ReduceStartDeferred(BufferOps& ops, ffi::AnyBuffer chunk, ffi::AnyBuffer local,
                               ffi::Result<ffi::AnyBuffer> ticket, int64_t comm_handle,
                               int64_t call_id, int64_t window_bytes, int64_t local_elements,
                               ffi::Span<const int64_t> transfers,
                               ffi::Span<const int64_t> chunk_ends,
                               ffi::Span<const int64_t> chunk_sizes,
                               ffi::Span<const int64_t> notify) {
  return StartReduce(ops, chunk, &local, ticket, comm_handle, call_id, window_bytes, local_elements,
                     0, transfers, chunk_ends, chunk_sizes, notify);
}

ffi::Error ReduceIssue(BufferOps& ops, ffi::AnyBuffer chunk, ffi::Result<ffi::AnyBuffer> ticket,
                       int64_t comm_handle, int64_t index) {
  ReduceEpoch* epoch = nullptr;
  if (ffi::Error err = OpenEpochCall("osmm_reduce_issue", comm_handle, &*ticket, &epoch);
      err.failure()) {
    return err;
  }
  // Inconsistencies are reported by the finish, which every rank reaches: an early return
  // here would leave the other ranks waiting in the closing fence.
  if (!epoch->problem.empty()) return ffi::Error::Success();
  if (ffi::Error err = ops.WriteTicket(ticket->untyped_data(), static_cast<int32_t>(index));
      err.failure()) {
    epoch->problem = err.message();
    return ffi::Error::Success();
  }
  if (index != epoch->next_chunk || index >= static_cast<int64_t>(epoch->chunk_sizes.size()) ||
      chunk.element_type() != epoch->dtype ||
      static_cast<int64_t>(chunk.element_count()) != epoch->chunk_sizes[index]) {
    epoch->problem = "osmm_reduce_issue: chunk " + std::to_string(index) +
                     " does not match the chunks osmm_reduce_start validated; nothing more sent";
    return ffi::Error::Success();
  }
  epoch->next_chunk = index + 1;
  epoch->problem = SubmitChunk(ops, epoch, index, chunk);
  return ffi::Error::Success();
}

ffi::Error ReduceFinish(BufferOps& ops, ffi::AnyBuffer local, ffi::Result<ffi::AnyBuffer> out,
                        int64_t comm_handle, int64_t local_offset) {
  ReduceEpoch* epoch = nullptr;
  if (ffi::Error err = OpenEpochCall("osmm_reduce_finish", comm_handle, nullptr, &epoch);
      err.failure()) {
    return err;
  }
  CallScope call_scope;
  if (TakeInjectedFailure("osmm_reduce_finish")) {
    return ffi::Error::Internal("osmm_reduce_finish: injected failure (test hook)");
  }
  std::string problem = epoch->async ? GlobalIssuer().Drain() : std::string();
  if (problem.empty()) problem = epoch->problem;
  if (problem.empty() && epoch->next_chunk != static_cast<int64_t>(epoch->chunk_sizes.size())) {
    problem = "osmm_reduce_finish: " + std::to_string(epoch->next_chunk) + " of " +
              std::to_string(epoch->chunk_sizes.size()) + " chunks were issued";
  }
  const int64_t n = epoch->local_elements;
  const int64_t count = static_cast<int64_t>(local.element_count());
  const bool inside = local_offset != kLocalIsBlock;  // the block inside a larger buffer
  if (problem.empty() &&
      (local.element_type() != epoch->dtype || out->element_type() != epoch->dtype ||
       (inside ? local_offset < 0 || local_offset + n > count : count != n) ||
       !SameDims(local, *out))) {
    problem = "osmm_reduce_finish: local and out must match the epoch's dtype and C block";
  }
  // This rank's block inside local and out (only computed where the check above passed).
  const int64_t skip = problem.empty() && inside ? local_offset * epoch->itemsize : 0;
  const std::byte* local_block = static_cast<const std::byte*>(local.untyped_data()) + skip;
  std::byte* out_block = static_cast<std::byte*>(out->untyped_data()) + skip;
  if (epoch->notified != nullptr) {
    if (epoch->progress) EndProgress();  // the finish drives progress itself while it waits
    std::string failure;
    ffi::Error err = FinishNotifiedEpoch(ops, epoch, problem, false, local_block,
                                         problem.empty() ? out_block : nullptr, &failure);
    RecordEpochLatency(MPI_Wtime() - epoch->start_time);
    ForgetEpoch(epoch->key);
    if (err.failure()) return err;
    if (!problem.empty()) return ffi::Error::Internal(problem);
    if (!failure.empty()) return ffi::Error::Internal(failure);
    return ffi::Error::Success();
  }
  // The closing fence makes progress itself.
  if (epoch->progress) EndProgress();
  const double closing_start = MPI_Wtime();
  ffi::Error closing =
      FenceWithHeader(epoch->win, epoch->header_win, epoch->private_comm, MPI_MODE_NOSUCCEED,
                      "osmm_reduce_finish: closing MPI_Win_fence");
  // What the closing fence waited (for other ranks, and for transfers still in flight).
  GlobalCounters().closing_fence_ns.fetch_add(
      static_cast<int64_t>((MPI_Wtime() - closing_start) * 1e9), std::memory_order_relaxed);
  RecordEpochLatency(MPI_Wtime() - epoch->start_time);
  std::byte* received = epoch->window_base;
  const int64_t window_bytes = epoch->window_bytes;
  const ffi::DataType dtype = epoch->dtype;
  const MPI_Comm private_comm = epoch->private_comm;
  std::string out_of_step;
  if (closing.success()) {
    const int64_t abandoned = epoch->header[WindowHeader::kAbandoned];
    epoch->header[WindowHeader::kAbandoned] = 0;
    if (abandoned != 0 && problem.empty()) {
      problem = "osmm_reduce_finish: rank " + std::to_string(abandoned - 1) +
                " abandoned this product (an error stopped its program between the start and "
                "the finish of the reduce; its own error says which); this rank's result would "
                "be incomplete and was discarded. The next product runs normally.";
    } else if (abandoned == 0 && epoch->peer_rc == MPI_SUCCESS &&
               epoch->peer[0] != epoch->call_id) {
      out_of_step = OutOfStep("osmm_reduce", epoch->rank, epoch->number, epoch->call_id,
                              (epoch->rank + 1) % epoch->size, epoch->peer[1], epoch->peer[0]);
    }
  }
  if (problem.empty() && epoch->peer_rc != MPI_SUCCESS) {
    problem = MpiError(epoch->peer_rc, "osmm_reduce_start: MPI_Get (peer header)").message();
  }
  ForgetEpoch(epoch->key);
  if (!problem.empty() || !out_of_step.empty()) {
    // Restore the all-zero invariant whatever arrived.
    if (ffi::Error err = ops.ZeroWindow(received, window_bytes); err.failure()) {
      problem += "; clearing the window failed too: " + err.message();
    }
    if (!out_of_step.empty()) return Desynchronised(private_comm, out_of_step);
    return ffi::Error::Internal(problem);
  }
  if (closing.failure()) return closing;
  return ops.AddWindowInto(dtype, local_block, received, out_block, n);
}

ffi::Error CloseAbandonedReduce(BufferOps& ops, uint64_t comm_key) {
  ReduceEpoch* epoch = FindEpoch(comm_key);
  if (epoch == nullptr) return ffi::Error::Success();
  if (epoch->async) GlobalIssuer().Drain();
  if (epoch->notified != nullptr) {
    // Notified: the targets hear of it through the failed bit of this rank's stamps.
    if (epoch->progress) EndProgress();
    std::string failure;
    ffi::Error err = FinishNotifiedEpoch(ops, epoch, "abandoned", true, nullptr, nullptr, &failure);
    ForgetEpoch(comm_key);
    EndCall();
    return err;
  }
  // The marker must stay valid until the closing fence below has completed.
  const int64_t marker = epoch->rank + 1;
  int rc = MPI_SUCCESS;
  const MPI_Aint disp = epoch->header_disp + 8 * WindowHeader::kAbandoned;
  for (int target = 0; target < epoch->size && rc == MPI_SUCCESS; ++target) {
    if (target == epoch->rank) continue;
    RmaIssueStep issuing(epoch->private_comm);
    rc = MPI_Accumulate(&marker, 1, MPI_INT64_T, target, disp, 1, MPI_INT64_T, MPI_REPLACE,
                        epoch->header_win);
  }
  if (epoch->progress) EndProgress();
  ffi::Error closing =
      FenceWithHeader(epoch->win, epoch->header_win, epoch->private_comm, MPI_MODE_NOSUCCEED,
                      "closing an abandoned reduce epoch: MPI_Win_fence");
  ffi::Error cleared = ops.ZeroWindow(epoch->window_base, epoch->window_bytes);
  epoch->header[WindowHeader::kAbandoned] = 0;
  ForgetEpoch(comm_key);
  EndCall();
  if (rc != MPI_SUCCESS) return MpiError(rc, "closing an abandoned reduce epoch: MPI_Accumulate");
  if (closing.failure()) return closing;
  return cleared;
}

}  // namespace osmm
