#include "counters.h"

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
  c.accumulates.store(0);
  c.puts.store(0);
  c.gets.store(0);
  c.fences.store(0);
}

}  // namespace osmm
