// The osmm_allreduce target: an element-wise sum over a communicator inside the XLA program,
// for the allreduce method and checksum verification when mpi4jax is not installed (or
// OSMM_ALLREDUCE=native). MPI_Iallreduce over the native layer's private duplicate of the
// communicator, waited for like osmm_jax's own collectives: the watchdog bounds it in both
// modes, and in raise mode a timeout fails the call instead of ending the job.
#ifndef OSMM_JAX_XLA_FFI_ALLREDUCE_H_
#define OSMM_JAX_XLA_FFI_ALLREDUCE_H_

#include <cstdint>

#include "core/common.h"

namespace osmm {

// out = the sum of `in` over every rank of the communicator `comm_handle` (host memory; `in`
// and `out` may be the same buffer). F32, F64, S32 and S64 only.
ffi::Error AllreduceSum(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int64_t comm_handle);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_ALLREDUCE_H_
