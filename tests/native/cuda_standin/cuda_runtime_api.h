// A host stand-in for the CUDA runtime calls that xla_ffi/cuda/cuda_ops.cc and
// xla_ffi/cuda/cuda_kernels.h use (and the few more the test driver needs), so that cuda_ops.cc
// compiles unchanged and runs on a machine without a GPU (tests/native/cuda_ops_driver.cc). Put
// this directory first on the include path; it replaces the toolkit's header of the same name.
//
// Not an emulator, but strict where a GPU would be:
//   - "Device memory" (cudaMalloc) is host memory the stand-in keeps track of, filled with a
//     poison byte. A copy whose cudaMemcpyKind does not match where its pointers are, or that
//     runs past the end of an allocation, or a kernel or device memset on host memory, is
//     refused with an error (and a line on stderr).
//   - Stream work that touches only device and pinned host memory (cudaHostAlloc,
//     cudaHostRegister) is queued and runs at cudaStreamSynchronize (or at a synchronising call:
//     cudaMemcpy, cudaMemset, cudaFree, cudaFreeHost, cudaStreamDestroy), as on a GPU it
//     completes only then: a missing synchronisation leaves stale bytes behind. Copies from or to
//     pageable memory run at once, after the queued work, as CUDA's are synchronous for the host.
//   - Registering memory twice, or unregistering or freeing what was not allocated, is an error.
#ifndef OSMM_JAX_TESTS_NATIVE_CUDA_STANDIN_CUDA_RUNTIME_API_H_
#define OSMM_JAX_TESTS_NATIVE_CUDA_STANDIN_CUDA_RUNTIME_API_H_

#include <cstddef>
#include <cstdint>

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorIllegalAddress = 700,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

#define cudaHostAllocPortable 0x01
#define cudaHostRegisterPortable 0x01

const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetLastError();
cudaError_t cudaSetDevice(int device);  // one device: 0

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);

cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int flags);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaHostRegister(void* ptr, size_t bytes, unsigned int flags);
cudaError_t cudaHostUnregister(void* ptr);

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemset(void* ptr, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream);

// What the stand-in saw, for the driver's checks (not part of CUDA).
namespace cuda_standin {

struct Stats {
  int64_t copies[4] = {0, 0, 0, 0};  // cudaMemcpy(Async) calls, by cudaMemcpyKind
  int64_t queued = 0;                // stream operations that waited for a synchronisation
  int64_t adds = 0;                  // LaunchAdd kernels (cuda_kernels.h)
  int64_t registrations = 0;         // successful cudaHostRegister calls
  int64_t refused = 0;               // calls refused (wrong memory, bad pointer, bad device)
  int64_t live_registered = 0;       // ranges registered now
  int64_t live_pinned = 0;           // cudaHostAlloc allocations alive now
  int64_t live_device = 0;           // cudaMalloc allocations alive now
};

Stats GetStats();

}  // namespace cuda_standin

#endif  // OSMM_JAX_TESTS_NATIVE_CUDA_STANDIN_CUDA_RUNTIME_API_H_
