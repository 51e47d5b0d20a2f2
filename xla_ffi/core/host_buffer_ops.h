// The CPU platform's buffer operations: XLA:CPU buffers are host memory, so RMA reads and
// writes them directly and every copy is a memcpy.
#ifndef OSMM_JAX_XLA_FFI_HOST_BUFFER_OPS_H_
#define OSMM_JAX_XLA_FFI_HOST_BUFFER_OPS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/buffer_ops.h"
#include "core/common.h"

namespace osmm {

class HostBufferOps final : public BufferOps {
 public:
  ffi::Error CopyToWindow(std::byte* dst, const void* src, int64_t bytes) override {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return ffi::Error::Success();
  }
  ffi::Error RmaSource(uint64_t, const void* src, int64_t, int64_t,
                       const std::byte** out) override {
    *out = static_cast<const std::byte*>(src);
    return ffi::Error::Success();
  }
  ffi::Error RmaDestination(uint64_t, void* dst, int64_t, std::byte** out) override {
    *out = static_cast<std::byte*>(dst);
    return ffi::Error::Success();
  }
  ffi::Error FinishRmaDestination(void*, const std::byte*, int64_t) override {
    return ffi::Error::Success();
  }
  ffi::Error AddWindowInto(ffi::DataType dtype, const void* local, std::byte* window, void* out,
                           int64_t n) override {
    if (dtype == ffi::DataType::F32) {
      AddAndClear(static_cast<const float*>(local), reinterpret_cast<float*>(window),
                  static_cast<float*>(out), n);
    } else {
      AddAndClear(static_cast<const double*>(local), reinterpret_cast<double*>(window),
                  static_cast<double*>(out), n);
    }
    return ffi::Error::Success();
  }
  ffi::Error WriteTicket(void* ticket, int32_t value) override {
    *static_cast<int32_t*>(ticket) = value;
    return ffi::Error::Success();
  }
  ffi::Error ZeroWindow(std::byte* window, int64_t bytes) override {
    std::memset(window, 0, static_cast<size_t>(bytes));
    return ffi::Error::Success();
  }

 private:
  // out = local + received, then received = 0.
  template <typename T>
  static void AddAndClear(const T* local, T* received, T* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = local[i] + received[i];
      received[i] = T(0);
    }
  }
};

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_HOST_BUFFER_OPS_H_
