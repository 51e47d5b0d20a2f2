// The FFI targets a platform's extension module hands to Python, which registers them with XLA
// (osmm_jax/_src/runtime/native.py): one name per target, the same on every platform.

#ifndef OSMM_JAX_XLA_FFI_REGISTRATIONS_H_
#define OSMM_JAX_XLA_FFI_REGISTRATIONS_H_

#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace osmm {

template <typename Fn>
nanobind::capsule EncapsulateHandler(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take XLA_FFI_CallFrame* and return XLA_FFI_Error*");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// {target name: capsule} for one platform's five handlers.
template <typename Fetch, typename Start, typename Issue, typename Finish, typename Watch>
nanobind::dict HandlerRegistrations(Fetch* fetch, Start* start, Issue* issue, Finish* finish,
                                    Watch* watch) {
  nanobind::dict d;
  d["osmm_fetch"] = EncapsulateHandler(fetch);
  d["osmm_reduce_start"] = EncapsulateHandler(start);
  d["osmm_reduce_issue"] = EncapsulateHandler(issue);
  d["osmm_reduce_finish"] = EncapsulateHandler(finish);
  d["osmm_watch"] = EncapsulateHandler(watch);
  return d;
}

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_REGISTRATIONS_H_
