#include "protocols/deferred.h"

#include <mpi.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/counters.h"
#include "core/host_buffer_ops.h"
#include "notified/messages.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

// One deferred reduce, from its start until its finish has its sum (or it is dropped).
struct Job {
  std::unique_ptr<ReduceEpoch> epoch;  // until the waiter is done with it
  std::unique_ptr<std::byte[]> chunk;  // the start's chunk: the RMA origin memory
  std::vector<std::byte> sum;          // this rank's local block, then its finished sum
  // Guarded by Registry::mu.
  bool done = false;
  std::optional<ffi::Error> error;  // the reduce's error, once done
  bool claimed = false;             // the finish ran: `out` and `promise` are set
  void* out = nullptr;
  std::optional<ffi::Promise> promise;
  bool dropped = false;  // nobody will collect it: forget it when done
  bool fetch = false;    // a fetch run ahead (placed pieces), not a reduce
};

// A communicator's waiter: its pending reduces in start order, whether its thread is in one
// of them, and whether that thread was started (it then stays, asleep while the queue is
// empty: a thread started per reduce cost more than the wait it hides).
struct Waiter {
  uint64_t key = 0;  // CommKey of the private communicator
  std::deque<int32_t> queue;
  bool running = false;
  bool started = false;
};

struct Registry {
  std::mutex mu;
  std::condition_variable idle;   // a waiter's queue ran empty
  std::condition_variable ready;  // a waiter's queue has a reduce again
  int32_t last_ticket = 0;
  std::unordered_map<int32_t, std::unique_ptr<Job>> jobs;
  std::vector<std::unique_ptr<Waiter>> waiters;
};

Registry& Jobs() {
  static Registry* registry = new Registry();  // never destroyed: detached threads use it
  return *registry;
}

// Completes the promises of finished reduces, in order, on a thread of its own: XLA runs what
// waited for a sum on the thread that completes its promise, and that may be a call that waits
// for a waiter (DrainDeferred), so it must never be a waiter. One thread for the process,
// started on first use and never stopped (it sleeps when there is nothing to complete).
class Completer {
 public:
  void Post(ffi::Promise promise, std::optional<ffi::Error> error) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(promise), std::move(error));
    if (!started_) {
      started_ = true;
      std::thread([this] { Run(); }).detach();
    }
    ready_.notify_one();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ready_.wait(lock, [this] { return !queue_.empty(); });
      auto [promise, error] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      if (error.has_value()) {
        promise.SetError(std::move(*error));
      } else {
        promise.SetAvailable();
      }
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::pair<ffi::Promise, std::optional<ffi::Error>>> queue_;
  bool started_ = false;
};

Completer& Completions() {
  static Completer* completer = new Completer();  // never destroyed: its thread uses it
  return *completer;
}

// Sets the finish's output and hands its promise to the completer.
void Deliver(Job& job) {
  if (!job.error.has_value()) std::memcpy(job.out, job.sum.data(), job.sum.size());
  Completions().Post(std::move(*job.promise), std::move(job.error));
}

// The end of `ticket`'s reduce on the waiter thread, with `error` if it failed.
void Complete(Registry& r, Waiter& w, int32_t ticket, std::optional<ffi::Error> error) {
  std::unique_ptr<Job> claimed;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    w.queue.pop_front();
    auto it = r.jobs.find(ticket);
    Job& job = *it->second;
    job.done = true;
    job.error = std::move(error);
    if (job.claimed) claimed = std::move(it->second);
    if (job.claimed || job.dropped) r.jobs.erase(it);
  }
  if (claimed != nullptr) Deliver(*claimed);  // unlocked: what it runs may take the lock
}

// The waiter thread of `w`: finishes its reduces one after the other, and sleeps while none is
// left.
void Work(Waiter* w) {
  Registry& r = Jobs();
  HostBufferOps ops;
  for (;;) {
    int32_t ticket = 0;
    Job* job = nullptr;
    {
      std::unique_lock<std::mutex> lock(r.mu);
      if (w->queue.empty()) {
        w->running = false;
        r.idle.notify_all();
        r.ready.wait(lock, [w] { return !w->queue.empty(); });
      }
      w->running = true;
      ticket = w->queue.front();
      job = r.jobs.at(ticket).get();
    }
    ReduceEpoch* epoch = job->epoch.get();
    std::string failure;
    void* sum = job->sum.data();
    ffi::Error err = FinishNotifiedEpoch(ops, epoch, epoch->problem, false, sum,
                                         epoch->problem.empty() ? sum : nullptr, &failure);
    RecordEpochLatency(MPI_Wtime() - epoch->start_time);
    std::optional<ffi::Error> error;
    if (err.failure()) {
      error = std::move(err);
    } else if (!epoch->problem.empty()) {
      error = ffi::Error::Internal(epoch->problem);
    } else if (!failure.empty()) {
      error = ffi::Error::Internal(failure);
    }
    job->epoch.reset();
    job->chunk.reset();
    Complete(r, *w, ticket, std::move(error));
  }
}

Waiter& WaiterOf(Registry& r, uint64_t key) {
  for (auto& w : r.waiters) {
    if (w->key == key) return *w;
  }
  r.waiters.push_back(std::make_unique<Waiter>());
  r.waiters.back()->key = key;
  return *r.waiters.back();
}

}  // namespace

ffi::Error DeferReduce(BufferOps& ops, std::unique_ptr<ReduceEpoch> epoch,
                       const ffi::AnyBuffer& chunk, const ffi::AnyBuffer& local,
                       ffi::Result<ffi::AnyBuffer> ticket) {
  auto job = std::make_unique<Job>();
  job->sum.resize(local.size_bytes());
  std::memcpy(job->sum.data(), local.untyped_data(), local.size_bytes());
  NotifiedReduce* n = epoch->notified.get();
  if (n != nullptr && n->spec.messages) {
    // Every target's message leaves now, staged by the transport (no copy of the chunk to
    // keep), the stamp alone after a problem: before any message of the next product.
    const auto* data = static_cast<const std::byte*>(chunk.untyped_data());
    if (epoch->problem.empty()) epoch->problem = IssueChunk(*epoch, 0, data);
    epoch->chunk_data[0] = nullptr;  // XLA's buffer, gone after this call
    if (ffi::Error err = SendStamps(*n, n->stamp | kStampFailed); err.failure()) return err;
  } else {
    const size_t chunk_bytes = chunk.size_bytes();
    job->chunk.reset(new std::byte[std::max<size_t>(1, chunk_bytes)]);
    std::memcpy(job->chunk.get(), chunk.untyped_data(), chunk_bytes);
    if (epoch->problem.empty()) epoch->problem = IssueChunk(*epoch, 0, job->chunk.get());
  }
  const bool fetch = epoch->notified != nullptr && epoch->notified->spec.place;
  job->fetch = fetch;
  if (epoch->notified != nullptr) epoch->notified->background = true;
  const uint64_t key = CommKey(epoch->private_comm);
  job->epoch = std::move(epoch);
  Registry& r = Jobs();
  int32_t id = 0;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    do {
      r.last_ticket = r.last_ticket == INT32_MAX ? 1 : r.last_ticket + 1;
    } while (r.jobs.count(r.last_ticket) != 0);
    id = r.last_ticket;
    Waiter& w = WaiterOf(r, key);
    w.queue.push_back(id);
    r.jobs.emplace(id, std::move(job));
    if (!w.started) {
      w.started = true;
      w.running = true;
      std::thread(Work, &w).detach();
    } else {
      r.ready.notify_all();
    }
  }
  (fetch ? GlobalCounters().fetches_ahead : GlobalCounters().deferred_reduces)
      .fetch_add(1, std::memory_order_relaxed);
  return ops.WriteTicket(ticket->untyped_data(), id);
}

ffi::Future CollectDeferred(const ffi::AnyBuffer& ticket, ffi::Result<ffi::AnyBuffer> out) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (ticket.element_type() != ffi::DataType::S32 || ticket.element_count() != 1) {
    promise.SetError(
        ffi::Error::InvalidArgument("osmm_reduce_finish_deferred: expected an int32 ticket"));
    return future;
  }
  const int32_t id = *static_cast<const int32_t*>(ticket.untyped_data());
  Registry& r = Jobs();
  std::unique_lock<std::mutex> lock(r.mu);
  auto it = r.jobs.find(id);
  const bool known = it != r.jobs.end() && !it->second->claimed;
  // The test hook stops a reduce's finish, also in a program that fetches ahead before it.
  const bool injected = known && !it->second->fetch && TakeInjectedFailure("osmm_reduce_finish");
  if (!known) {
    lock.unlock();
    promise.SetError(
        ffi::Error::Internal("osmm_reduce_finish_deferred: no deferred reduce has "
                             "ticket " +
                             std::to_string(id)));
    return future;
  }
  Job& job = *it->second;
  if (injected || job.sum.size() != out->size_bytes()) {
    // Nobody will collect it: it still completes its part for the other ranks.
    if (job.done) {
      r.jobs.erase(it);
    } else {
      job.dropped = true;
    }
    lock.unlock();
    promise.SetError(ffi::Error::Internal(
        injected ? "osmm_reduce_finish: injected failure (test hook)"
                 : "osmm_reduce_finish_deferred: the output does not match the reduce's C block"));
    return future;
  }
  job.claimed = true;
  job.out = out->untyped_data();
  job.promise = promise;
  if (job.done) {
    std::unique_ptr<Job> done = std::move(it->second);
    r.jobs.erase(it);
    lock.unlock();
    Deliver(*done);
  }
  return future;
}

void DrainDeferred(MPI_Comm private_comm) {
  const uint64_t key = CommKey(private_comm);
  Registry& r = Jobs();
  std::unique_lock<std::mutex> lock(r.mu);
  for (auto& w : r.waiters) {
    if (w->key != key) continue;
    Waiter* waiter = w.get();
    r.idle.wait(lock, [waiter] { return !waiter->running && waiter->queue.empty(); });
    return;
  }
}

void DrainAllDeferred() {
  Registry& r = Jobs();
  std::unique_lock<std::mutex> lock(r.mu);
  r.idle.wait(lock, [&r] {
    return std::all_of(r.waiters.begin(), r.waiters.end(),
                       [](const auto& w) { return !w->running && w->queue.empty(); });
  });
}

int64_t DropUncollected() {
  Registry& r = Jobs();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t count = 0;
  for (auto it = r.jobs.begin(); it != r.jobs.end();) {
    Job& job = *it->second;
    if (job.claimed) {
      ++it;
      continue;
    }
    ++count;
    if (job.done) {
      it = r.jobs.erase(it);
    } else {
      job.dropped = true;
      ++it;
    }
  }
  return count;
}

int64_t HeldDeferred() {
  Registry& r = Jobs();
  std::lock_guard<std::mutex> lock(r.mu);
  return static_cast<int64_t>(r.jobs.size());
}

}  // namespace osmm
