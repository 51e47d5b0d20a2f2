// The CPU handlers of osmm_jax (registered from Python for platform "cpu", api_version 1):
// the platform-independent handlers of fetch.h and reduce.h over host buffers, and the
// native all-reduce of allreduce.h. Their FFI
// signatures are in signatures.h.
#ifndef OSMM_JAX_XLA_FFI_HANDLERS_H_
#define OSMM_JAX_XLA_FFI_HANDLERS_H_

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceIssue);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceFinish);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmFetch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmWatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmAllreduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceStartDeferred);
XLA_FFI_DECLARE_HANDLER_SYMBOL(OsmmReduceFinishDeferred);

#endif  // OSMM_JAX_XLA_FFI_HANDLERS_H_
