// XLA FFI handlers of osmm_jax (registered from Python for platform "cpu", api_version 1).
//
//   osmm_reduce: send partial C blocks to their owners with MPI_Accumulate / MPI_Put into the
//                owners' persistent "reduce" windows, then out = local + received.
//   osmm_fetch:  expose this rank's A and B blocks in a persistent window and MPI_Get the
//                sub-blocks this rank needs from the other ranks.
//
// Both take an ordered-effect token as their last operand and return one as their last
// result, so XLA runs them in program order on every rank.
#ifndef OSMM_JAX_XLA_FFI_HANDLERS_H_
#define OSMM_JAX_XLA_FFI_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmFetch);

#endif  // OSMM_JAX_XLA_FFI_HANDLERS_H_
