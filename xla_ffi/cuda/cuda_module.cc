// The nanobind module osmm_jax._src.runtime._osmm_ffi_cuda: the handlers for XLA's GPU buffers
// (registered from Python for platform "CUDA", api_version 1), on the native core shared with
// the CPU module (libosmm_core: windows, agreement, RMA, counters).
//
// Each handler takes XLA's stream and device ordinal, and builds a CudaBufferOps over them for
// the platform-independent handler of fetch.h / reduce.h. They are registered WITHOUT the
// command-buffer-compatible trait, deliberately: XLA may capture compatible custom calls into a
// CUDA graph and replay only their stream work, while these handlers do their real work on the
// host (fences, RMA, the issuer thread) and synchronise the stream in between.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <string>

#include "cuda/cuda_ops.h"
#include "handlers/registrations.h"
#include "handlers/signatures.h"
#include "protocols/fetch.h"
#include "protocols/reduce.h"
#include "watchdog/watchdog.h"

namespace nb = nanobind;

namespace osmm {
namespace cuda {
namespace {

ffi::Error FetchCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::Token, ffi::Result<ffi::AnyBuffer> fetched, ffi::Result<ffi::Token>,
                     int64_t comm, int64_t call_id, int64_t window_bytes, int64_t b_offset,
                     int64_t expose_a, int64_t expose_b, ffi::Span<const int64_t> gets) {
  CudaBufferOps ops(stream, device, nullptr);
  return Fetch(ops, a, b, fetched, comm, call_id, window_bytes, b_offset, expose_a, expose_b, gets);
}

ffi::Error ReduceStartCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer chunk, ffi::Token,
                           ffi::Result<ffi::AnyBuffer> ticket, ffi::Result<ffi::Token>,
                           int64_t comm, int64_t call_id, int64_t window_bytes,
                           int64_t local_elements, int64_t overlap,
                           ffi::Span<const int64_t> transfers, ffi::Span<const int64_t> chunk_ends,
                           ffi::Span<const int64_t> chunk_sizes, ffi::Span<const int64_t> notify) {
  CudaBufferOps ops(stream, device, nullptr);
  return ReduceStart(ops, chunk, ticket, comm, call_id, window_bytes, local_elements, overlap,
                     transfers, chunk_ends, chunk_sizes, notify);
}

ffi::Error ReduceIssueCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer chunk, ffi::Token,
                           ffi::Result<ffi::AnyBuffer> ticket, ffi::Result<ffi::Token>,
                           int64_t comm, int64_t index) {
  CudaBufferOps ops(stream, device, nullptr);
  return ReduceIssue(ops, chunk, ticket, comm, index);
}

// The remaining operands are the chunk buffers: taking them keeps XLA from reusing their
// memory while the issuer thread may still be sending from them (CUDA-aware mode).
ffi::Error ReduceFinishCuda(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                            ffi::AnyBuffer local, ffi::Token, ffi::RemainingArgs,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Token>, int64_t comm,
                            int64_t local_offset) {
  CudaBufferOps ops(stream, device, &scratch);
  return ReduceFinish(ops, local, out, comm, local_offset);
}

// The marker is a device scalar: it is aliased to the result (see the lowering), so nothing is
// copied; the stream is not touched.
ffi::Error WatchCuda(cudaStream_t, int32_t, ffi::AnyBuffer, ffi::Token, ffi::Result<ffi::AnyBuffer>,
                     ffi::Result<ffi::Token>, int64_t comm, int64_t begin) {
  Watch(comm, begin);
  return ffi::Error::Success();
}

auto CudaBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

}  // namespace
}  // namespace cuda
}  // namespace osmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmFetchCuda, osmm::cuda::FetchCuda,
                              osmm::FetchSignature(osmm::cuda::CudaBinding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceStartCuda, osmm::cuda::ReduceStartCuda,
                              osmm::ReduceStartSignature(osmm::cuda::CudaBinding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceIssueCuda, osmm::cuda::ReduceIssueCuda,
                              osmm::ReduceIssueSignature(osmm::cuda::CudaBinding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OsmmReduceFinishCuda, osmm::cuda::ReduceFinishCuda,
    osmm::ReduceFinishSignature(osmm::cuda::CudaBinding().Ctx<xla::ffi::ScratchAllocator>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmWatchCuda, osmm::cuda::WatchCuda,
                              osmm::WatchSignature(osmm::cuda::CudaBinding()));

namespace {

nb::dict Registrations() {
  return osmm::HandlerRegistrations(OsmmFetchCuda, OsmmReduceStartCuda, OsmmReduceIssueCuda,
                                    OsmmReduceFinishCuda, OsmmWatchCuda);
}

}  // namespace

// The module's name comes from the build (_osmm_ffi_cuda, or _osmm_ffi_cuda_openmpi for a wheel's
// second MPI ABI: CMakeLists.txt, OSMM_MPI_ABI).
#ifndef OSMM_FFI_CUDA_MODULE
#define OSMM_FFI_CUDA_MODULE _osmm_ffi_cuda
#endif

NB_MODULE(OSMM_FFI_CUDA_MODULE, m) {
  m.doc() = "Native layer of osmm_jax for XLA:GPU buffers (CUDA).";
  m.def("registrations", &Registrations,
        "Dict of FFI target name -> capsule, for jax.ffi.register_ffi_target (CUDA, api 1).");
  m.def(
      "free_staging",
      [] {
        nb::gil_scoped_release release;
        osmm::cuda::FreeStaging();
      },
      "Free the pinned host staging buffers (after free_windows, at exit).");
  m.def("mpi_cuda_support", &osmm::cuda::MpiCudaSupport,
        "MPIX_Query_cuda_support() of this MPI: 1, 0, or -1 if the MPI lacks the function.");
  m.def("cuda_aware_requested", &osmm::cuda::CudaAwareRequested,
        "Whether OSMM_CUDA_AWARE=1 asked for windows in GPU memory (read once per process).");
  m.attr("CUDART_VERSION") = CUDART_VERSION;
}
