// The state of one reduce between its start and its finish (reduce.h), shared by the
// synchronous finish (reduce.cc) and the deferred one (deferred.h).
#ifndef OSMM_JAX_XLA_FFI_REDUCE_EPOCH_H_
#define OSMM_JAX_XLA_FFI_REDUCE_EPOCH_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer_ops.h"
#include "core/common.h"
#include "core/records.h"
#include "notified/messages.h"
#include "notified/notify.h"

namespace osmm {

// One reduce from its start to its finish. A synchronous epoch is the one open epoch of its
// communicator (the ordered token chain runs a communicator's start, issues and finish strictly
// in program order, so it is never touched by two calls at once); a deferred one belongs to its
// communicator's waiter (deferred.h) from the end of its start.
struct ReduceEpoch {
  uint64_t key = 0;  // CommKey of the user's communicator
  MPI_Comm private_comm = MPI_COMM_NULL;
  MPI_Win win = MPI_WIN_NULL;
  std::byte* window_base = nullptr;
  int64_t window_bytes = 0;
  ffi::DataType dtype = ffi::DataType::F32;
  MPI_Datatype mpi_type = MPI_DATATYPE_NULL;
  int64_t itemsize = 0;
  int64_t local_elements = 0;
  bool async = false;
  bool progress = false;              // the progress poller runs for this epoch (issuer.h)
  bool slot_puts = false;             // notified: accumulates into slots sent as puts
  std::vector<Record> records;        // every chunk's records, chunk by chunk
  std::vector<int64_t> chunk_ends;    // records of chunk i: [chunk_ends[i-1], chunk_ends[i])
  std::vector<int64_t> chunk_sizes;   // elements of each chunk's buffer
  std::vector<int64_t> chunk_starts;  // byte offset of each chunk in the chunk staging
  int64_t next_chunk = 0;
  std::string problem;  // a local inconsistency found after the epoch opened
  double start_time = 0.0;
  int rank = 0;
  int size = 1;
  int64_t call_id = 0;
  int64_t number = 0;                 // this call's number on this rank (watchdog.h)
  int64_t* header = nullptr;          // the window's header (WindowHeader)
  MPI_Win header_win = MPI_WIN_NULL;  // the window holding it (windows.h)
  MPI_Aint header_disp = 0;           // and its byte displacement there
  int64_t peer[2] = {0, 0};           // the next rank's header: its call id and number
  int peer_rc = MPI_SUCCESS;          // MPI_Get of `peer`; not issued: peer[0] stays call_id
  // The notified mode (notify.h), or null for the fence mode. Deliveries whose slot was not
  // free when their chunk was issued wait in `deferred` (chunk, record) for the finish.
  std::unique_ptr<NotifiedReduce> notified;
  std::vector<std::pair<int64_t, int64_t>> deferred;
  std::vector<const std::byte*> chunk_data;  // each issued chunk's RMA memory
};

// Where the message transport finds the epoch's records and chunks (messages.h).
inline ImageSource ImageOf(const ReduceEpoch& epoch) {
  return ImageSource{epoch.records, epoch.chunk_ends, epoch.chunk_data, epoch.dtype,
                     epoch.slot_puts};
}

// Issues one chunk's accumulates and puts from `chunk` (RMA memory holding its contents); in
// the notified mode, those to a target whose slot is not free yet are deferred to the finish.
// Returns an empty string, or which MPI call failed.
std::string IssueChunk(ReduceEpoch& epoch, int64_t index, const std::byte* chunk);

// The end of a notified epoch (notify.h, FinishNotified): its deferred deliveries, its stamps,
// and `local` plus what its origins delivered into `out`; `abandoned` with a null `out` closes
// an abandoned one.
ffi::Error FinishNotifiedEpoch(BufferOps& ops, ReduceEpoch* epoch, const std::string& problem,
                               bool abandoned, const void* local, void* out, std::string* failure);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_REDUCE_EPOCH_H_
