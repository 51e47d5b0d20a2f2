#include "cuda/cuda_kernels.h"

namespace osmm {
namespace cuda {
namespace {

template <typename T>
__global__ void AddKernel(const T* local, const T* add, T* out, int64_t n) {
  // `out` may alias `local`: each element is read, then written, by the same thread.
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = local[i] + add[i];
  }
}

template <typename T>
cudaError_t Launch(const void* local, const void* add, void* out, int64_t n, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  AddKernel<T><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(local), static_cast<const T*>(add), static_cast<T*>(out), n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAdd(bool double_precision, const void* local, const void* add, void* out,
                      int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (double_precision) return Launch<double>(local, add, out, n, stream);
  return Launch<float>(local, add, out, n, stream);
}

}  // namespace cuda
}  // namespace osmm
