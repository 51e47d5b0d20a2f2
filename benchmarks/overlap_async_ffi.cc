// Stand-ins for a reduce start / finish pair, to see how XLA:CPU schedules a finish that waits:
// synchronously (the handler blocks its thread, as osmm_reduce_finish does today) or
// asynchronously (the handler returns an xla::ffi::Future that a thread of its own completes).
// Built and loaded by benchmarks/overlap_probe.py (probe "async"); not part of osmm_jax.
//
//   probe_start(x) -> s32[]        returns at once; the wait "arrives" `delay_ms` later
//   probe_finish_sync(x, t) -> x   blocks until then, then copies x to the result
//   probe_finish_async(x, t) -> x  returns a Future at once; a thread completes it then
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::chrono::steady_clock::time_point g_arrival;  // when the "delivery" is complete

ffi::Error Start(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> ticket, int64_t delay_ms) {
  g_arrival = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
  *static_cast<int32_t*>(ticket->untyped_data()) = 0;
  return ffi::Error::Success();
}

ffi::Error FinishSync(ffi::AnyBuffer x, ffi::AnyBuffer ticket, ffi::Result<ffi::AnyBuffer> out) {
  std::this_thread::sleep_until(g_arrival);
  std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

ffi::Future FinishAsync(ffi::AnyBuffer x, ffi::AnyBuffer ticket, ffi::Result<ffi::AnyBuffer> out) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const void* src = x.untyped_data();
  void* dst = out->untyped_data();
  const size_t bytes = x.size_bytes();
  const auto arrival = g_arrival;
  std::thread([promise, src, dst, bytes, arrival]() mutable {
    std::this_thread::sleep_until(arrival);
    std::memcpy(dst, src, bytes);
    promise.SetAvailable();
  }).detach();
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ProbeStart, Start,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("delay_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ProbeFinishSync, FinishSync,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    ProbeFinishAsync, FinishAsync,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
