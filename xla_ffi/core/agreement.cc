#include "core/agreement.h"

#include <algorithm>
#include <mutex>

#include "core/counters.h"
#include "core/windows.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

// Signatures (per communicator) that every rank has already accepted together. A signature
// starts with the call's "call_id" attribute, which the lowering makes identical on every rank
// and unique to the call (plan fingerprint, step, dtype, chunking: what determines every
// rank's attributes). So every rank meets a given id for the first time at the same call and
// records it at the same successful agreement: all ranks skip, or all ranks agree. (Local
// attributes alone would not do: two different calls can look the same on one rank and
// different on another, e.g. where it holds an empty block.) A call with a known signature
// passes the same local checks again, so its agreement is known without a collective.
bool AgreedBefore(uint64_t comm_key, uint64_t signature, bool remember) {
  static std::mutex* mu = new std::mutex();
  static auto* agreed = new std::vector<std::pair<uint64_t, uint64_t>>();
  std::lock_guard<std::mutex> lock(*mu);
  const std::pair<uint64_t, uint64_t> key(comm_key, signature);
  if (std::find(agreed->begin(), agreed->end(), key) != agreed->end()) return true;
  if (remember) agreed->push_back(key);
  return false;
}

}  // namespace

ffi::Error Agree(MPI_Comm comm, const char* op, int64_t call_id, const std::string& problem,
                 const SameValues& same, uint64_t signature, MPI_Comm* private_comm_out) {
  MPI_Comm private_comm = MPI_COMM_NULL;
  if (ffi::Error err = PrivateComm(comm, &private_comm); err.failure()) return err;
  *private_comm_out = private_comm;
  if (problem.empty() && AgreedBefore(CommKey(comm), signature, false)) {
    return ffi::Error::Success();
  }
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(private_comm, &rank);
  MPI_Comm_size(private_comm, &size);
  // MIN over: the first failing rank (size if none), then each value and its complement
  // (~x = -x - 1 reverses the order without overflow), giving the minimum and the maximum.
  std::vector<int64_t> v;
  v.reserve(3 + 2 * same.size());
  v.push_back(problem.empty() ? size : rank);
  // The call's id (identical on every rank for the same call): differing ids mean the ranks
  // run different calls.
  v.push_back(call_id);
  v.push_back(~call_id);
  for (const auto& entry : same) {
    v.push_back(entry.second);
    v.push_back(~entry.second);
  }
  GlobalCounters().agreements.fetch_add(1, std::memory_order_relaxed);
  MPI_Request request = MPI_REQUEST_NULL;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_INT64_T, MPI_MIN,
                          private_comm, &request);
  if (rc != MPI_SUCCESS) return MpiError(rc, std::string(op) + ": MPI_Iallreduce");
  if (ffi::Error err = WaitBounded(&request, private_comm, Step::kAgreement,
                                   (std::string(op) + ": the all-ranks agreement").c_str());
      err.failure()) {
    return err;
  }
  if (v[1] != ~v[2]) {
    return Desynchronised(private_comm, std::string(op) + ": the ranks' call ids differ");
  }
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);
  if (v[0] < size) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rank " + std::to_string(v[0]) +
                                       " rejected its inputs (its error says why); nothing moved");
  }
  for (size_t i = 0; i < same.size(); ++i) {
    const int64_t lo = v[3 + 2 * i];
    const int64_t hi = ~v[4 + 2 * i];
    if (lo != hi) {
      return ffi::Error::InvalidArgument(std::string(op) + ": " + same[i].first +
                                         " must be identical on every rank, but ranges from " +
                                         std::to_string(lo) + " to " + std::to_string(hi));
    }
  }
  AgreedBefore(CommKey(comm), signature, true);
  return ffi::Error::Success();
}

}  // namespace osmm
