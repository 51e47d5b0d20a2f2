// The nanobind module osmm_jax._src.runtime._osmm_ffi: hands the CPU FFI handlers to JAX and
// exposes the native layer's counters, window cache and transfer-record format to Python. (The CUDA
// handlers live in the sibling module _osmm_ffi_cuda; both share one native core, so counters,
// windows and communicators are the same whichever platform a call runs on.)
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "core/common.h"
#include "core/counters.h"
#include "core/records.h"
#include "core/windows.h"
#include "handlers/handlers.h"
#include "handlers/registrations.h"
#include "protocols/deferred.h"
#include "protocols/issuer.h"
#include "watchdog/watchdog.h"

namespace nb = nanobind;

namespace {

nb::dict Registrations() {
  nb::dict d = osmm::HandlerRegistrations(OsmmFetch, OsmmReduceStart, OsmmReduceIssue,
                                          OsmmReduceFinish, OsmmWatch);
  d["osmm_allreduce"] = osmm::EncapsulateHandler(OsmmAllreduce);
  d["osmm_reduce_start_deferred"] = osmm::EncapsulateHandler(OsmmReduceStartDeferred);
  d["osmm_reduce_finish_deferred"] = osmm::EncapsulateHandler(OsmmReduceFinishDeferred);
  return d;
}

nb::dict Stats() {
  const osmm::Counters& c = osmm::GlobalCounters();
  nb::dict d;
  d["rma_ops"] = c.rma_ops.load();
  d["rma_bytes"] = c.rma_bytes.load();
  d["sent_bytes"] = c.sent_bytes.load();
  d["accumulates"] = c.accumulates.load();
  d["puts"] = c.puts.load();
  d["gets"] = c.gets.load();
  d["fences"] = c.fences.load();
  d["calls"] = c.calls.load();
  d["agreements"] = c.agreements.load();
  d["staged_bytes"] = c.staged_bytes.load();
  d["staging_seconds"] = static_cast<double>(c.staging_ns.load()) * 1e-9;
  d["closing_fence_seconds"] = static_cast<double>(c.closing_fence_ns.load()) * 1e-9;
  d["notifications"] = c.notifications.load();
  d["notify_wait_seconds"] = static_cast<double>(c.notify_wait_ns.load()) * 1e-9;
  d["deferred_deliveries"] = c.deferred_deliveries.load();
  d["credit_reads"] = c.credit_reads.load();
  d["credit_pushes"] = c.credit_pushes.load();
  d["slot_window_bytes"] = c.slot_window_bytes.load();
  d["messages"] = c.messages.load();
  d["message_bytes"] = c.message_bytes.load();
  d["resyncs"] = c.resyncs.load();
  d["accumulator_folds"] = c.accumulator_folds.load();
  d["deferred_reduces"] = c.deferred_reduces.load();
  d["fetches_ahead"] = c.fetches_ahead.load();
  d["deferred_held"] = osmm::HeldDeferred();
  d["progress_polls"] = osmm::ProgressPolls();
  d["windows"] = osmm::LiveWindowCount();
  d["window_bytes"] = osmm::LiveWindowBytes();
  return d;
}

// [(own, address, bytes)] of every live host window's memory in this process (windows.h).
nb::list WindowRegions() {
  nb::list regions;
  for (const osmm::WindowRegion& r : osmm::LiveWindowRegions()) {
    regions.append(nb::make_tuple(r.own, static_cast<uint64_t>(r.address), r.bytes));
  }
  return regions;
}

// (bucket upper bounds in seconds, counts per bucket with +Inf last, sum of seconds).
nb::tuple LatencyHistogram() {
  const osmm::Counters& c = osmm::GlobalCounters();
  nb::list bounds, counts;
  for (double b : osmm::Counters::kLatencyBounds) bounds.append(b);
  for (const auto& bucket : c.latency_buckets) counts.append(bucket.load());
  return nb::make_tuple(bounds, counts, static_cast<double>(c.latency_sum_ns.load()) * 1e-9);
}

// Runs `free` (FreeWindows or ReleaseWindows) with nothing of this layer's in the background:
// no deferred reduce may still use a window being freed (every program is over, after
// jax.effects_barrier(), so no finish will come for one not collected yet), nothing may still
// be issuing into one, nor polling a communicator being freed. Collective and possibly slow:
// other Python threads run meanwhile. Raises the error `free` returns.
template <typename Free>
void FreeQuiet(Free free) {
  std::string message;
  {
    nb::gil_scoped_release release;
    osmm::DrainAllDeferred();
    osmm::DropUncollected();
    osmm::GlobalIssuer().Stop();
    osmm::StopProgress();
    xla::ffi::Error err = free();
    if (err.failure()) message = err.message();
  }
  if (!message.empty()) throw std::runtime_error(message);
}

void FreeWindows() {
  FreeQuiet([] { return osmm::FreeWindows(); });
}

int64_t ReleaseWindows() {
  int64_t released = 0;
  FreeQuiet([&released] { return osmm::ReleaseWindows(&released); });
  return released;
}

void PrepareComm(int64_t handle) {
  std::string message;
  {
    nb::gil_scoped_release release;
    xla::ffi::Error err = osmm::RequireMpiReady();
    MPI_Comm dup = MPI_COMM_NULL;
    if (err.success()) err = osmm::PrivateComm(osmm::CommFromHandle(handle), &dup);
    if (err.failure()) message = err.message();
  }
  if (!message.empty()) throw std::runtime_error(message);
}

void SetWatchdog(double timeout_seconds, bool raise) {
  osmm::SetWatchdogSettings(osmm::WatchdogSettings{timeout_seconds, raise});
}

nb::tuple WatchdogSettings() {
  const osmm::WatchdogSettings s = osmm::GetWatchdogSettings();
  return nb::make_tuple(s.timeout_seconds, s.raise);
}

void SetProgress(int64_t mode, int64_t interval_us) {
  if (mode < 0 || mode > static_cast<int64_t>(osmm::ProgressMode::kAuto)) {
    throw std::invalid_argument("progress mode must be 0 (off), 1 (thread) or 2 (auto)");
  }
  osmm::SetProgressSettings(
      osmm::ProgressSettings{static_cast<osmm::ProgressMode>(mode), interval_us});
}

nb::tuple ProgressSettings() {
  const osmm::ProgressSettings s = osmm::GetProgressSettings();
  return nb::make_tuple(static_cast<int64_t>(s.mode), s.interval_us);
}

std::string DescribeRanks(int64_t handle, const std::string& headline) {
  nb::gil_scoped_release release;  // waits for other ranks' records
  return osmm::DescribeRanks(osmm::CommFromHandle(handle), headline);
}

std::string ReportFailure(const std::string& reason) {
  nb::gil_scoped_release release;  // writes into other ranks' windows, bounded
  return osmm::ReportFailure(reason);
}

std::string FailureReport(int64_t handle) {
  nb::gil_scoped_release release;  // reads other ranks' records if there is a notice
  return osmm::FailureReport(osmm::CommFromHandle(handle));
}

void BeginHostStep(int64_t handle) {
  osmm::BeginCall(osmm::CallKind::kHost, 0);
  osmm::EnterStep(osmm::Step::kHostAgreement, osmm::CommFromHandle(handle));
}

void EndHostStep() {
  osmm::LeaveStep();
  osmm::EndCall();
}

std::string MpiLibraryVersion() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  // Allowed before MPI_Init and after MPI_Finalize.
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) {
    throw std::runtime_error("MPI_Get_library_version failed");
  }
  return std::string(text, static_cast<size_t>(length));
}

}  // namespace

// The module's name comes from the build (_osmm_ffi, or _osmm_ffi_openmpi for a wheel's second
// MPI ABI: CMakeLists.txt, OSMM_MPI_ABI).
#ifndef OSMM_FFI_MODULE
#define OSMM_FFI_MODULE _osmm_ffi
#endif

NB_MODULE(OSMM_FFI_MODULE, m) {
  m.doc() = "Native layer of osmm_jax: XLA FFI handlers for one-sided MPI transfers.";
  m.def("registrations", &Registrations,
        "Dict of FFI target name -> capsule, for jax.ffi.register_ffi_target (cpu, api 1).");
  m.def("drop_uncollected", &osmm::DropUncollected,
        "Forget the results of deferred reduces whose finish did not run (their program failed "
        "between the start and the finish); returns how many.");
  m.def("window_regions", &WindowRegions,
        "[(own, address, bytes)]: where the memory of every live host window lies in this "
        "process, this rank's own and other ranks' that MPI maps here (shared memory within a "
        "node).");
  m.def("stats", &Stats,
        "This process's counters since start: rma_ops, rma_bytes, sent_bytes, accumulates, "
        "puts, gets, fences, calls (RMA epochs), agreements; closing_fence_seconds (time in reduce "
        "epochs' closing fences); notifications, notify_wait_seconds, deferred_deliveries, "
        "credit_reads, credit_pushes, slot_window_bytes, accumulator_folds, resyncs and "
        "deferred_held (the notified mode); messages "
        "and message_bytes (its message transport); "
        "progress_polls "
        "(MPI polls of the progress thread); staged_bytes and staging_seconds "
        "(device <-> host copies of the GPU handlers); the live windows and their window_bytes.");
  m.def("latency_histogram", &LatencyHistogram,
        "RMA epoch latencies: (bucket upper bounds in s, per-bucket counts, +Inf last; sum in s).");
  m.def("free_windows", &FreeWindows,
        "Free all cached MPI windows in creation order. Collective: call on every rank, after "
        "jax.effects_barrier() and before MPI_Finalize. Idempotent.");
  m.def("release_windows", &ReleaseWindows,
        "Free all cached MPI windows in creation order between products (they are created "
        "again on demand) and forget deferred results no finish collected; returns the bytes "
        "freed on this rank. Collective: call on every "
        "rank, after jax.effects_barrier().");
  m.def("prepare_comm", &PrepareComm, nb::arg("comm"),
        "Create the native layer's private duplicate of the communicator with handle `comm` "
        "(signed int64, as passed to the handlers). Collective over that communicator; "
        "optional (the first handler call does it otherwise), but calling it from the thread "
        "that owns the communicator keeps every collective on it on that thread.");
  m.def("set_watchdog", &SetWatchdog, nb::arg("timeout_seconds"), nb::arg("raise_error"),
        "Bound every blocking MPI step of the native layer to `timeout_seconds` (<= 0: no "
        "bound); `raise_error`: fail the call where the step allows it instead of ending the "
        "job. Starts the watchdog thread.");
  m.def("watchdog_settings", &WatchdogSettings, "(timeout_seconds, raise_error) in force.");
  m.def("set_progress", &SetProgress, nb::arg("mode"), nb::arg("interval_us"),
        "MPI progress during reduce epochs: mode 0 (off), 1 (a thread polls during every "
        "epoch) or 2 (auto: only epochs whose communicator spans more than one node); the "
        "thread polls every `interval_us` microseconds (0: continuously).");
  m.def("progress_settings", &ProgressSettings, "(mode, interval_us) in force.");
  m.def("describe_ranks", &DescribeRanks, nb::arg("comm"), nb::arg("headline"),
        "A report of where every rank of the communicator with handle `comm` is (read through "
        "the watchdog's side channel, waiting at most 2 s for each rank), under `headline`.");
  m.def("report_failure", &ReportFailure, nb::arg("reason"),
        "Tell every other rank, through the watchdog's side channels (no collective), that this "
        "rank failed for `reason`: a rank waiting in a blocking step then ends the job at once. "
        "Once per process; returns a line on ranks that could not be told within 1 s, or \"\".");
  m.def(
      "end_job_after_failure",
      [](double grace_seconds) {
        nb::gil_scoped_release release;
        osmm::EndJobAfterFailure(grace_seconds);
      },
      nb::arg("grace_seconds"),
      "After report_failure, in a multi-rank job: wait `grace_seconds`, then end the job with "
      "this rank's report (MPI_Abort), instead of a collective teardown at exit. Returns at "
      "once if no failure was reported or the job has one rank.");
  m.def("failure_report", &FailureReport, nb::arg("comm"),
        "The report on the communicator with handle `comm` headed by a failed rank's notice "
        "found in this rank's window (local memory), or \"\" if there is none.");
  m.def("begin_host_step", &BeginHostStep, nb::arg("comm"),
        "Mark this rank as blocked in matmul's own collective on `comm` (watched).");
  m.def("end_host_step", &EndHostStep, "End what begin_host_step marked.");
  m.def(
      "inject_failure",
      [](const std::string& op, int64_t count) {
        if (!osmm::InjectFailure(op, count)) {
          throw std::invalid_argument("inject_failure supports op='osmm_reduce_finish' only");
        }
      },
      nb::arg("op"), nb::arg("count") = 1,
      "Test hook: the next `count` calls of osmm_reduce_finish on this process fail at their "
      "start, as if XLA had failed between the reduce's start and finish.");
  m.def(
      "watchdog_exit_code", [] { return osmm::kWatchdogExitCode; },
      "The exit code of MPI_Abort after a timeout or when the ranks are out of step.");
  m.def("mpi_library_version", &MpiLibraryVersion,
        "MPI_Get_library_version() of the MPI this module was linked against.");
  // The transfer-record format (records.h), for the lowering that writes the records.
  nb::list fields;
  for (const char* name : osmm::kRecordFieldNames) fields.append(name);
  m.attr("RECORD_FIELDS") = nb::steal<nb::tuple>(PyList_AsTuple(fields.ptr()));
  m.attr("OP_ACCUMULATE") = static_cast<int64_t>(osmm::kOpAccumulate);
  m.attr("OP_PUT") = static_cast<int64_t>(osmm::kOpPut);
  m.attr("REGION_A") = static_cast<int64_t>(osmm::kRegionA);
  m.attr("REGION_B") = static_cast<int64_t>(osmm::kRegionB);
}
