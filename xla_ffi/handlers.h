// XLA FFI handlers of osmm_jax (registered from Python for platform "cpu", api_version 1).
//
//   osmm_reduce_start, osmm_reduce_issue, osmm_reduce_finish: send partial C blocks, chunk by
//                chunk, to their owners with MPI_Accumulate / MPI_Put into the owners'
//                persistent "reduce" windows, then out = local + received.
//   osmm_fetch:  expose this rank's A and B blocks in a persistent window and MPI_Get the
//                sub-blocks this rank needs from the other ranks.
//
// All take an ordered-effect token (osmm_reduce_finish: as its second operand, the others: as
// their last) and return one as their last result, so XLA runs them in program order on every
// rank.
#ifndef OSMM_JAX_XLA_FFI_HANDLERS_H_
#define OSMM_JAX_XLA_FFI_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceIssue);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceFinish);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmFetch);

#endif  // OSMM_JAX_XLA_FFI_HANDLERS_H_
