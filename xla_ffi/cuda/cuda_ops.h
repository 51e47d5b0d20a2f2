// The CUDA platform: BufferOps over XLA:GPU buffers, used on XLA's stream.
//
// Host-staged (default): device partials are copied on XLA's stream into persistent pinned host
// memory (the windows themselves, registered with cudaHostRegister, and staging buffers from
// cudaHostAlloc), the stream is synchronised, RMA runs on host windows exactly as on the CPU,
// and received data is copied back on the same stream. Works with any MPI.
//
// CUDA-aware (OSMM_CUDA_AWARE=1): windows are created over device memory (cudaMalloc +
// MPI_Win_create) and RMA reads and writes device memory directly; each window's header (call
// ids, the abandoned-epoch mark) stays in a small host window of its own (windows.h), so a
// product another rank abandoned fails here as on the host. Needs an MPI that reports
// CUDA support (MPIX_Query_cuda_support); otherwise every call fails with a clear error.
//
// Every handler synchronises XLA's stream before MPI touches a buffer XLA wrote, and before it
// returns: MPI is not stream-ordered. That is also why none of these handlers may be captured
// into a CUDA graph (XLA command buffers): a graph replays the stream work but not the host
// side (fences, RMA, the issuer thread), so they are registered without the
// command-buffer-compatible trait.
#ifndef OSMM_JAX_XLA_FFI_CUDA_OPS_H_
#define OSMM_JAX_XLA_FFI_CUDA_OPS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "core/buffer_ops.h"

namespace osmm {
namespace cuda {

// MPIX_Query_cuda_support() of the MPI this process runs: 1 or 0, or -1 when the MPI has no
// such function.
int MpiCudaSupport();

// Whether OSMM_CUDA_AWARE=1 asks for windows in device memory (read once per process).
bool CudaAwareRequested();

class CudaBufferOps final : public BufferOps {
 public:
  // `scratch`: XLA's scratch allocator of this call, needed by AddWindowInto in host-staged
  // mode; may be null for calls that do not add.
  CudaBufferOps(cudaStream_t stream, int32_t device, ffi::ScratchAllocator* scratch);

  std::string Unusable() const override;
  WindowMemory* window_memory() override;
  ffi::Error UseWindow(const WindowLease& lease) override;
  ffi::Error ReserveStaging(uint64_t comm_key, Staging what, int64_t bytes) override;
  ffi::Error CopyToWindow(std::byte* dst, const void* src, int64_t bytes) override;
  ffi::Error RmaSource(uint64_t comm_key, const void* src, int64_t bytes, int64_t offset,
                       const std::byte** out) override;
  ffi::Error RmaDestination(uint64_t comm_key, void* dst, int64_t bytes, std::byte** out) override;
  ffi::Error FinishRmaDestination(void* dst, const std::byte* rma, int64_t bytes) override;
  ffi::Error AddWindowInto(ffi::DataType dtype, const void* local, std::byte* window, void* out,
                           int64_t n) override;
  ffi::Error WriteTicket(void* ticket, int32_t value) override;
  ffi::Error ZeroWindow(std::byte* window, int64_t bytes) override;

 private:
  // Copies `bytes` on the stream, then synchronises it; counted as staging.
  ffi::Error Copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, const char* what);
  ffi::Error Sync(const char* what);

  cudaStream_t stream_;
  ffi::ScratchAllocator* scratch_;
  bool aware_;
  std::string unusable_;
};

// Frees every staging buffer (pinned host memory). Called at exit, with the windows.
void FreeStaging();

}  // namespace cuda
}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_CUDA_OPS_H_
