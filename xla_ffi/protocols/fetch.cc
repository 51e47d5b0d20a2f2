#include "protocols/fetch.h"

#include <mpi.h>

#include <string>

#include "core/agreement.h"
#include "core/counters.h"
#include "core/records.h"
#include "core/rma.h"
#include "core/windows.h"
#include "protocols/deferred.h"
#include "protocols/reduce.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

bool FetchDtypeSupported(ffi::DataType dtype) {
  return dtype == ffi::DataType::F32 || dtype == ffi::DataType::F64 ||
         dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
}

bool IsDims(const ffi::AnyBuffer& buffer, size_t rank) {
  return buffer.dimensions().size() == rank;
}

}  // namespace

ffi::Error Fetch(BufferOps& ops, ffi::AnyBuffer a, ffi::AnyBuffer b,
                 ffi::Result<ffi::AnyBuffer> fetched, int64_t comm_handle, int64_t call_id,
                 int64_t window_bytes, int64_t b_offset, int64_t expose_a, int64_t expose_b,
                 ffi::Span<const int64_t> gets) {
  CallComm call;
  if (ffi::Error err = OpenCall("osmm_fetch", comm_handle, &call); err.failure()) return err;
  if (ffi::Error err = CheckUsable(call.comm); err.failure()) return err;
  if (ffi::Error err = CloseAbandonedReduce(ops, CommKey(call.comm)); err.failure()) return err;
  const int64_t number = BeginCall(CallKind::kFetch, call_id);
  CallScope call_scope;

  // Local checks.
  const ffi::DataType dtype = a.element_type();
  std::string problem;
  if (!FetchDtypeSupported(dtype)) {
    problem = "unsupported dtype (osmm_fetch handles float32, float64, bfloat16 and float16)";
  } else if (b.element_type() != dtype || fetched->element_type() != dtype) {
    problem = "a, b and fetched must share one dtype";
  } else if (!IsDims(a, 2) || !IsDims(b, 2) || !IsDims(*fetched, 1)) {
    problem = "expected 2-D a and b and a 1-D fetched";
  } else if ((expose_a != 0 && expose_a != 1) || (expose_b != 0 && expose_b != 1)) {
    problem = "expose_a and expose_b must be 0 or 1";
  } else if (window_bytes < 0 || b_offset < 0 || b_offset > window_bytes) {
    problem = "need 0 <= b_offset <= window_bytes, got b_offset " + std::to_string(b_offset) +
              " and window_bytes " + std::to_string(window_bytes);
  }
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(dtype));
  const int64_t a_bytes = static_cast<int64_t>(a.size_bytes());
  const int64_t b_bytes = static_cast<int64_t>(b.size_bytes());
  const int64_t fetched_bytes = static_cast<int64_t>(fetched->size_bytes());
  if (problem.empty() && expose_a && a_bytes > (expose_b ? b_offset : window_bytes)) {
    problem = "the A block (" + std::to_string(a_bytes) + " bytes) does not fit below " +
              (expose_b ? "the B region at byte " + std::to_string(b_offset)
                        : "the end of the " + std::to_string(window_bytes) + "-byte window");
  }
  if (problem.empty() && expose_b && b_bytes > window_bytes - b_offset) {
    problem = "the B block (" + std::to_string(b_bytes) + " bytes) at byte " +
              std::to_string(b_offset) + " does not fit the " + std::to_string(window_bytes) +
              "-byte window";
  }
  if (problem.empty()) {
    problem = ValidateRecords(
        gets, "gets", kRegionCount, call.size, static_cast<int64_t>(fetched->element_count()),
        itemsize, window_bytes,
        [b_offset](int64_t region) { return region == kRegionA ? int64_t{0} : b_offset; });
  }
  const uint64_t key = CommKey(call.comm);
  if (problem.empty()) problem = ops.PrepareCall(key, Staging::kFetched, fetched_bytes);
  const int64_t memory_kind = ops.WindowMemoryKind();
  MPI_Comm private_comm = MPI_COMM_NULL;
  const uint64_t signature = Signature()
                                 .Add(call_id)
                                 .Add(a)
                                 .Add(b)
                                 .Add(*fetched)
                                 .Add(window_bytes)
                                 .Add(b_offset)
                                 .Add(expose_a)
                                 .Add(expose_b)
                                 .Add(gets)
                                 .Add(memory_kind)
                                 .value();
  if (ffi::Error err = Agree(call.comm, "osmm_fetch", call_id, problem,
                             {{"window_bytes", window_bytes},
                              {"b_offset", b_offset},
                              {"window memory kind", memory_kind}},
                             signature, &private_comm);
      err.failure()) {
    return err;
  }
  DrainDeferred(private_comm);  // the fetch's fences must not meet a waiter's RMA calls

  // Every rank accepted its inputs: expose, then one fence epoch of gets.
  WindowLease lease;
  if (ffi::Error err = AcquireWindow(private_comm, WindowSlot::kExpose, window_bytes, &lease,
                                     ops.window_memory());
      err.failure()) {
    return err;
  }
  // Local failures from here on still take part in both fences, so no rank is left waiting.
  ffi::Error local = ops.UseWindow(lease);
  if (local.success() && expose_a && a_bytes > 0) {
    local = ops.CopyToWindow(lease.base(), a.untyped_data(), a_bytes);
  }
  if (local.success() && expose_b && b_bytes > 0) {
    local = ops.CopyToWindow(lease.base() + b_offset, b.untyped_data(), b_bytes);
  }
  std::byte* dest = nullptr;
  if (local.success()) {
    local = ops.RmaDestination(key, fetched->untyped_data(), fetched_bytes, &dest);
  }
  int rank = 0;
  MPI_Comm_rank(private_comm, &rank);
  int64_t* header = lease.header();
  header[WindowHeader::kCallId] = call_id;
  header[WindowHeader::kCallNumber] = number;
  if (ffi::Error err = FenceWithHeader(lease.win(), lease.header_win(), private_comm, 0,
                                       "osmm_fetch: opening MPI_Win_fence");
      err.failure()) {
    return err;
  }
  // The next rank's header, to check that it runs this call too.
  int64_t peer[2] = {call_id, 0};
  const int peer_rank = (rank + 1) % call.size;
  int peer_rc = MPI_SUCCESS;
  if (call.size > 1) {
    RmaIssueStep issuing(private_comm);
    peer_rc = MPI_Get(peer, 2, MPI_INT64_T, peer_rank, lease.header_disp(), 2, MPI_INT64_T,
                      lease.header_win());
  }
  const double epoch_start = MPI_Wtime();
  int rma_rc = MPI_SUCCESS;
  Counters& counters = GlobalCounters();
  for (size_t i = 0; i < RecordCount(gets) && rma_rc == MPI_SUCCESS && local.success(); ++i) {
    const Record r = RecordAt(gets, i);
    if (r.rows == 0 || r.cols == 0) continue;
    const int64_t region = r.kind == kRegionA ? 0 : b_offset;
    const MPI_Aint disp = static_cast<MPI_Aint>(region + (r.row0 * r.ld + r.col0) * itemsize);
    std::byte* origin = dest + r.offset * itemsize;
    RmaIssueStep issuing(private_comm);
    // Byte-based: any element type moves the same way.
    rma_rc = IssueRect(r.rows, r.cols * itemsize, r.ld * itemsize, 1, disp, MPI_BYTE,
                       [&](int64_t origin_bytes, int64_t count, MPI_Aint target_disp,
                           MPI_Datatype target_type, int64_t target_count) {
                         return MPI_Get(origin + origin_bytes, static_cast<int>(count), MPI_BYTE,
                                        static_cast<int>(r.target), target_disp,
                                        static_cast<int>(target_count), target_type, lease.win());
                       });
    if (rma_rc == MPI_SUCCESS) {
      counters.rma_ops.fetch_add(1, std::memory_order_relaxed);
      counters.rma_bytes.fetch_add(r.rows * r.cols * itemsize, std::memory_order_relaxed);
      counters.gets.fetch_add(1, std::memory_order_relaxed);
    }
  }
  ffi::Error closing = FenceWithHeader(lease.win(), lease.header_win(), private_comm,
                                       MPI_MODE_NOSUCCEED, "osmm_fetch: closing MPI_Win_fence");
  RecordEpochLatency(MPI_Wtime() - epoch_start);
  if (closing.success() && peer_rc == MPI_SUCCESS && peer[0] != call_id) {
    return Desynchronised(
        private_comm, OutOfStep("osmm_fetch", rank, number, call_id, peer_rank, peer[1], peer[0]));
  }
  if (peer_rc != MPI_SUCCESS) return MpiError(peer_rc, "osmm_fetch: MPI_Get (peer header)");
  if (local.failure()) return local;
  if (rma_rc != MPI_SUCCESS) return MpiError(rma_rc, "osmm_fetch: MPI_Get");
  if (closing.failure()) return closing;
  return ops.FinishRmaDestination(fetched->untyped_data(), dest, fetched_bytes);
}

}  // namespace osmm
