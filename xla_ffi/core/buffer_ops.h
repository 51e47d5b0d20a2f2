// The platform seam: the memory operations a handler performs on XLA's buffers.
//
// The MPI part of every handler (records, agreement, windows, RMA, fences) is the same on
// every platform and lives in fetch.cc and reduce.cc. What differs is where XLA's buffers are
// and how bytes get between them and the memory MPI reads and writes ("RMA memory"):
//
//   HostBufferOps (host_handlers.cc): XLA:CPU buffers are host memory; RMA reads and writes
//       them directly, copies are memcpy.
//   CudaBufferOps (cuda_ops.cc): XLA:GPU buffers are device memory, used on XLA's stream.
//       Host-staged (default): RMA memory is host memory (the windows, pinned, and pinned
//       staging buffers); copies run on XLA's stream, which is synchronised before MPI
//       touches the bytes. CUDA-aware (opt-in): windows live in device memory and RMA reads
//       and writes device memory directly.
#ifndef OSMM_JAX_XLA_FFI_BUFFER_OPS_H_
#define OSMM_JAX_XLA_FFI_BUFFER_OPS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/common.h"
#include "core/windows.h"

namespace osmm {

// Staging areas a platform may keep per communicator, by purpose.
enum class Staging : int {
  kChunks = 0,   // the reduce's chunk buffers, all chunks of one epoch side by side
  kFetched = 1,  // the fetch's destination
};

class BufferOps {
 public:
  virtual ~BufferOps() = default;

  // Why this platform cannot run the call (e.g. CUDA-aware MPI requested but not available),
  // or an empty string. Checked with the records, before the agreement, so that it is every
  // rank's error rather than one rank's.
  virtual std::string Unusable() const { return std::string(); }

  // The memory of this platform's windows: nullptr for MPI_Win_allocate host memory.
  virtual WindowMemory* window_memory() { return nullptr; }

  // Called with every window a call uses, before the call's first copy into or out of it.
  virtual ffi::Error UseWindow(const WindowLease&) { return ffi::Error::Success(); }

  // Makes sure staging `what` of communicator `comm_key` holds at least `bytes` bytes. Local;
  // called before the agreement, so that a failure is every rank's error.
  virtual ffi::Error ReserveStaging(uint64_t, Staging, int64_t) { return ffi::Error::Success(); }

  // Copies `bytes` bytes of the XLA buffer `src` into window memory at `dst`.
  virtual ffi::Error CopyToWindow(std::byte* dst, const void* src, int64_t bytes) = 0;

  // RMA memory that holds the contents of the XLA buffer `src` (`bytes` bytes) for RMA to
  // read: `src` itself, or a copy at byte `offset` of staging kChunks (then complete when
  // this returns).
  virtual ffi::Error RmaSource(uint64_t comm_key, const void* src, int64_t bytes, int64_t offset,
                               const std::byte** out) = 0;

  // RMA memory that RMA may write the new contents of the XLA buffer `dst` into (`dst`
  // itself, or staging kFetched); FinishRmaDestination then makes them `dst`'s contents.
  virtual ffi::Error RmaDestination(uint64_t comm_key, void* dst, int64_t bytes,
                                    std::byte** out) = 0;
  virtual ffi::Error FinishRmaDestination(void* dst, const std::byte* rma, int64_t bytes) = 0;

  // out = local + window over `n` elements of `dtype` (float32 or float64), then clears those
  // elements of the window. Element-wise, so `out` may alias `local`.
  virtual ffi::Error AddWindowInto(ffi::DataType dtype, const void* local, std::byte* window,
                                   void* out, int64_t n) = 0;

  // Stores `value` in the one-element int32 XLA buffer `ticket`.
  virtual ffi::Error WriteTicket(void* ticket, int32_t value) = 0;

  // Sets `bytes` bytes of window memory to zero.
  virtual ffi::Error ZeroWindow(std::byte* window, int64_t bytes) = 0;

  // The last local checks of a call before the agreement: the platform can run it, and
  // staging `what` of communicator `comm_key` holds `bytes` bytes. The first problem, or "".
  std::string PrepareCall(uint64_t comm_key, Staging what, int64_t bytes) {
    std::string problem = Unusable();
    if (problem.empty()) {
      if (ffi::Error err = ReserveStaging(comm_key, what, bytes); err.failure()) {
        problem = err.message();
      }
    }
    return problem;
  }

  // The kind of window_memory() that every rank must agree on (0: MPI_Win_allocate memory).
  int64_t WindowMemoryKind() {
    WindowMemory* memory = window_memory();
    return memory == nullptr ? 0 : memory->kind();
  }
};

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_BUFFER_OPS_H_
