#include "issuer.h"

#include <condition_variable>
#include <deque>
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

}  // namespace osmm
