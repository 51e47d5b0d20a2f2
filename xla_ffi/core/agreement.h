// The all-ranks agreement that precedes any RMA.
//
// Every rank validates its operands and records before anything moves, then all ranks agree
// (one small MPI_Allreduce on this layer's private duplicate of the communicator, see
// PrivateComm in windows.h; windows are created over that duplicate too) on whether every rank
// accepted its inputs and on the attributes that must be identical everywhere (window size,
// B offset, window memory). If anything is wrong, every rank returns an error and no rank
// issues RMA or touches a window: a bad record on one rank can neither hang the others in a
// fence nor leave the windows half-written. Only MPI failures after the agreement can differ
// between ranks.
//
// The checks depend only on a call's static signature (its rank-independent call_id,
// attributes and operand shapes), so a signature all ranks have accepted once is not agreed on
// again: the steady state of a jitted loop pays no agreement collective. (This assumes what
// the rest of the design does too: all ranks run the same compiled programs in the same order.)
#ifndef OSMM_JAX_XLA_FFI_AGREEMENT_H_
#define OSMM_JAX_XLA_FFI_AGREEMENT_H_

#include <mpi.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/common.h"

namespace osmm {

// A 64-bit FNV-1a hash of a call's static signature (its attributes and operand shapes), which
// determines the outcome of its local checks completely.
class Signature {
 public:
  Signature& Add(int64_t value) {
    for (int i = 0; i < 8; ++i) {
      hash_ = (hash_ ^ static_cast<uint64_t>((value >> (8 * i)) & 0xff)) * 1099511628211ULL;
    }
    return *this;
  }
  Signature& Add(ffi::Span<const int64_t> values) {
    Add(static_cast<int64_t>(values.size()));
    for (int64_t v : values) Add(v);
    return *this;
  }
  Signature& Add(const ffi::AnyBuffer& buffer) {
    Add(static_cast<int64_t>(buffer.element_type()));
    return Add(buffer.dimensions());
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 14695981039346656037ULL;
};

// Values that must be identical on every rank, by name.
using SameValues = std::vector<std::pair<const char*, int64_t>>;

// Collective (unless `signature` was agreed before on this communicator): agrees on whether
// every rank accepted its inputs (`problem` empty), runs the same call (`call_id`) and has the
// values in `same`. Returns the same verdict everywhere: success, or an InvalidArgument naming
// this rank's problem or the first rank that had one. Differing call ids mean the ranks are out
// of step (see Desynchronised in watchdog.h). On success *private_comm is this layer's
// duplicate of `comm`, over which windows are made. Waited for under the watchdog.
ffi::Error Agree(MPI_Comm comm, const char* op, int64_t call_id, const std::string& problem,
                 const SameValues& same, uint64_t signature, MPI_Comm* private_comm);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_AGREEMENT_H_
