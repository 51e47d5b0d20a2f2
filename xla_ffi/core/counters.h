// Process-wide event counters of the native layer, read from Python as metrics.
#ifndef OSMM_JAX_XLA_FFI_COUNTERS_H_
#define OSMM_JAX_XLA_FFI_COUNTERS_H_

#include <array>
#include <atomic>
#include <cstdint>

namespace osmm {

struct Counters {
  std::atomic<int64_t> rma_ops{0};       // accumulates + puts + gets issued
  std::atomic<int64_t> rma_bytes{0};     // payload bytes of those operations
  std::atomic<int64_t> sent_bytes{0};    // payload bytes of accumulates + puts (pushed out)
  std::atomic<int64_t> accumulates{0};   // MPI_Accumulate (MPI_SUM) records
  std::atomic<int64_t> puts{0};          // MPI_Put records
  std::atomic<int64_t> gets{0};          // MPI_Get records
  std::atomic<int64_t> fences{0};        // MPI_Win_fence calls
  std::atomic<int64_t> calls{0};         // fetch and reduce epochs run
  std::atomic<int64_t> agreements{0};    // agreement collectives run (first call of a signature)
  std::atomic<int64_t> staged_bytes{0};  // bytes copied between device buffers and host memory
  std::atomic<int64_t> staging_ns{0};    // wall time of those copies, synchronisation included
  std::atomic<int64_t> closing_fence_ns{0};  // wall time in reduce epochs' closing fences
  // The notified mode (notify.h).
  std::atomic<int64_t> notifications{0};        // stamps sent to targets
  std::atomic<int64_t> notify_wait_ns{0};       // wall time in notified finishes
  std::atomic<int64_t> deferred_deliveries{0};  // targets whose slot was busy at issue time
  std::atomic<int64_t> credit_reads{0};         // targets' progress read remotely
  std::atomic<int64_t> credit_pushes{0};        // progress written into an origin's window
  std::atomic<int64_t> slot_window_bytes{0};    // size of the last slots window used
  std::atomic<int64_t> deferred_reduces{0};     // reduces finished by a waiter (deferred.h)
  std::atomic<int64_t> fetches_ahead{0};        // fetches finished by a waiter (deferred.h)
  std::atomic<int64_t> messages{0};       // messages sent by the message transport (messages.h)
  std::atomic<int64_t> message_bytes{0};  // their bytes, stamps and images' zeros included
  std::atomic<int64_t> resyncs{0};  // times the ranks started again after an abandoned product
  // Ordered sums whose lower origins moved to the slots window's accumulator (ordered_sum.h).
  std::atomic<int64_t> accumulator_folds{0};

  // Histogram of RMA epoch latencies (opening fence to closing fence, seconds): counts per
  // bucket, not cumulative; the last bucket is +Inf. Lock-free, so recording never blocks.
  static constexpr std::array<double, 12> kLatencyBounds = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3,
                                                            1e-2, 3e-2, 1e-1, 3e-1, 1.0,  3.0};
  std::array<std::atomic<int64_t>, kLatencyBounds.size() + 1> latency_buckets{};
  std::atomic<int64_t> latency_sum_ns{0};
};

// Records one RMA epoch of `seconds` in the latency histogram.
void RecordEpochLatency(double seconds);

// The single instance shared by all handlers.
Counters& GlobalCounters();

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_COUNTERS_H_
