// Failure injection, a test hook (InjectFailure, TakeInjectedFailure): the next calls of an op
// fail at their start, as if XLA had failed there.
#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "watchdog/watchdog.h"

namespace osmm {
namespace {

// Injected failures left, by op (InjectionIndex).
std::array<std::atomic<int64_t>, 1>& InjectedFailures() {
  static std::array<std::atomic<int64_t>, 1> left{};
  return left;
}

int InjectionIndex(const std::string& op) { return op == "osmm_reduce_finish" ? 0 : -1; }

}  // namespace

bool InjectFailure(const std::string& op, int64_t count) {
  const int index = InjectionIndex(op);
  if (index < 0) return false;
  InjectedFailures()[index].store(count);
  return true;
}

bool TakeInjectedFailure(const char* op) {
  const int index = InjectionIndex(op);
  if (index < 0) return false;
  auto& slot = InjectedFailures()[index];
  int64_t left = slot.load(std::memory_order_relaxed);
  while (left > 0) {
    if (slot.compare_exchange_weak(left, left - 1)) return true;
  }
  return false;
}

}  // namespace osmm
