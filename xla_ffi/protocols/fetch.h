// osmm_fetch, for any platform: expose this rank's A and B blocks in a persistent window and
// MPI_Get the sub-blocks this rank needs from the other ranks.
//
// One fence epoch per call: local window setup, MPI_Win_fence, gets, MPI_Win_fence, local use
// of the fetched data. Records: see records.h; agreement: agreement.h.
#ifndef OSMM_JAX_XLA_FFI_FETCH_H_
#define OSMM_JAX_XLA_FFI_FETCH_H_

#include <cstdint>

#include "core/buffer_ops.h"
#include "core/common.h"

namespace osmm {

ffi::Error Fetch(BufferOps& ops, ffi::AnyBuffer a, ffi::AnyBuffer b,
                 ffi::Result<ffi::AnyBuffer> fetched, int64_t comm_handle, int64_t call_id,
                 int64_t window_bytes, int64_t b_offset, int64_t expose_a, int64_t expose_b,
                 ffi::Span<const int64_t> gets);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_FETCH_H_
