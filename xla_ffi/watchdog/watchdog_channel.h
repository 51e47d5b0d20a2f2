// The watchdog's side channels (internal to the watchdog*.cc files): per communicator, a
// duplicate of it and a one-record window under a passive-target epoch, in which each rank
// publishes its status record and which the others read with request-based MPI_Rget, so that a
// stuck collective is not involved and an unresponsive rank costs a bounded wait.
// OpenStatusChannel and CloseStatusChannels (watchdog.h) create and free them.
#ifndef OSMM_JAX_XLA_FFI_WATCHDOG_CHANNEL_H_
#define OSMM_JAX_XLA_FFI_WATCHDOG_CHANNEL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "watchdog/watchdog_state.h"

namespace osmm::watchdog {

// The side channel of the communicator with key `key` (the caller's or its private
// duplicate), or nullptr. Under s.mu.
Channel* FindChannelLocked(State& s, uint64_t key);

// Publishes `own` in `c`'s window: every field but kNotice, which the other ranks write.
void Publish(Channel& c, const StatusRecord& own);

// The rank that has told this one over `c` that it is ending the job, the first time it is
// seen; -1 otherwise.
int TakeNotice(Channel& c);

constexpr double kNotifySeconds = 1.0;  // how long to wait for other ranks to take a notice

// Runs `call(r)` for every rank r != `self` of a `size`-rank communicator, each on a thread of
// its own, and waits at most `seconds` for them; returns by rank whose call returned true by
// then. A call still running then goes on on its own (it must own what it uses), so that no
// MPI call to an unresponsive rank can hold up the caller.
std::vector<bool> ForEachPeer(int size, int self, double seconds,
                              const std::function<bool(int)>& call);

// Reads every rank's record over `c` (this rank's from its own progress); `answered[r]` says
// whose arrived within kReadSeconds. `threads_ok` false (no MPI_THREAD_MULTIPLE): reads only
// this rank's.
void ReadRecords(const Channel& c, bool threads_ok, std::vector<StatusRecord>* records,
                 std::vector<bool>* answered);

// Tells every other rank on `c` that this rank ends the job, waiting at most kNotifySeconds.
void NotifyOthers(const Channel& c, bool threads_ok);

// Writes "this rank failed: `reason`" into every rank's window on `c` (its own included),
// waiting at most kNotifySeconds; returns by rank who took it (this rank: false).
std::vector<bool> PublishFailure(Channel& c, bool threads_ok, const std::string& reason);

// The rank of `c` whose failure notice is in this rank's window (local memory), with its
// reason; -1 if none.
int ReadFailure(const Channel& c, std::string* reason);

}  // namespace osmm::watchdog

#endif  // OSMM_JAX_XLA_FFI_WATCHDOG_CHANNEL_H_
