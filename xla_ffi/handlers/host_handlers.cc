// The CPU platform's handlers (HostBufferOps: host_buffer_ops.h). The starts take the XLA run
// id (RunScope, common.h): which program run a notified product belongs to.
#include <cstring>

#include "core/buffer_ops.h"
#include "core/host_buffer_ops.h"
#include "handlers/handlers.h"
#include "handlers/signatures.h"
#include "protocols/allreduce.h"
#include "protocols/deferred.h"
#include "protocols/fetch.h"
#include "protocols/reduce.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

ffi::Error FetchHost(ffi::RunId run, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Token,
                     ffi::Result<ffi::AnyBuffer> fetched, ffi::Result<ffi::Token>, int64_t comm,
                     int64_t call_id, int64_t window_bytes, int64_t b_offset, int64_t expose_a,
                     int64_t expose_b, ffi::Span<const int64_t> gets) {
  HostBufferOps ops;
  RunScope scope(run.run_id);
  return Fetch(ops, a, b, fetched, comm, call_id, window_bytes, b_offset, expose_a, expose_b, gets);
}

ffi::Error ReduceStartHost(ffi::RunId run, ffi::AnyBuffer chunk, ffi::Token,
                           ffi::Result<ffi::AnyBuffer> ticket, ffi::Result<ffi::Token>,
                           int64_t comm, int64_t call_id, int64_t window_bytes,
                           int64_t local_elements, int64_t overlap,
                           ffi::Span<const int64_t> transfers, ffi::Span<const int64_t> chunk_ends,
                           ffi::Span<const int64_t> chunk_sizes, ffi::Span<const int64_t> notify) {
  HostBufferOps ops;
  RunScope scope(run.run_id);
  return ReduceStart(ops, chunk, ticket, comm, call_id, window_bytes, local_elements, overlap,
                     transfers, chunk_ends, chunk_sizes, notify);
}

ffi::Error ReduceStartDeferredHost(ffi::RunId run, ffi::AnyBuffer chunk, ffi::AnyBuffer local,
                                   ffi::Token, ffi::Result<ffi::AnyBuffer> ticket,
                                   ffi::Result<ffi::Token>, int64_t comm, int64_t call_id,
                                   int64_t window_bytes, int64_t local_elements,
                                   ffi::Span<const int64_t> transfers,
                                   ffi::Span<const int64_t> chunk_ends,
                                   ffi::Span<const int64_t> chunk_sizes,
                                   ffi::Span<const int64_t> notify) {
  HostBufferOps ops;
  RunScope scope(run.run_id);
  return ReduceStartDeferred(ops, chunk, local, ticket, comm, call_id, window_bytes, local_elements,
                             transfers, chunk_ends, chunk_sizes, notify);
}

ffi::Future ReduceFinishDeferredHost(ffi::AnyBuffer ticket, ffi::Result<ffi::AnyBuffer> out) {
  return CollectDeferred(ticket, out);
}

ffi::Error ReduceIssueHost(ffi::AnyBuffer chunk, ffi::Token, ffi::Result<ffi::AnyBuffer> ticket,
                           ffi::Result<ffi::Token>, int64_t comm, int64_t index) {
  HostBufferOps ops;
  return ReduceIssue(ops, chunk, ticket, comm, index);
}

// The remaining operands are the chunk buffers: taking them keeps XLA from reusing their
// memory while the issuer thread may still be reading them.
ffi::Error ReduceFinishHost(ffi::AnyBuffer local, ffi::Token, ffi::RemainingArgs,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Token>, int64_t comm,
                            int64_t local_offset) {
  HostBufferOps ops;
  return ReduceFinish(ops, local, out, comm, local_offset);
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
                              osmm::FetchSignature(xla::ffi::Ffi::Bind().Ctx<xla::ffi::RunId>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OsmmReduceStart, osmm::ReduceStartHost,
    osmm::ReduceStartSignature(xla::ffi::Ffi::Bind().Ctx<xla::ffi::RunId>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceIssue, osmm::ReduceIssueHost,
                              osmm::ReduceIssueSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceFinish, osmm::ReduceFinishHost,
                              osmm::ReduceFinishSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmAllreduce, osmm::AllreduceHost,
                              osmm::AllreduceSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    OsmmReduceStartDeferred, osmm::ReduceStartDeferredHost,
    osmm::ReduceStartDeferredSignature(xla::ffi::Ffi::Bind().Ctx<xla::ffi::RunId>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceFinishDeferred, osmm::ReduceFinishDeferredHost,
                              osmm::ReduceFinishDeferredSignature(xla::ffi::Ffi::Bind()));
