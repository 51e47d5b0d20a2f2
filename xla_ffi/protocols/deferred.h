// Deferred finishes: a notified reduce whose wait runs beside the rest of the program.
//
// A synchronous osmm_reduce_finish waits for the other ranks' deliveries on the thread XLA runs
// it on, and sits on the ordered token chain, so the next product's start waits for it and the
// computation queued behind it on that thread waits too. A deferred reduce instead hands its
// epoch, at the end of its start (osmm_reduce_start_deferred), to a waiter thread of its
// communicator: the waiter issues what the start could not (a slot still busy), sends the
// stamps, waits for this rank's origins and forms the sum, exactly as FinishNotified does on
// the calling thread, in the same order, so the sum is the same bit for bit. The finish
// (osmm_reduce_finish_deferred) is off the token chain and asynchronous: it returns an
// xla::ffi::Future at once, completed (on a thread of its own, so that the computation XLA
// continues with does not hold the waiter) when the waiter has the sum; only what reads the
// sum waits for it.
//
// The start copies its chunk and this rank's complete local block: nothing XLA owns is read
// after the start returns. A deferred reduce therefore completes its part of the protocol even
// if its finish never runs (its program failed in between): the other ranks' products are
// not disturbed, and the result waits, uncollected, until DropUncollected.
//
// A communicator's deferred reduces complete in the order they started. Any other call on the
// communicator (a synchronous reduce, a fetch, a notified reduce that must create or grow a
// window or start the ranks again) first waits until its waiter has none pending
// (DrainDeferred): the waiter shares the communicator's windows and notification state.
#ifndef OSMM_JAX_XLA_FFI_DEFERRED_H_
#define OSMM_JAX_XLA_FFI_DEFERRED_H_

#include <cstdint>
#include <memory>

#include "core/buffer_ops.h"
#include "core/common.h"
#include "protocols/reduce_epoch.h"

namespace osmm {

// Takes `epoch`, a notified reduce of one chunk whose start has validated and agreed, issues
// its chunk from a copy of `chunk` and queues it on its communicator's waiter with a copy of
// `local` (this rank's whole partial C block). Writes the reduce's ticket (which the finish
// names) into `ticket`. A problem the start found (`epoch->problem`) is reported by the
// finish, after the other ranks have been told (their stamps carry it).
ffi::Error DeferReduce(BufferOps& ops, std::unique_ptr<ReduceEpoch> epoch,
                       const ffi::AnyBuffer& chunk, const ffi::AnyBuffer& local,
                       ffi::Result<ffi::AnyBuffer> ticket);

// The finish of the deferred reduce `ticket`: a future completed once its sum is in `out` (or
// failed with the reduce's error).
ffi::Future CollectDeferred(const ffi::AnyBuffer& ticket, ffi::Result<ffi::AnyBuffer> out);

// Waits until the waiter of `private_comm` has no deferred reduce pending. No-op otherwise.
void DrainDeferred(MPI_Comm private_comm);

// DrainDeferred on every communicator (before windows are freed).
void DrainAllDeferred();

// Forgets the results of every deferred reduce whose finish has not run (their programs
// failed between the start and the finish); those still pending are forgotten when they end.
// Returns how many. release_windows calls it (after jax.effects_barrier(): every program is
// over, so no finish will come for them).
int64_t DropUncollected();

// Deferred reduces and fetches this rank holds: started and not yet handed to their finish,
// or handed to a finish that waits for them. 0 whenever no program runs, unless a program
// failed between a start and its finish (it stopped before the finish could run) and
// DropUncollected has not run since.
int64_t HeldDeferred();

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_DEFERRED_H_
