#include "protocols/issuer.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace osmm {
namespace {

struct IssuerState {
  std::mutex mu;
  std::condition_variable work_ready;  // a job was queued, or stopping
  std::condition_variable idle;        // the queue emptied and nothing is running
  std::deque<RmaIssuer::Job> queue;
  bool running_job = false;
  bool stopping = false;
  std::string failure;  // first failure since the last Drain
  std::thread thread;
};

IssuerState& State() {
  // Never destroyed: Stop() joins the thread at exit; a static destructor must not.
  static IssuerState* state = new IssuerState();
  return *state;
}

void Loop(IssuerState* s) {
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->work_ready.wait(lock, [s] { return s->stopping || !s->queue.empty(); });
    if (s->queue.empty()) return;  // stopping, and nothing left to do
    RmaIssuer::Job job = std::move(s->queue.front());
    s->queue.pop_front();
    const bool skip = !s->failure.empty();
    s->running_job = true;
    lock.unlock();
    std::string failure = skip ? std::string() : job();
    lock.lock();
    s->running_job = false;
    if (!failure.empty() && s->failure.empty()) s->failure = std::move(failure);
    if (s->queue.empty()) s->idle.notify_all();
  }
}

}  // namespace

void RmaIssuer::Submit(Job job) {
  IssuerState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.thread.joinable()) {
    s.stopping = false;
    s.thread = std::thread(Loop, &s);
  }
  s.queue.push_back(std::move(job));
  s.work_ready.notify_one();
}

std::string RmaIssuer::Drain() {
  IssuerState& s = State();
  std::unique_lock<std::mutex> lock(s.mu);
  s.idle.wait(lock, [&s] { return s.queue.empty() && !s.running_job; });
  return std::exchange(s.failure, std::string());
}

void RmaIssuer::Stop() {
  IssuerState& s = State();
  std::thread thread;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    if (!s.thread.joinable()) return;
    s.stopping = true;
    s.work_ready.notify_one();
    thread = std::move(s.thread);
  }
  thread.join();  // the loop runs every queued job before it returns
}

RmaIssuer& GlobalIssuer() {
  static RmaIssuer issuer;
  return issuer;
}

namespace {

struct PollerState {
  std::mutex mu;
  std::condition_variable wake;   // an epoch opened, or stopping
  int open = 0;                   // epochs open (Begin without End)
  MPI_Comm comm = MPI_COMM_NULL;  // the communicator of the latest epoch opened
  // The running poller's own stop flag: a poller started while an older one is being joined
  // gets a fresh flag, so the older one still sees its stop.
  std::shared_ptr<bool> stop;
  std::thread thread;
  std::atomic<int> mode{static_cast<int>(ProgressMode::kOff)};
  std::atomic<int64_t> interval_us{0};
  std::atomic<int64_t> polls{0};
};

PollerState& Poller() {
  static PollerState* state = new PollerState();  // never destroyed, like the issuer's
  return *state;
}

void PollLoop(PollerState* s, std::shared_ptr<bool> stop) {
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->wake.wait(lock, [s, &stop] { return *stop || s->open > 0; });
    if (*stop) return;
    const MPI_Comm comm = s->comm;
    lock.unlock();
    // Only probes, never receives: nothing is sent on the private communicators outside
    // collectives, whose messages a probe does not match. What matters is the progress the
    // call makes on the way (incoming active messages of RMA operations are processed).
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, MPI_STATUS_IGNORE);
    s->polls.fetch_add(1, std::memory_order_relaxed);
    const int64_t interval = s->interval_us.load(std::memory_order_relaxed);
    if (interval > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(interval));
    } else {
      std::this_thread::yield();
    }
    lock.lock();
  }
}

}  // namespace

void SetProgressSettings(ProgressSettings settings) {
  PollerState& s = Poller();
  s.mode.store(static_cast<int>(settings.mode));
  s.interval_us.store(settings.interval_us < 0 ? 0 : settings.interval_us);
}

ProgressSettings GetProgressSettings() {
  PollerState& s = Poller();
  return ProgressSettings{static_cast<ProgressMode>(s.mode.load()), s.interval_us.load()};
}

bool WantsProgress(bool network) {
  switch (static_cast<ProgressMode>(Poller().mode.load())) {
    case ProgressMode::kThread:
      return true;
    case ProgressMode::kAuto:
      return network;
    case ProgressMode::kOff:
      break;
  }
  return false;
}

void BeginProgress(MPI_Comm comm) {
  PollerState& s = Poller();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.thread.joinable()) {
    s.stop = std::make_shared<bool>(false);
    s.thread = std::thread(PollLoop, &s, s.stop);
  }
  s.open += 1;
  s.comm = comm;
  s.wake.notify_all();
}

void EndProgress() {
  PollerState& s = Poller();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.open > 0) s.open -= 1;
}

void StopProgress() {
  PollerState& s = Poller();
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.thread.joinable()) return;
    *s.stop = true;
    s.open = 0;
    s.wake.notify_all();
    thread = std::move(s.thread);
  }
  thread.join();
}

int64_t ProgressPolls() { return Poller().polls.load(); }

}  // namespace osmm
