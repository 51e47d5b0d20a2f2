#include "core/counters.h"

#include <cstddef>

namespace osmm {

Counters& GlobalCounters() {
  // Never destroyed: handlers may still run while the interpreter shuts down.
  static Counters* counters = new Counters();
  return *counters;
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
