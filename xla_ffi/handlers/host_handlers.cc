// The CPU platform: XLA:CPU buffers are host memory, so RMA reads and writes them directly
// and every copy is a memcpy.
#include <cstring>

#include "core/buffer_ops.h"
#include "handlers/handlers.h"
#include "handlers/signatures.h"
#include "protocols/allreduce.h"
#include "protocols/fetch.h"
#include "protocols/reduce.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

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

ffi::Error FetchHost(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Token,
                     ffi::Result<ffi::AnyBuffer> fetched, ffi::Result<ffi::Token>, int64_t comm,
                     int64_t call_id, int64_t window_bytes, int64_t b_offset, int64_t expose_a,
                     int64_t expose_b, ffi::Span<const int64_t> gets) {
  HostBufferOps ops;
  return Fetch(ops, a, b, fetched, comm, call_id, window_bytes, b_offset, expose_a, expose_b, gets);
}

ffi::Error ReduceStartHost(ffi::AnyBuffer chunk, ffi::Token, ffi::Result<ffi::AnyBuffer> ticket,
                           ffi::Result<ffi::Token>, int64_t comm, int64_t call_id,
                           int64_t window_bytes, int64_t local_elements, int64_t overlap,
                           ffi::Span<const int64_t> transfers, ffi::Span<const int64_t> chunk_ends,
                           ffi::Span<const int64_t> chunk_sizes, ffi::Span<const int64_t> notify) {
  HostBufferOps ops;
  return ReduceStart(ops, chunk, ticket, comm, call_id, window_bytes, local_elements, overlap,
                     transfers, chunk_ends, chunk_sizes, notify);
}

ffi::Error ReduceIssueHost(ffi::AnyBuffer chunk, ffi::Token, ffi::Result<ffi::AnyBuffer> ticket,
                           ffi::Result<ffi::Token>, int64_t comm, int64_t index) {
  HostBufferOps ops;
  return ReduceIssue(ops, chunk, ticket, comm, index);
}

// The remaining operands are the chunk buffers: taking them keeps XLA from reusing their
// memory while the issuer thread may still be reading them.
ffi::Error ReduceFinishHost(ffi::AnyBuffer local, ffi::Token, ffi::RemainingArgs,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Token>,
                            int64_t comm) {
  HostBufferOps ops;
  return ReduceFinish(ops, local, out, comm);
}

ffi::Error WatchHost(ffi::AnyBuffer marker, ffi::Token, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Token>, int64_t comm, int64_t begin) {
  Watch(comm, begin);
  if (out->untyped_data() != marker.untyped_data()) {
    std::memcpy(out->untyped_data(), marker.untyped_data(), marker.size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error AllreduceHost(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Token>, int64_t comm) {
  return AllreduceSum(x, out, comm);
}

}  // namespace
}  // namespace osmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmWatch, osmm::WatchHost,
                              osmm::WatchSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmFetch, osmm::FetchHost,
                              osmm::FetchSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceStart, osmm::ReduceStartHost,
                              osmm::ReduceStartSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceIssue, osmm::ReduceIssueHost,
                              osmm::ReduceIssueSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceFinish, osmm::ReduceFinishHost,
                              osmm::ReduceFinishSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmAllreduce, osmm::AllreduceHost,
                              osmm::AllreduceSignature(xla::ffi::Ffi::Bind()));
