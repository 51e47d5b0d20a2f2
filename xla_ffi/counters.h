// Process-wide event counters of the native layer, read from Python as metrics.
#ifndef OSMM_JAX_XLA_FFI_COUNTERS_H_
#define OSMM_JAX_XLA_FFI_COUNTERS_H_

#include <atomic>
#include <cstdint>

namespace osmm {

struct Counters {
  std::atomic<int64_t> rma_ops{0};      // accumulates + puts + gets issued
  std::atomic<int64_t> rma_bytes{0};    // payload bytes of those operations
  std::atomic<int64_t> accumulates{0};  // MPI_Accumulate (MPI_SUM) records
  std::atomic<int64_t> puts{0};         // MPI_Put records
  std::atomic<int64_t> gets{0};         // MPI_Get records
  std::atomic<int64_t> fences{0};       // MPI_Win_fence calls
};

// The single instance shared by all handlers.
Counters& GlobalCounters();

// Sets every counter to zero (live window figures live in the window cache).
void ResetCounters();

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_COUNTERS_H_
