#include "counters.h"

#include <cstddef>

namespace osmm {

Counters& GlobalCounters() {
  // Never destroyed: handlers may still run while the interpreter shuts down.
  static Counters* counters = new Counters();
  return *counters;
}

void ResetCounters() {
  Counters& c = GlobalCounters();
  c.rma_ops.store(0);
  c.rma_bytes.store(0);
  c.sent_bytes.store(0);
  c.accumulates.store(0);
  c.puts.store(0);
  c.gets.store(0);
  c.fences.store(0);
  c.calls.store(0);
  c.agreements.store(0);
  for (auto& bucket : c.latency_buckets) bucket.store(0);
  c.latency_sum_ns.store(0);
}

void RecordEpochLatency(double seconds) {
  Counters& c = GlobalCounters();
  std::size_t i = 0;
  while (i < Counters::kLatencyBounds.size() && seconds > Counters::kLatencyBounds[i]) ++i;
  c.latency_buckets[i].fetch_add(1, std::memory_order_relaxed);
  c.latency_sum_ns.fetch_add(static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
  c.calls.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace osmm
