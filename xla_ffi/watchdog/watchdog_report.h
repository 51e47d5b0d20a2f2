// The watchdog's report (internal to the watchdog*.cc files): the text that says where every
// rank of a communicator is, read over its side channel, and the headlines above it.
#ifndef OSMM_JAX_XLA_FFI_WATCHDOG_REPORT_H_
#define OSMM_JAX_XLA_FFI_WATCHDOG_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "watchdog/watchdog_state.h"

namespace osmm::watchdog {

// `headline`, then one line per rank of the communicator with key `comm_key` (read over its
// side channel with a bounded wait), then which ranks run different calls or lag behind.
// Does not wait for s.mu (the main thread may hold it while freeing channels at exit): without
// it, or without a side channel, only this rank is described.
std::string BuildReport(State& s, uint64_t comm_key, const std::string& headline);

// The headline of a timeout: this rank has waited `waited_ns` in the step `p` is in.
std::string TimeoutHeadline(const Progress& p, int64_t waited_ns);

// The headline of a report after rank `failed_rank` of `c` told this rank (in the step `p` is
// in) that it failed, for `reason`.
std::string FailureHeadline(const Progress& p, const Channel& c, int failed_rank,
                            const std::string& reason);

// "rank 2" or "ranks 1, 3".
std::string RankList(const std::vector<int>& ranks);

// The headline of Desynchronised: this rank found the ranks out of step (`detail` says how).
std::string DesynchronisedHeadline(const std::string& detail);

// The line this rank prints when rank `ending_rank` of `c` tells it that it ends the job:
// where this rank (`own`) is.
std::string NoticeLine(const Channel& c, int ending_rank, const StatusRecord& own);

}  // namespace osmm::watchdog

#endif  // OSMM_JAX_XLA_FFI_WATCHDOG_REPORT_H_
