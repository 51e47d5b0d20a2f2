// A background thread that issues RMA operations, so that a chunk's transfers proceed while
// XLA computes the next chunk's GEMMs.
//
// osmm_reduce_start / osmm_reduce_issue hand it one job per chunk and return at once; the
// closing osmm_reduce_finish drains it before the fence that completes the epoch. Jobs run in
// submission order, one at a time. After a job fails, the rest of the epoch's jobs are skipped
// (no further RMA is issued) and Drain reports the first failure. MPI is initialised with
// MPI_THREAD_MULTIPLE, so the thread may call MPI while the caller's threads do too.
#ifndef OSMM_JAX_XLA_FFI_ISSUER_H_
#define OSMM_JAX_XLA_FFI_ISSUER_H_

#include <functional>
#include <string>

#include "common.h"

namespace osmm {

class RmaIssuer {
 public:
  // A job returns an empty string on success, else what failed.
  using Job = std::function<std::string()>;

  // Queues `job` to run after every job submitted before it; starts the thread if needed.
  void Submit(Job job);

  // Blocks until every submitted job has run. Returns the first failure since the previous
  // Drain (an empty string if none) and forgets it.
  std::string Drain();

  // Drains, then stops and joins the thread. Idempotent; a later Submit starts a new thread.
  void Stop();
};

// The process-wide issuer shared by all reduce epochs.
RmaIssuer& GlobalIssuer();

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_ISSUER_H_
