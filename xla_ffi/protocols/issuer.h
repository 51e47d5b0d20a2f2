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

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>

#include "core/common.h"

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

// MPI progress while a reduce epoch is open.
//
// Over shared memory the origin completes MPI_Accumulate/MPI_Put by itself. Over a network
// (MPICH's OFI or UCX netmods on TCP) an accumulate is an active message that the *target*
// must process, which happens only while the target is inside MPI. A rank busy in XLA's
// GEMMs is not, so the partials it receives wait until its closing fence, and the transfer
// no longer overlaps computing. The progress poller is a thread that, while at least one
// reduce epoch is open on this process, calls MPI_Iprobe on that epoch's private
// communicator every `interval_us` microseconds (0: as fast as it can, yielding in between),
// which drives MPICH's progress engine. It sleeps on a condition variable otherwise.
enum class ProgressMode : int {
  kOff = 0,     // never poll
  kThread = 1,  // poll during every reduce epoch
  kAuto = 2,    // poll during epochs whose communicator spans more than one node
};

struct ProgressSettings {
  ProgressMode mode = ProgressMode::kOff;
  int64_t interval_us = 0;
};

void SetProgressSettings(ProgressSettings settings);
ProgressSettings GetProgressSettings();

// Whether an epoch on a communicator should be polled, by the settings in force.
// `network`: the communicator has ranks on other nodes (or on this node through the network
// module), see CommUsesNetwork in windows.h.
bool WantsProgress(bool network);

// Starts polling `comm` (an epoch on it has just opened); every Begin is matched by one End
// (before the epoch's closing fence, which makes progress itself). Polls while any epoch is
// open; starts the thread if needed.
void BeginProgress(MPI_Comm comm);
void EndProgress();

// Stops and joins the poller thread (before windows and communicators are freed).
// Idempotent; a later BeginProgress starts a new thread.
void StopProgress();

// Polls made since start (a counter for tests and benchmarks).
int64_t ProgressPolls();

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_ISSUER_H_
