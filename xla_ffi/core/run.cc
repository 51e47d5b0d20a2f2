// The program run of the handler call on this thread (common.h: CurrentRun, RunScope).
#include <cstdint>

#include "core/common.h"

namespace osmm {
namespace {

thread_local int64_t current_run = 0;

}  // namespace

int64_t CurrentRun() { return current_run; }

void SetCurrentRun(int64_t run) { current_run = run; }

}  // namespace osmm
