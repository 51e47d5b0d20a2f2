// The one kernel the CUDA handlers need (cuda_kernels.cu, compiled by nvcc; kept free of MPI
// and XLA headers).
#ifndef OSMM_JAX_XLA_FFI_CUDA_KERNELS_H_
#define OSMM_JAX_XLA_FFI_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace osmm {
namespace cuda {

// out[i] = local[i] + add[i] for i < n, on `stream`, for float (double_precision false) or
// double. `out` may alias `local`. Returns the launch's error.
cudaError_t LaunchAdd(bool double_precision, const void* local, const void* add, void* out,
                      int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_CUDA_KERNELS_H_
