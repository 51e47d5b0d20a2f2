// The FFI signature of every target, shared by all platforms. A platform's binding starts with
// its own context (e.g. the CUDA stream) and appends one of these, so the handlers of every
// platform take the same operands, results and attributes, in the same order:
//
//   osmm_fetch          (a, b, token) -> (fetched, token)
//   osmm_reduce_start   (chunk 0, token) -> (ticket, token)
//   osmm_reduce_issue   (chunk i, token) -> (ticket, token)
//   osmm_reduce_finish  (local, token, every chunk...) -> (out, token)
//   osmm_reduce_start_deferred   (chunk, local, token) -> (ticket, token)          (CPU only)
//   osmm_reduce_finish_deferred  (ticket) -> out, asynchronous, no token          (CPU only)
//   osmm_watch          (marker, token) -> (marker, token)
//   osmm_allreduce      (x, token) -> (sum of x over the ranks, token)   (CPU only)
//
// The token is the ordered-effect token that XLA threads through them, so they run in program
// order on every rank. The deferred finish (deferred.h) is off that chain: its ticket links
// it to its start, and it returns a future.
#ifndef OSMM_JAX_XLA_FFI_SIGNATURES_H_
#define OSMM_JAX_XLA_FFI_SIGNATURES_H_

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace osmm {

template <typename Binding>
auto FetchSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // a
      .template Arg<ffi::AnyBuffer>()  // b
      .template Arg<ffi::Token>()      // ordering token in
      .template Ret<ffi::AnyBuffer>()  // fetched
      .template Ret<ffi::Token>()      // ordering token out
      .template Attr<int64_t>("comm")
      .template Attr<int64_t>("call_id")
      .template Attr<int64_t>("window_bytes")
      .template Attr<int64_t>("b_offset")
      .template Attr<int64_t>("expose_a")
      .template Attr<int64_t>("expose_b")
      .template Attr<ffi::Span<const int64_t>>("gets");
}

template <typename Binding>
auto ReduceStartSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // chunk 0
      .template Arg<ffi::Token>()      // ordering token in
      .template Ret<ffi::AnyBuffer>()  // ticket
      .template Ret<ffi::Token>()      // ordering token out
      .template Attr<int64_t>("comm")
      .template Attr<int64_t>("call_id")
      .template Attr<int64_t>("window_bytes")
      .template Attr<int64_t>("local_elements")
      .template Attr<int64_t>("overlap")
      .template Attr<ffi::Span<const int64_t>>("transfers")
      .template Attr<ffi::Span<const int64_t>>("chunk_ends")
      .template Attr<ffi::Span<const int64_t>>("chunk_sizes")
      .template Attr<ffi::Span<const int64_t>>("notify");  // empty: fence mode (notify.h)
}

template <typename Binding>
auto ReduceIssueSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // chunk `index`
      .template Arg<ffi::Token>()      // ordering token in
      .template Ret<ffi::AnyBuffer>()  // ticket
      .template Ret<ffi::Token>()      // ordering token out
      .template Attr<int64_t>("comm")
      .template Attr<int64_t>("index");
}

template <typename Binding>
auto ReduceFinishSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // local
      .template Arg<ffi::Token>()      // ordering token in
      .RemainingArgs()                 // every chunk, kept alive
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::Token>()      // ordering token out
      .template Attr<int64_t>("comm")
      .template Attr<int64_t>("local_offset");  // where the C block starts in local and out
}

template <typename Binding>
auto ReduceStartDeferredSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // chunk (the only one)
      .template Arg<ffi::AnyBuffer>()  // this rank's whole local C block
      .template Arg<ffi::Token>()      // ordering token in
      .template Ret<ffi::AnyBuffer>()  // ticket
      .template Ret<ffi::Token>()      // ordering token out
      .template Attr<int64_t>("comm")
      .template Attr<int64_t>("call_id")
      .template Attr<int64_t>("window_bytes")
      .template Attr<int64_t>("local_elements")
      .template Attr<ffi::Span<const int64_t>>("transfers")
      .template Attr<ffi::Span<const int64_t>>("chunk_ends")
      .template Attr<ffi::Span<const int64_t>>("chunk_sizes")
      .template Attr<ffi::Span<const int64_t>>("notify");
}

template <typename Binding>
auto ReduceFinishDeferredSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()   // ticket
      .template Ret<ffi::AnyBuffer>();  // out
}

// Brackets a collective that osmm_jax does not issue itself (begin = 1, then 0): see Watch in
// watchdog.h. The marker is a scalar passed through, so the call has a buffer to return.
template <typename Binding>
auto WatchSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // marker
      .template Arg<ffi::Token>()      // ordering token in
      .template Ret<ffi::AnyBuffer>()  // marker, unchanged
      .template Ret<ffi::Token>()      // ordering token out
      .template Attr<int64_t>("comm")
      .template Attr<int64_t>("begin");
}

// The native all-reduce (allreduce.h). The output is written over x (aliased by the lowering).
template <typename Binding>
auto AllreduceSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::Token>()      // ordering token in
      .template Ret<ffi::AnyBuffer>()  // the sum
      .template Ret<ffi::Token>()      // ordering token out
      .template Attr<int64_t>("comm");
}

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_SIGNATURES_H_
