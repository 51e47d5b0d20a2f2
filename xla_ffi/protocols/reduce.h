// osmm_reduce_start / osmm_reduce_issue / osmm_reduce_finish, for any platform: send partial C
// blocks, chunk by chunk, to their owners with MPI_Accumulate / MPI_Put into the owners'
// persistent "reduce" windows, then out = local + received.
//
// The reduce is one fence epoch spread over several calls, so that communication overlaps the
// GEMMs XLA runs between them: the start validates every chunk's records, agrees, opens the
// epoch and issues chunk 0; an issue issues chunk i; the finish waits for the issuer, closes
// the epoch and adds what arrived to the local block. With "overlap" set the chunks are issued
// by a background thread (issuer.h) and the calls return at once; the finish takes every chunk
// buffer as an operand, so XLA keeps them alive until the transfers are done. Every rank runs
// one start and one finish per product (chunk counts may differ). The closing fence completes
// every operation on every rank, so no state carries over between products except the window
// contents described in windows.h. Records: see records.h; agreement: agreement.h.
#ifndef OSMM_JAX_XLA_FFI_REDUCE_H_
#define OSMM_JAX_XLA_FFI_REDUCE_H_

#include <cstdint>

#include "core/buffer_ops.h"
#include "core/common.h"

namespace osmm {

ffi::Error ReduceStart(BufferOps& ops, ffi::AnyBuffer chunk, ffi::Result<ffi::AnyBuffer> ticket,
                       int64_t comm_handle, int64_t call_id, int64_t window_bytes,
                       int64_t local_elements, int64_t overlap, ffi::Span<const int64_t> transfers,
                       ffi::Span<const int64_t> chunk_ends, ffi::Span<const int64_t> chunk_sizes,
                       ffi::Span<const int64_t> notify);

// The deferred form (deferred.h): a notified reduce of one chunk, with this rank's whole C
// block `local` (complete at the start), finished by its communicator's waiter; the ticket
// names it to osmm_reduce_finish_deferred (CollectDeferred).
ffi::Error ReduceStartDeferred(BufferOps& ops, ffi::AnyBuffer chunk, ffi::AnyBuffer local,
                               ffi::Result<ffi::AnyBuffer> ticket, int64_t comm_handle,
                               int64_t call_id, int64_t window_bytes, int64_t local_elements,
                               ffi::Span<const int64_t> transfers,
                               ffi::Span<const int64_t> chunk_ends,
                               ffi::Span<const int64_t> chunk_sizes,
                               ffi::Span<const int64_t> notify);

ffi::Error ReduceIssue(BufferOps& ops, ffi::AnyBuffer chunk, ffi::Result<ffi::AnyBuffer> ticket,
                       int64_t comm_handle, int64_t index);

// `local_offset` of ReduceFinish when `local` and `out` are exactly this rank's C block.
inline constexpr int64_t kLocalIsBlock = -1;

// With `local_offset` >= 0, `local` and `out` hold this rank's C block from that element on,
// so that a block is summed in place inside a larger buffer (a staged plan's whole C,
// runtime/gather.py); the rest of `out` is `local`'s.
ffi::Error ReduceFinish(BufferOps& ops, ffi::AnyBuffer local, ffi::Result<ffi::AnyBuffer> out,
                        int64_t comm_handle, int64_t local_offset = kLocalIsBlock);

// Closes a reduce epoch still open on the communicator with key `comm_key` (CommKey of the
// caller's communicator) because its finish never ran on this rank: an error stopped this
// rank's program between the start and the finish. The other ranks wait in the closing fence
// of their finish; this rank marks the epoch abandoned in every rank's window header and
// closes the fence with them, so their finish fails ("rank r abandoned this product") instead
// of returning a partial sum, and every rank is in step again. Clears the window. Every
// collective call on a communicator runs this first; nothing happens when no epoch is open.
ffi::Error CloseAbandonedReduce(BufferOps& ops, uint64_t comm_key);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_REDUCE_H_
